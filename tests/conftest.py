import os

import pytest

import batchrun  # noqa: F401  (routes MLX to OpenBLAS before mlx.core is imported)
from batchrun.models import RANDOM_DEMO_MODEL, load_model

# In tests the default model ("demo", or no --model) is the random-weight one, for module
# fixtures and subprocesses too; the `trained` fixture gives back the trained one.
os.environ["BATCHRUN_DEMO_MODEL"] = str(RANDOM_DEMO_MODEL)


@pytest.fixture(scope="session")
def demo():
    """The demo tokenizer with random weights, loaded once through mlx_lm.load: in tests the
    default model ("demo", or no --model) is this one, whose rows run to their max_tokens."""
    return load_model(str(RANDOM_DEMO_MODEL))


@pytest.fixture
def trained(monkeypatch):
    """The trained demo model as the default model, as users get it; loaded."""
    monkeypatch.delenv("BATCHRUN_DEMO_MODEL", raising=False)
    return load_model(None)


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path, monkeypatch):
    """Keep caches and job folders of a test inside its own temporary folder; the random
    demo model is the default one."""
    monkeypatch.setenv("BATCHRUN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("BATCHRUN_DEMO_MODEL", str(RANDOM_DEMO_MODEL))
