"""Quantized and mixture-of-experts models: the weight plan, and the same greedy tokens as
mlx-lm's own generation of the quantized model (float32 weights quantized, so mlx-lm's
arithmetic is float32 too), alone, batched, from a cold and a warm prefix cache."""

import json
import random

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.memory import weights_bytes
from batchrun.engine.types import SamplingParams
from batchrun.models.families import build_family
from batchrun.models.random_model import review
from batchrun.models.weights import (
    WEIGHT_SHARE,
    _dequantized_bytes,
    _quantized_bytes,
    plan_and_apply,
    quantized_layers,
)
from tests.helpers import jsonl, run, write_rows

KINDS = {  # name: (family, quantization)
    "4bit": ("qwen3", "4bit"),
    "8bit-g32": ("qwen3", "8bit-g32"),
    "4bit-g128": ("llama", "4bit-g128"),
    "mixed": ("qwen3", "4bit-mixed"),
    "fullhead": ("qwen3", "4bit-fullhead"),
    "moe-4bit": ("qwen3_moe", "4bit"),
    "mxfp4": ("qwen3", "mxfp4"),
    "gpt-oss-mxfp4": ("gpt_oss", "mxfp4"),  # experts, sinks, a sliding window
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {name: build_family(root / name, family, "tiny", quant)
            for name, (family, quant) in KINDS.items()}


def labeling_rows(n: int) -> list[list[dict]]:
    rng = random.Random(7)
    system = " ".join(review(rng)[1] for _ in range(12))
    return [[{"role": "system", "content": system}, {"role": "user", "content": review(rng)[1]}]
            for _ in range(n)]


def mlx_lm_greedy(model, tokenizer, rows, max_tokens: int) -> list[list[int]]:
    """mlx-lm's own generation of each row alone, stopped at EOS as the engine stops."""
    outs = []
    for row in rows:
        ids = tokenizer.apply_chat_template(row, add_generation_prompt=True)
        tokens = []
        for token, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens):
            if int(token) in tokenizer.eos_token_ids:
                break
            tokens.append(int(token))
        outs.append(tokens)
    return outs


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_tokens_equal_mlx_lms_alone_batched_cold_and_warm(models, kind, tmp_path):
    path = str(models[kind])
    rows = labeling_rows(10)
    model, tokenizer = load(path)
    assert quantized_layers(model)  # mlx-lm runs it quantized
    expected = mlx_lm_greedy(model, tokenizer, rows, 8)
    for concurrency in (1, 32):
        for run_ in ("cold", "warm"):
            engine = Engine.load(path, EngineConfig(max_concurrency=concurrency,
                                                    cache_dir=str(tmp_path / str(concurrency))))
            assert engine.weight_plan.held == "dequantized"
            assert not quantized_layers(engine.model)
            # a mixture of experts' layers group the rows by expert on the CPU
            assert (engine.weight_plan.grouped > 0) == (KINDS[kind][0] in ("qwen3_moe", "gpt_oss"))
            outs = engine.generate(rows, SamplingParams(max_tokens=8))
            if run_ == "warm":
                assert engine.get_cache_stats()["disk_loaded_blocks"] > 0
            engine.save_cache_to_disk(tmp_path / str(concurrency))
            got = [o.token_ids for o in outs]
            assert got == expected, (kind, concurrency, run_)


def test_the_cpu_plan_dequantizes_to_float32_and_says_so(models):
    model, _ = load(str(models["mixed"]))
    plan = plan_and_apply(model, "auto", device="cpu")
    assert (plan.held, plan.dtype, plan.kept) == ("dequantized", "float32", 0)
    assert plan.quantization.startswith("mixed: 4-bit affine, group 64")
    assert "8-bit affine, group 64 (2 layers)" in plan.quantization
    assert plan.converted == 2 * 7 + 2  # 7 linear layers a block, the embedding and the head
    for _, m in model.named_modules():
        assert not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        if isinstance(m, (nn.Linear, nn.Embedding)):
            assert m.weight.dtype == mx.float32
    assert plan.bytes_after > plan.bytes_before
    assert "dequantized to float32" in plan.describe()


def test_quantized_keeps_the_weights_as_loaded(models):
    model, _ = load(str(models["4bit"]))
    before = len(quantized_layers(model))
    plan = plan_and_apply(model, "quantized", device="cpu")
    assert (plan.held, plan.converted, plan.kept) == ("as loaded", 0, before)
    assert len(quantized_layers(model)) == before
    assert plan.cache_key("ab" * 32) == "ab" * 32  # the prefix cache's key is the model's


def test_a_half_precision_model_is_held_in_float32_on_the_cpu(tmp_path):
    path = build_family(tmp_path / "bf16", "qwen3", "tiny", "none", dtype="bfloat16")
    model, _ = load(str(path))
    plan = plan_and_apply(model, "auto", device="cpu")
    assert plan.held == "float32" and plan.widened > 0
    from mlx.utils import tree_flatten

    assert {a.dtype for _, a in tree_flatten(model.parameters())} == {mx.float32}
    assert plan.cache_key("ab" * 32) != "ab" * 32


def test_on_cuda_layers_take_the_models_dtype_and_experts_come_last(tmp_path):
    path = build_family(tmp_path / "moe", "qwen3_moe", "tiny", "4bit", dtype="bfloat16")
    model, _ = load(str(path))
    layers = quantized_layers(model)
    experts = [m for _, m in layers if isinstance(m, QuantizedSwitchLinear)]
    assert experts
    # memory for the layers every token runs, not for the experts: those stay quantized
    grow = {id(m): _dequantized_bytes(m, 2) - _quantized_bytes(m) for _, m in layers}
    dense = weights_bytes(model) + sum(g for k, g in grow.items()
                                       if k not in map(id, experts))
    room = dense + grow[id(experts[0])] // 2  # not one expert layer more
    plan = plan_and_apply(model, "auto", memory_bytes=int(room / WEIGHT_SHARE),
                          memory_utilization=1.0, device="cuda")
    assert plan.held == "partly dequantized" and plan.dtype == "bfloat16"
    assert plan.kept == len(experts) and plan.converted == len(layers) - len(experts)
    assert all(isinstance(m, QuantizedSwitchLinear) for _, m in quantized_layers(model))
    assert "kept quantized" in plan.describe()
    # asked for, every layer is dequantized whatever the memory
    model, _ = load(str(path))
    plan = plan_and_apply(model, "dequantized", memory_bytes=1, device="cuda")
    assert plan.held == "dequantized" and not quantized_layers(model)
    assert any(isinstance(m, SwitchLinear) and m.weight.dtype == mx.bfloat16
               for _, m in model.named_modules())
    # on CUDA, whatever the mode, an expert block takes at most the kernels' routed rows a call
    from batchrun.models.weights import CUDA_ROUTED_ROWS
    for mode in ("quantized", "auto"):
        model, _ = load(str(path))
        plan_and_apply(model, mode, device="cuda")
        blocks = [m for _, m in model.named_modules() if hasattr(m, "_max_routed")]
        # each layer's experts and the block routing to them (the router's top-k)
        assert len(blocks) == 4 and all(m._max_routed == CUDA_ROUTED_ROWS for m in blocks)


def test_metal_keeps_quantized_weights_by_default(models):
    model, _ = load(str(models["4bit"]))
    plan = plan_and_apply(model, "auto", device="metal")
    assert plan.held == "as loaded" and "Metal" in plan.reason


def test_a_plan_that_does_not_fit_keeps_the_model_as_loaded(models):
    model, _ = load(str(models["4bit"]))
    plan = plan_and_apply(model, "auto", memory_bytes=1 << 20, device="cpu")
    assert plan.held == "as loaded" and plan.kept == len(quantized_layers(model))
    assert "half the memory" in plan.reason


def test_caches_of_two_plans_do_not_mix(models, tmp_path):
    path, rows = str(models["4bit"]), labeling_rows(4)
    first = Engine.load(path, EngineConfig(cache_dir=str(tmp_path)))
    first.generate(rows, SamplingParams(max_tokens=2))
    first.save_cache_to_disk(tmp_path)
    kept = Engine.load(path, EngineConfig(cache_dir=str(tmp_path), weights="quantized"))
    kept.generate(rows, SamplingParams(max_tokens=2))
    assert kept.get_cache_stats()["disk_loaded_blocks"] == 0  # the dequantized plan's KV is not its


def test_the_run_says_how_the_weights_are_held(models, tmp_path):
    rows = write_rows(tmp_path / "in.jsonl", [{"prompt": "hello there"}, {"prompt": "hi"}])
    run(rows, "--model", models["4bit"], "--job-dir", tmp_path / "job", "--max-tokens", "2",
        "--weights", "quantized")
    assert len(jsonl(tmp_path / "job" / "results.jsonl")) == 2
    report = json.loads((tmp_path / "job" / "report.json").read_text())
    assert report["weights"]["held"] == "as loaded"
    assert report["weights"]["quantization"] == "4-bit affine, group 64"
    assert report["runs"][-1]["weights"]["mode"] == "quantized"
    bad = run(rows, "--model", models["4bit"], "--weights", "fp8", code=2)
    assert "--weights" in bad.output


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "gpt_oss", "gemma3",
                                    "qwen3_5", "granite_hybrid"])
def test_every_family_builds_a_folder_mlx_lm_loads(family, tmp_path):
    quant = "mxfp4" if family == "gpt_oss" else "8bit"
    path = build_family(tmp_path / family, family, "tiny", quant)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"]["bits"] == (4 if quant == "mxfp4" else 8)
    model, tokenizer = load(str(path))
    assert quantized_layers(model)
    logits = model(mx.array(tokenizer.encode("The kettle"))[None])
    assert logits.shape[-1] >= len(tokenizer._tokenizer) and mx.all(mx.isfinite(logits))


@pytest.mark.parametrize("kind", ["moe-4bit", "gpt-oss-mxfp4"])
def test_experts_sliced_to_a_routed_row_limit_give_the_same_tokens(models, kind, monkeypatch):
    """CUDA caps the routed rows one expert kernel takes, and the tokens of the router's top-k;
    past a limit the block runs in slices of tokens and the experts in slices of whole rows:
    the same tokens and logits as one call, prefill and decode."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.switch_layers import SwitchGLU

    from batchrun.models.weights import slice_experts

    rows = labeling_rows(6)
    model, tokenizer = load(str(models[kind]))
    whole = mlx_lm_greedy(model, tokenizer, rows, 6)
    ids = mx.array([tokenizer.apply_chat_template(rows[0], add_generation_prompt=True)])
    logits = model(ids)
    names = [k for k, _ in tree_flatten(model.parameters())]
    assert slice_experts(model, 5) == 2  # one block a layer; 2 rows a slice at 2 experts a row
    assert slice_experts(model, 5) == 0  # already sliced: only the limit is set
    assert [k for k, _ in tree_flatten(model.parameters())] == names
    calls = []
    real = SwitchGLU.__call__
    monkeypatch.setattr(SwitchGLU, "__call__",
                        lambda self, x, i: calls.append(i.size) or real(self, x, i))
    assert mx.array_equal(model(ids), logits)
    blocks = {type(m).__name__ for _, m in model.named_modules() if hasattr(m, "_max_routed")}
    assert len(blocks) == 2 and all(b.startswith("Sliced") for b in blocks)
    # blocks of at most 5 tokens, experts of at most 2 tokens (5 routed rows) a call
    assert max(calls) <= 5 and len(calls) >= 2 * 3 * (ids.shape[1] // 5)
    assert mlx_lm_greedy(model, tokenizer, rows, 6) == whole


def test_a_half_precision_quantized_model_gives_mlx_lms_tokens_for_the_weights_it_holds(
        tmp_path):
    # A bf16 model quantized: the CPU plan computes it in float32, mlx-lm as loaded in bf16,
    # and on a random model's near-flat logits the two roundings pick different tokens. The
    # engine's own arithmetic is exact either way: mlx-lm on the planned weights gives the
    # engine's tokens, and `--weights quantized` (no shared-prefix attention, whose float32
    # merge rounds otherwise than MLX's bf16 attention) gives mlx-lm's own.
    path = str(build_family(tmp_path / "m", "qwen3", "tiny", "4bit", dtype="bfloat16"))
    rng = random.Random(3)
    rows = [[{"role": "system", "content": review(rng)[1]},
             {"role": "user", "content": review(rng)[1]}] for _ in range(3)]
    model, tokenizer = load(path)
    as_loaded = mlx_lm_greedy(model, tokenizer, rows, 6)
    plan_and_apply(model, "dequantized")
    planned = mlx_lm_greedy(model, tokenizer, rows, 6)
    for concurrency in (1, 32):
        engine = Engine.load(path, EngineConfig(max_concurrency=concurrency,
                                                cache_dir=str(tmp_path / "c")))
        assert engine.weight_plan.dtype == "float32"
        assert [o.token_ids for o in engine.generate(rows, SamplingParams(max_tokens=6))] \
            == planned, concurrency
        engine.close()
    engine = Engine.load(path, EngineConfig(max_concurrency=32, weights="quantized",
                                            prefix_cache=False))
    assert quantized_layers(engine.model)
    assert [o.token_ids for o in engine.generate(rows, SamplingParams(max_tokens=6))] \
        == as_loaded
