"""The gated-delta rule by chunks (engine/kernels/gated_delta.py) against mlx-lm's rule a
position at a time: the same outputs and last state to float32 rounding, with padding masks,
grouped heads, lengths that are not a multiple of the chunk; and the routing reaches only the
engine's own forwards."""

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta as reference

from batchrun.engine.kernels import gated_delta, host_attention


def inputs(B, T, Hk, Hv, Dk, Dv, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk))
    k = mx.random.normal((B, T, Hk, Dk))
    q, k = reference.normalize_qk(q, k, inv_scale=Dk ** -0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv))
    g = mx.exp(-mx.random.uniform(0.0, 2.0, (B, T, Hv)))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)))
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv,padded", [
    (2, 100, 2, 4, 64, 64, False),  # grouped heads, 3 chunks and a part
    (3, 70, 4, 4, 32, 48, True),  # left padding of 0, 9 and 18 positions
    (1, 33, 1, 2, 16, 16, False),
    (2, 64, 2, 2, 128, 128, True),  # whole chunks
])
def test_chunks_give_mlx_lms_outputs_and_state(B, T, Hk, Hv, Dk, Dv, padded):
    q, k, v, g, beta, state = inputs(B, T, Hk, Hv, Dk, Dv)
    mask = mx.arange(T)[None] >= mx.array([9 * i for i in range(B)])[:, None] if padded \
        else None
    want_y, want_state = reference.gated_delta_ops(q, k, v, g, beta, state, mask)
    y, last = gated_delta.chunked(q, k, v, g, beta, state, mask)
    assert y.shape == want_y.shape and last.shape == want_state.shape
    if mask is not None:  # a padded position's output is never read
        y, want_y = (mx.where(mask[..., None, None], a, 0) for a in (y, want_y))
    assert mx.abs(y - want_y).max().item() < 1e-5
    assert mx.abs(last - want_state).max().item() < 1e-5
    assert mx.abs(want_y).max().item() > 0.01  # not a comparison of zeros


def test_a_decay_of_zero_resets_the_state_as_mlx_lms_rule_does():
    """mlx-lm's decay underflows to exactly 0 for a large A_log: the state restarts there, and
    nothing turns to NaN (a log of 0 is -inf, never subtracted from another)."""
    q, k, v, g, beta, state = inputs(2, 80, 2, 2, 32, 32, seed=3)
    at = mx.arange(80)[None, :, None]
    for decays in (mx.where(at == 5, 0.0, g), mx.where(at % 7 == 0, 0.0, g),
                   mx.full(g.shape, 1e-30)):
        want_y, want_state = reference.gated_delta_ops(q, k, v, decays, beta, state)
        y, last = gated_delta.chunked(q, k, v, decays, beta, state)
        assert mx.all(mx.isfinite(y)).item() and mx.all(mx.isfinite(last)).item()
        assert mx.abs(y - want_y).max().item() < 1e-5
        assert mx.abs(last - want_state).max().item() < 1e-5


def test_a_model_whose_decays_underflow_gives_mlx_lms_tokens(tmp_path):
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from batchrun.engine.config import EngineConfig
    from batchrun.engine.engine import Engine
    from batchrun.engine.types import SamplingParams
    from batchrun.models.families import build_family

    model, tokenizer = load(str(build_family(tmp_path / "m", "qwen3_5", "tiny", "none")))
    model.update(tree_unflatten([(name, mx.full(a.shape, 5.0)) for name, a in
                                 tree_flatten(model.parameters()) if name.endswith("A_log")]))
    prompts = [" ".join(["a long prompt of words"] * n) for n in (12, 20, 30)]
    want = []
    for prompt in prompts:
        ids = mx.array(tokenizer.encode(prompt))
        tokens = []
        for token, _ in generate_step(ids, model, max_tokens=4):
            if int(token) in tokenizer.eos_token_ids:
                break
            tokens.append(int(token))
        want.append(tokens)
    assert any(want)
    engine = Engine(model, tokenizer, EngineConfig(max_concurrency=8, prefix_cache=False))
    outs = engine.generate(prompts, SamplingParams(max_tokens=4))
    assert [o.token_ids for o in outs] == want


def test_only_the_engines_forwards_take_the_chunks(tmp_path, monkeypatch):
    from batchrun.engine.config import EngineConfig
    from batchrun.engine.engine import Engine
    from batchrun.engine.types import SamplingParams
    from batchrun.models.families import build_family

    path = build_family(tmp_path / "m", "qwen3_5", "tiny", "none")
    engine = Engine.load(str(path), EngineConfig(prefix_cache=False))
    calls = []
    real = gated_delta.chunked
    monkeypatch.setattr(gated_delta, "chunked", lambda *a, **k: calls.append(a[0].shape[1])
                        or real(*a, **k))
    prompt = " ".join(["a long prompt"] * 40)
    out = engine.generate([prompt], SamplingParams(max_tokens=3))[0]
    assert out.error is None and calls and min(calls) > gated_delta.CHUNK
    calls.clear()
    assert not host_attention.in_forwards()
    ids = mx.array(engine.tokenizer.encode(prompt))[None]
    engine.model(ids)  # a user's own forward: mlx-lm's rule
    assert not calls
