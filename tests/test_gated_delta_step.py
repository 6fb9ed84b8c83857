"""The gated-delta decode step's CUDA kernel (engine/kernels/gated_delta_step.py): its source
compiles, the contract it implements gives mlx-lm's rule, a kernel whose first results differ
is refused for the process with one warning, and a Qwen3.5 model's greedy tokens do not change
when its decode steps take the kernel's path (here the kernel's contract in MLX ops, CUDA
faked)."""

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta as reference

from batchrun.engine.kernels import gated_delta_step as gds


def contract(q, k, v, g, beta, state, mask):
    """What the kernel computes, in MLX ops: the kernel's inputs as _launch passes them."""
    decayed = state * g[..., None, None]
    read = (decayed * k[:, :, None, :]).sum(-1)
    new = decayed + k[:, :, None, :] * ((v - read) * beta[..., None])[..., None]
    y = (new * q[:, :, None, :]).sum(-1)
    return y, mx.where(mask.astype(mx.bool_)[:, None, None, None], new, state)


def inputs(B=3, Hk=2, Hv=4, Dk=64, Dv=48, seed=0):
    keys = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((B, 1, Hk, Dk), key=keys[0]) * Dk ** -0.5
    k = mx.random.normal((B, 1, Hk, Dk), key=keys[1]) * Dk ** -0.5
    v = mx.random.normal((B, 1, Hv, Dv), key=keys[2])
    g = mx.random.uniform(0.5, 1.0, (B, 1, Hv), key=keys[3])
    beta = mx.random.uniform(0.0, 1.0, (B, 1, Hv), key=keys[4])
    state = mx.random.normal((B, Hv, Dv, Dk), key=keys[5])
    return q, k, v, g, beta, state


@pytest.fixture
def faked(monkeypatch):
    """CUDA faked: the kernel's launch is its contract in MLX ops."""
    monkeypatch.setattr(gds, "on_cuda", lambda: True)
    monkeypatch.setattr(gds, "_refused", [])
    monkeypatch.setattr(gds, "_compiled", lambda DK: ("name", b"ptx"))
    monkeypatch.setattr(gds, "_launch", lambda *a: contract(*a))
    gds._verify.cache_clear()
    yield
    gds._verify.cache_clear()


@pytest.mark.parametrize("DK", [32, 64, 128, 256])
def test_the_kernel_compiles_for_each_key_width_it_takes(DK):
    gds._compiled.cache_clear()
    name, ptx = gds._compiled(DK)
    assert name.startswith("batchrun_gated_delta_step_")
    assert b".entry " + name.encode() in ptx and b"shfl.sync" in ptx  # the warp's sums
    gds._compiled.cache_clear()


@pytest.mark.parametrize("masked", [False, True])
def test_the_kernels_contract_is_mlx_lms_rule(faked, masked):
    q, k, v, g, beta, state = inputs()
    mask = mx.array([[True], [False], [True]]) if masked else None
    y, new = gds.step(q, k, v, g, beta, state, mask)
    want_y, want_state = reference.gated_delta_ops(q, k, v, g, beta, state, mask)
    assert y.shape == want_y.shape and new.shape == want_state.shape
    assert mx.abs(y - want_y).max().item() < 1e-5
    assert mx.abs(new - want_state).max().item() < 1e-5
    if masked:
        assert mx.array_equal(new[1], state[1])  # a masked row keeps its state


def test_only_one_position_steps_with_a_decay_a_head_take_the_kernel(faked):
    q, k, v, g, beta, state = inputs()
    assert gds.takes(q, g, state)
    assert not gds.takes(mx.concatenate([q, q], axis=1), g, state)  # a prompt: by chunks
    assert not gds.takes(q, g[..., None] * mx.ones((1, 1, 1, 64)), state)  # a decay a key
    assert not gds.takes(q, g, None)
    assert not gds.takes(q[..., :48], g, state)  # a key width not a multiple of 32


def test_without_cuda_the_kernel_is_never_taken(monkeypatch):
    monkeypatch.setattr(gds, "_refused", [])
    q, k, v, g, beta, state = inputs()
    assert not gds.takes(q, g, state)  # this machine's CPU


def test_a_kernel_whose_first_results_differ_is_refused_once(faked, monkeypatch, caplog):
    launched = []

    def broken(*a):
        launched.append(1)
        y, new = contract(*a)
        return y + 0.5, new

    monkeypatch.setattr(gds, "_launch", broken)
    q, k, v, g, beta, state = inputs()
    with caplog.at_level("WARNING", logger="batchrun"):
        assert not gds.takes(q, g, state)
        assert not gds.takes(q, g, state)
    assert len(launched) == 1
    warnings = [r.message for r in caplog.records if "gated-delta step kernel" in r.message]
    assert len(warnings) == 1 and "differ from mlx-lm's by 0.5" in warnings[0]


def test_greedy_tokens_do_not_change_when_decode_steps_take_the_kernel(faked, tmp_path):
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from batchrun.engine.config import EngineConfig
    from batchrun.engine.engine import Engine
    from batchrun.engine.kernels import gated_delta
    from batchrun.engine.types import SamplingParams
    from batchrun.models.families import build_family

    calls = []
    real = gds.step
    gated_delta.gated_delta_step.step = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    try:
        model, tokenizer = load(str(build_family(tmp_path / "m", "qwen3_5", "tiny", "none")))
        prompts = [" ".join(["some words of a prompt"] * n) for n in (3, 9, 14)]
        want = []
        for prompt in prompts:
            tokens = []
            for token, _ in generate_step(mx.array(tokenizer.encode(prompt)), model,
                                          max_tokens=6):
                if int(token) in tokenizer.eos_token_ids:
                    break
                tokens.append(int(token))
            want.append(tokens)
        engine = Engine(model, tokenizer, EngineConfig(max_concurrency=8))
        outs = engine.generate(prompts, SamplingParams(max_tokens=6))
    finally:
        gated_delta.gated_delta_step.step = real
    assert [o.token_ids for o in outs] == want and any(want)
    assert calls and max(calls) == 3  # every row's decode steps, batched
