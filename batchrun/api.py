"""batchrun from Python: `Engine.load(...)` for the batched engine, `Job(...)` for a batch job
with the command line's job folder, resume and exactly-once output.

    import batchrun
    engine = batchrun.Engine.load()                     # the demo model; or model="path or id"
    outs = engine.generate(["Once upon", [{"role": "user", "content": "hi"}]], max_tokens=8)
"""

from __future__ import annotations

from typing import Any

from batchrun.engine.request import EngineConfig


class Engine:
    """The batched engine (the seed's API: add_request, step, abort, run, generate, stats,
    prefix-cache save / load / clear). `load` picks the backend from the model: mlx-vlm for a
    vision-language model, mlx-lm otherwise."""

    @staticmethod
    def load(model: str | None = None, *, vision: bool | None = None,
             config: EngineConfig | None = None, **engine_options) -> Any:
        """Load `model` (a folder or Hugging Face id; None: the bundled demo model).
        `engine_options` are EngineConfig's fields (max_concurrency, memory_utilization,
        prefix_cache, cache_dir, ...). `vision` forces (True) or forbids (False) the vision
        backend; by default the model's config decides."""
        return load_engine(model, config or EngineConfig(**engine_options), vision)


def load_engine(model: str | None, config: EngineConfig, vision: bool | None = None) -> Any:
    """The one place that chooses the backend for a model."""
    from batchrun.models import is_vision_config, read_config, resolve

    if vision is None:
        vision = is_vision_config(read_config(resolve(model)))
    if vision:
        from batchrun.engine.vision import VisionEngine

        return VisionEngine.load(model, config)
    from batchrun.engine.engine import Engine as TextEngine

    return TextEngine.load(model, config)
