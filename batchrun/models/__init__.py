"""Load models through mlx-lm, the same path for the bundled demo model and any real one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = REPO_ROOT / "sample_data" / "demo-model"
DEMO_NAME = "demo"


@dataclass(slots=True)
class LoadedModel:
    model: Any
    tokenizer: Any  # mlx-lm TokenizerWrapper
    config: dict
    path: str
    context_length: int | None


def resolve(model: str | None) -> str:
    """The path or Hugging Face id to load; None or "demo" means the bundled demo model."""
    if model in (None, "", DEMO_NAME):
        if (DEMO_MODEL / "config.json").exists():
            return str(DEMO_MODEL)
        # Installed without the repo: rebuild the (deterministic) demo model once.
        from batchrun.models.build import build

        cache = Path(os.environ.get("BATCHRUN_CACHE_DIR", Path.home() / ".cache" / "batchrun"))
        target = cache / "demo-model"
        if not (target / "config.json").exists():
            build(target)
        return str(target)
    return model


def load_model(model: str | None) -> LoadedModel:
    from mlx_lm.utils import load

    path = resolve(model)
    m, tokenizer, config = load(path, return_config=True)
    return LoadedModel(m, tokenizer, config, path, context_length(config))


def context_length(config: dict) -> int | None:
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        value = config.get(key) or config.get("text_config", {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None
