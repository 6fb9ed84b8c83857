"""The one place that chooses a model's backend: mlx-vlm for a vision-language model, mlx-lm
otherwise (the API, the command line and Ray workers all load engines here)."""

from __future__ import annotations

import sys
from typing import Any

from batchrun.engine.config import EngineConfig


def load_engine(model: str | None, config: EngineConfig, vision: bool | None = None) -> Any:
    """The engine for `model` (None: the demo model); `vision` forces or forbids the vision
    backend, by default the model's config decides."""
    from batchrun.models import is_vision_config, read_config, resolve

    if vision is None:
        vision = is_vision_config(read_config(resolve(model)))
    if vision:  # image processors may use PyTorch
        from batchrun.engine.vision_engine import VisionEngine

        return VisionEngine.load(model, config)
    from batchrun.engine.engine import Engine

    return Engine.load(model, config)


def keep_torch_out(model: str | None) -> bool:
    """For a process that is batchrun's own (the command line), before anything imports
    transformers: when `model` is a text model, PyTorch is hidden (`import torch` fails, and
    transformers sees none). transformers imports it whenever it is installed, with what it
    pulls in: 10-15 s of every `batchrun run` on the H200 host, for nothing MLX uses. Vision
    models keep it (image processors may use it). Whether it is now hidden."""
    from batchrun.models import is_vision_config, read_config, resolve

    if "torch" in sys.modules or is_vision_config(read_config(resolve(model))):
        return sys.modules.get("torch", 0) is None
    sys.modules["torch"] = None  # type: ignore[assignment]
    return True
