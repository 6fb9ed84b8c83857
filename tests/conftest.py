import os

import pytest

import batchrun  # noqa: F401  (routes MLX to OpenBLAS before mlx.core is imported)
from batchrun.models import RANDOM_DEMO_MODEL, load_model

# In tests the default model ("demo", or no --model) is the random-weight one, for module
# fixtures and subprocesses too; the `trained` fixture gives back the trained one.
os.environ["BATCHRUN_DEMO_MODEL"] = str(RANDOM_DEMO_MODEL)

# Every test file's layer, a marker (declared in pyproject.toml): `pytest -m engine` runs one.
# A file missing here fails collection, so a new file is placed when it is added.
LAYER = {
    # unit: pure logic against fakes
    "test_blas.py": "unit", "test_cache_hardening.py": "unit", "test_docs.py": "unit",
    "test_layout.py": "unit", "test_lint.py": "unit", "test_media.py": "unit",
    "test_media_policy.py": "unit", "test_media_walk.py": "unit",
    "test_model_fingerprint.py": "unit", "test_recovery_property.py": "unit",
    "test_rows.py": "unit", "test_train_kernels.py": "unit",
    # engine: the real MLX engine on the tiny bundled models
    "test_chat_template.py": "engine", "test_constrained.py": "engine",
    "test_demo_model.py": "engine", "test_engine.py": "engine",
    "test_engine_backends.py": "engine", "test_faults.py": "engine",
    "test_host_attention.py": "engine", "test_prefix_cache.py": "engine",
    "test_reasoning.py": "engine", "test_request_fields.py": "engine",
    "test_shared_prefix.py": "engine", "test_shared_prefix_150m.py": "engine",
    "test_speculate.py": "engine", "test_tokens.py": "engine", "test_training.py": "engine",
    "test_vision.py": "engine", "test_vision_model.py": "engine",
    "test_vision_prefix_cache.py": "engine",
    # job: whole jobs run in-process (the Python API, the command through CliRunner)
    "test_api.py": "job", "test_bad_input.py": "job", "test_bench.py": "job",
    "test_hostile_inputs.py": "job", "test_job.py": "job", "test_job_safety.py": "job",
    "test_parquet_output.py": "job", "test_report.py": "job",
    # e2e: the command line end to end, in a child process where exits and signals matter
    "test_cli.py": "e2e", "test_cli_contract.py": "e2e", "test_crash.py": "e2e",
    "test_exit.py": "e2e", "test_ray.py": "e2e",
    # gpu: the CUDA kernels and the GPU's paths; here without a GPU (NVRTC compiles, CUDA faked)
    "test_decode_attention.py": "gpu", "test_first_use.py": "gpu",
    "test_prefix_attention.py": "gpu",
}

# The slowest tests (file::function, every parametrization): `pytest -m "not slow"` leaves them
# out and still runs every layer and every feature (docs/dev/tests.md).
SLOW = {
}


def pytest_collection_modifyitems(config, items):
    unplaced = sorted({item.path.name for item in items} - LAYER.keys())
    if unplaced:
        raise pytest.UsageError(f"{', '.join(unplaced)}: no layer; add each to LAYER in "
                                "tests/conftest.py (unit, engine, job, e2e or gpu)")
    for item in items:
        item.add_marker(LAYER[item.path.name])
        if f"{item.path.name}::{item.originalname}" in SLOW:
            item.add_marker("slow")


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
