"""The bundled demo model is reproducible from its script and loads like a real model."""

import hashlib
import json

from batchrun.models import DEMO_MODEL, RANDOM_DEMO_MODEL, resolve
from batchrun.models.random_model import build


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_script_reproduces_the_bundled_random_model(tmp_path):
    out = build(tmp_path / "demo")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert digest(out / name) == digest(RANDOM_DEMO_MODEL / name), name


def test_demo_model_shape(trained):
    config = json.loads((DEMO_MODEL / "config.json").read_text())
    assert config["model_type"] == "llama" and config["torch_dtype"] == "float32"
    assert config["max_position_embeddings"] == 8192 == trained.context_length
    assert config["vocab_size"] == len(trained.tokenizer._tokenizer)
    size = (DEMO_MODEL / "model.safetensors").stat().st_size
    assert 1e6 < size < 10e6
    assert trained.tokenizer.has_thinking and trained.tokenizer.has_tool_calling
    assert resolve(None) == resolve("demo") == str(DEMO_MODEL)  # the trained one
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the pair shares one tokenizer
        assert digest(DEMO_MODEL / name) == digest(RANDOM_DEMO_MODEL / name)


def test_the_demo_model_output_depends_on_the_input(demo):
    from mlx_lm import generate

    a = generate(demo.model, demo.tokenizer, "Explain recursion", max_tokens=8)
    b = generate(demo.model, demo.tokenizer, "My new kettle", max_tokens=8)
    assert a != b


def test_model_fingerprint_follows_weights_tokenizer_template_and_dtype(tmp_path):
    import shutil

    from batchrun.models import model_fingerprint

    model = tmp_path / "m"
    shutil.copytree(DEMO_MODEL, model)
    base = model_fingerprint(str(model))
    assert model_fingerprint(str(DEMO_MODEL)) == base  # a copy is the same model
    seen = {base}
    config = model / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] += " "
    config.write_text(json.dumps(data))
    seen.add(model_fingerprint(str(model)))
    (model / "tokenizer.json").write_text((model / "tokenizer.json").read_text() + " ")
    seen.add(model_fingerprint(str(model)))
    cfg = json.loads((model / "config.json").read_text())
    cfg["torch_dtype"] = "float16"
    (model / "config.json").write_text(json.dumps(cfg))
    seen.add(model_fingerprint(str(model)))
    weights = bytearray((model / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (model / "model.safetensors").write_bytes(bytes(weights))
    seen.add(model_fingerprint(str(model)))
    assert len(seen) == 5
