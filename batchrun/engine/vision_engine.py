"""The engine over the vision backend: the step loop of engine.py with backends/vision.py's
VisionBackend, so rows with images share a batch with text-only rows."""

from __future__ import annotations

from typing import Any

from batchrun.engine.backends.vision import VisionBackend, VisionInputs
from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.types import SamplingParams
from batchrun.models.weights import WeightPlan


class VisionEngine(Engine):
    """The engine (engine.py) over the vision backend: `add_vision` for rows with images,
    `add_tokens` / `add_request` for text-only rows."""

    def __init__(self, model: Any, processor: Any, config: EngineConfig | None = None,
                 context_length: int | None = None, model_path: str = "",
                 model_fingerprint: str = "", weight_plan: WeightPlan | None = None):
        self.processor = processor
        super().__init__(model, None, config, context_length, model_path,
                         model_fingerprint=model_fingerprint,
                         backend=VisionBackend(model, processor), weight_plan=weight_plan)

    @staticmethod
    def _load_model(model: str | None):
        from batchrun.models import load_vision_model

        return load_vision_model(model)

    def add_vision(self, inputs: VisionInputs, params: SamplingParams) -> int:
        """A request from a processor's output (VisionPrompts.prepare)."""
        return self.add_tokens(inputs.input_ids, params, inputs)
