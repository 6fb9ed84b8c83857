import pytest

import batchrun  # noqa: F401  (routes MLX to OpenBLAS before mlx.core is imported)
from batchrun.models import load_model


@pytest.fixture(scope="session")
def demo():
    """The bundled demo model, loaded once through mlx_lm.load."""
    return load_model(None)


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path, monkeypatch):
    """Keep caches and job folders of a test inside its own temporary folder."""
    monkeypatch.setenv("BATCHRUN_CACHE_DIR", str(tmp_path / "cache"))
