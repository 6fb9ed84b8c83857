"""The engine's scheduling and memory knobs, and the defaults the device decides (types.py holds
them until they move here)."""

from batchrun.engine.types import (  # noqa: F401
    DEFAULT_DRAFT_MODEL_TOKENS_GPU,
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_NGRAM_TOKENS_GPU,
    DEVICE_DEFAULTS,
    EngineConfig,
    default_draft_tokens,
    device_defaults,
)
