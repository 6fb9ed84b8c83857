"""The one place that chooses a model's backend: mlx-vlm for a vision-language model, mlx-lm
otherwise (the API, the command line and Ray workers all load engines here)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from batchrun.engine.request import EngineConfig

# Set by the command line, whose process is batchrun's own: a text model's tokenizer loads with
# PyTorch hidden from transformers, which otherwise imports it (and what it pulls in) whenever
# it is installed: 10-15 s of a `batchrun run` on the H200 host, for nothing MLX uses.
HIDE_TORCH = False


def load_engine(model: str | None, config: EngineConfig, vision: bool | None = None) -> Any:
    """The engine for `model` (None: the demo model); `vision` forces or forbids the vision
    backend, by default the model's config decides."""
    from batchrun.models import is_vision_config, read_config, resolve

    if vision is None:
        vision = is_vision_config(read_config(resolve(model)))
    if vision:  # image processors may use PyTorch
        from batchrun.engine.vision import VisionEngine

        return VisionEngine.load(model, config)
    from batchrun.engine.engine import Engine

    if not HIDE_TORCH:
        return Engine.load(model, config)
    try:
        with torch_hidden():
            return Engine.load(model, config)
    except ImportError as e:  # a tokenizer's own code that needs it after all
        if "torch" not in str(e):
            raise
        return Engine.load(model, config)


@contextlib.contextmanager
def torch_hidden() -> Iterator[None]:
    """`import torch` fails, and transformers sees no PyTorch, inside the block (unless it
    was imported already)."""
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
