"""Where batchrun keeps its files when the user names no folder (cheap to import: the CLI
needs these before anything heavy loads)."""

from __future__ import annotations

import os
from pathlib import Path


def home_cache_dir() -> Path:
    """The cache folder used when the user names none (no --cache-dir, no $BATCHRUN_CACHE_DIR)."""
    return Path.home() / ".cache" / "batchrun"


def default_cache_dir() -> Path:
    return Path(os.environ.get("BATCHRUN_CACHE_DIR") or home_cache_dir())
