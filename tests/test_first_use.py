"""The first use of the GPU's kernels paid beside the model's loading
(engine/kernels/first_use.py): a one-layer stand-in of the model's configuration, warmed up on a
thread of its own. Only on CUDA; here its parts run on the CPU."""

import json
import logging
import threading

import mlx.core as mx
import pytest

from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.kernels import first_use
from batchrun.engine.types import SamplingParams
from batchrun.models import DEMO_MODEL, load_model


def demo_config() -> dict:
    return json.loads((DEMO_MODEL / "config.json").read_text())


@pytest.mark.parametrize("quantization", [None, {"group_size": 32, "bits": 4}])
def test_a_stand_in_has_the_models_architecture_in_one_layer(quantization):
    config = demo_config() | ({"quantization": quantization} if quantization else {})
    model = first_use.stand_in(config)
    assert len(model.layers) == 1 and type(model).__module__ == "mlx_lm.models.llama"
    assert model.args.hidden_size == config["hidden_size"]
    assert model.args.vocab_size == min(first_use.VOCAB, config["vocab_size"])
    linear = model.layers[0].self_attn.q_proj
    assert type(linear).__name__ == ("QuantizedLinear" if quantization else "Linear")
    if not quantization:
        assert linear.weight.dtype == mx.float32  # the demo's dtype
    first_use.warm_up(model)


def test_a_configuration_no_stand_in_fits_is_skipped_quietly(caplog):
    with caplog.at_level(logging.DEBUG, logger="batchrun"):
        assert first_use.run(demo_config() | {"model_type": "no-such-architecture"}) is False
    assert "no GPU warm-up beside the model's loading" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_only_a_flat_configuration_gets_a_stand_in(monkeypatch, tmp_path):
    """A vision-language model's nested text configuration carries its own layer count: a
    'one-layer' copy of the top level could be a full-depth random model beside the real one."""
    config = demo_config()
    assert first_use.flat(config)
    nested = {"model_type": "llava", "text_config": config, "vocab_size": config["vocab_size"],
              "num_hidden_layers": 1}
    assert not first_use.flat(nested)
    assert not first_use.flat({k: v for k, v in config.items() if k != "num_hidden_layers"})
    monkeypatch.setattr(first_use, "_started", threading.Event())
    monkeypatch.setattr(first_use, "wanted", lambda: True)
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert first_use.start(str(tmp_path)) is None


def test_a_stand_in_that_would_not_be_one_layer_is_not_built(caplog, monkeypatch):
    """Built but never evaluated: its random weights are lazy, so skipping it costs nothing."""
    import mlx_lm.models.llama as llama

    real = llama.Model.__init__

    def deeper(self, args):
        args.num_hidden_layers = 3  # an architecture that reads its depth elsewhere
        args.layer_types = args.layer_types * 3
        real(self, args)

    monkeypatch.setattr(llama.Model, "__init__", deeper)
    with caplog.at_level(logging.DEBUG, logger="batchrun"):
        assert first_use.run(demo_config()) is False
    assert "not one layer deep" in caplog.text


def test_only_on_a_cuda_gpu_unless_turned_off(monkeypatch):
    from types import SimpleNamespace

    real_cuda = getattr(mx, "cuda", None)
    on_cuda = bool(real_cuda and real_cuda.is_available() and mx.default_device() == mx.gpu)
    assert first_use.wanted() is on_cuda  # this CPU: nothing to pay ahead
    monkeypatch.setattr(mx, "cuda", SimpleNamespace(is_available=lambda: True))
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert first_use.wanted() is True
    monkeypatch.setenv(first_use.ENV, "0")
    assert first_use.wanted() is False


def test_once_a_process_and_only_with_a_configuration(monkeypatch, tmp_path):
    monkeypatch.setattr(first_use, "_started", threading.Event())
    monkeypatch.setattr(first_use, "wanted", lambda: True)
    assert first_use.start(str(tmp_path)) is None  # no config.json: nothing to build
    thread = first_use.start(str(DEMO_MODEL))
    assert thread is not None
    first_use.finish(thread)
    assert not thread.is_alive()
    assert first_use.start(str(DEMO_MODEL)) is None  # the process's kernels are loaded now


def test_a_model_loaded_beside_a_stand_in_answers_as_it_does_alone(monkeypatch):
    def greedy(lm):
        engine = Engine(lm.model, lm.tokenizer, EngineConfig(max_concurrency=4),
                        lm.context_length)
        return [o.token_ids for o in engine.generate(
            ["Explain recursion in two sentences.", "Review of a kettle: it leaks.\nSentiment:"],
            SamplingParams(max_tokens=12))]

    alone = greedy(load_model(str(DEMO_MODEL)))
    monkeypatch.setattr(first_use, "_started", threading.Event())
    monkeypatch.setattr(first_use, "wanted", lambda: True)
    ran = []
    real_run = first_use.run
    monkeypatch.setattr(first_use, "run", lambda config: ran.append(real_run(config)))
    beside = greedy(load_model(str(DEMO_MODEL)))
    assert ran == [True] and beside == alone
