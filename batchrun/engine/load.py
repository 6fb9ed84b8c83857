"""The one place that chooses a model's backend: mlx-vlm for a vision-language model, mlx-lm
otherwise (the API, the command line and Ray workers all load engines here)."""

from __future__ import annotations

from typing import Any

from batchrun.engine.request import EngineConfig


def load_engine(model: str | None, config: EngineConfig, vision: bool | None = None) -> Any:
    """The engine for `model` (None: the demo model); `vision` forces or forbids the vision
    backend, by default the model's config decides."""
    from batchrun.models import is_vision_config, read_config, resolve

    if vision is None:
        vision = is_vision_config(read_config(resolve(model)))
    if vision:
        from batchrun.engine.vision import VisionEngine

        return VisionEngine.load(model, config)
    from batchrun.engine.engine import Engine

    return Engine.load(model, config)
