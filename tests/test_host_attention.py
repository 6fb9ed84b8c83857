"""The CPU's attention of several queries a row through NumPy (engine/kernels/host_attention.py):
what MLX's attention gives for every mask mlx-lm passes, in chunks too, which calls it takes, and
the engine's greedy tokens with it on and off."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache
from test_speculate import generate, tokens

from batchrun.engine.kernels import host_attention as ha
from batchrun.engine.types import SamplingParams
from batchrun.models import DEMO_MODEL, load_model
from tools.demo_models import lessons


@pytest.fixture(scope="module")
def pair():
    return load_model(str(DEMO_MODEL))


def inputs(B=3, H=6, KV=2, L=7, S=40, D=16, Dv=8, seed=0):
    mx.random.seed(seed)
    buffer = (B, KV, S + 9, D)  # a batch cache's buffer, sliced to its length
    q = mx.random.normal((B, H, L, D))
    k = mx.random.normal(buffer)[..., :S, :]
    v = mx.random.normal((B, KV, S + 9, Dv))[..., :S, :]
    return q, k, v


def masks(B, L, S):
    padded = create_causal_mask(L, offset=S - L, left_padding=mx.array([0, 5, 11][:B]))
    return {"none": None, "causal": "causal", "left padding": padded,
            "one row's": padded[:1], "additive": mx.where(padded, 0.0, -mx.inf),
            "additive, finite": mx.where(padded, 0.25, -1e9)}


@pytest.mark.parametrize("name", list(masks(3, 7, 40)))
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("limit", [1 << 24, 500, 1])  # whole; rows; queries a piece
def test_it_gives_what_mlx_gives_for_each_mask_mlx_lm_passes(name, heads, kv_heads, limit,
                                                               monkeypatch):
    monkeypatch.setattr(ha, "MAX_SCORE_ELEMENTS", limit)
    q, k, v = inputs(H=heads, KV=kv_heads)
    mask = masks(3, 7, 40)[name]
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)

    out = ha.attention(q, k, v, 0.25, mask)

    assert out.shape == expected.shape == (3, heads, 7, 8) and out.dtype == mx.float32
    assert mx.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("limit", [1 << 24, 1])  # whole; a row and a query at a time
def test_a_prompts_prefill_and_a_half_precision_model_keep_their_shape_and_dtype(limit,
                                                                                monkeypatch):
    monkeypatch.setattr(ha, "MAX_SCORE_ELEMENTS", limit)
    q, k, v = inputs(L=40)  # a prefill: every key is a query's own
    padding = [0, 3, 39]
    mask = create_causal_mask(40, left_padding=mx.array(padding))
    half = [x.astype(mx.float16) for x in (q, k, v)]
    out = ha.attention(*half, 0.25, mask)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert out.dtype == mx.float16 and out.shape == expected.shape
    for row, pad in enumerate(padding):  # the padding's own queries are read by no one
        assert mx.allclose(out[row, :, pad:].astype(mx.float32), expected[row, :, pad:],
                           atol=1e-2)


def test_a_query_with_nothing_to_attend_gets_zeros_not_nan():
    """Left padding's queries see no key under an additive mask: MLX gives NaN there, which a
    later layer's values would carry into every row's output (0 x NaN)."""
    q, k, v = inputs(B=1, L=2, S=5)
    mask = mx.array([[False] * 5, [True, True, False, False, False]])[None, None]
    for m in (mask, mx.where(mask, 0.0, -mx.inf)):
        out = np.asarray(ha.attention(q, k, v, 0.25, m))
        assert np.isfinite(out).all() and not out[:, :, 0].any()


def test_it_takes_the_engines_forwards_with_several_queries_a_row_and_mlx_lms_masks_only(
        monkeypatch):
    q, k, v = inputs()
    cache = BatchKVCache([0, 0, 0])
    assert not ha.serves(q, k, cache, None, None)  # outside the engine's forwards
    with ha.forwards():
        for mask in masks(3, 7, 40).values():
            assert ha.serves(q, k, cache, None, mask)
        assert ha.serves(q, k, KVCache(), None, "causal")
        assert not ha.serves(q, k, None, None, "causal")  # no cache
        assert not ha.serves(q[:, :, :1], k, cache, None, None)  # a decode step stays in MLX
        assert not ha.serves(q, k, cache, mx.zeros((6,)), None)  # attention sinks
        quantized = type("Quantized", (), {"bits": 4})()
        assert not ha.serves(q, (k, k, k), quantized, None, None)
        per_head = mx.zeros((3, 6, 7, 40))  # a mask of its own for each head
        assert not ha.serves(q, k, cache, None, per_head)
        assert not ha.serves(q, k, cache, None, mx.zeros((3, 1, 7, 39)))  # not these keys'
        assert not ha.serves(q, k, cache, None, "sliding")
        monkeypatch.setattr(ha, "ENABLED", False)
        assert not ha.serves(q, k, cache, None, None) and not ha.wanted()
    assert not ha._in_forwards.get()


@pytest.mark.parametrize("speculate", ["ngram", "draft"])
def test_the_engine_prefills_and_verifies_through_it_to_the_same_greedy_tokens(
        pair, speculate, monkeypatch):
    """Prompts of several lengths in one batch (left padding), a speculative step's
    verification (several queries a row) and decode steps: the same tokens as with MLX's
    attention, in plain decoding and with speculation."""
    calls = []
    attention = ha.attention
    heads = pair.model.args.num_attention_heads  # the draft's calls (fewer heads) aside
    monkeypatch.setattr(ha, "attention", lambda q, *a: (q.shape[1] == heads
                                                        and calls.append(q.shape[2]))
                        or attention(q, *a))
    prompts = [[{"role": "system", "content": lessons.reference_text(t)},
                {"role": "user", "content": f"Quote the reference about {t}."}]
               for t in lessons.TOPICS[:3]] + [[{"role": "user", "content": "Hi"}]]
    params = SamplingParams(max_tokens=24)
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(ha, "ENABLED", on)
        for method in ("off", speculate):
            calls.clear()
            outs, engine = generate(pair, prompts, params, method, concurrency=4, k=5)
            runs[on, method] = tokens(outs), list(calls), engine.stats.speculation.steps
    assert len({str(t) for t, _, _ in runs.values()}) == 1
    _, plain_calls, _ = runs[True, "off"]
    _, spec_calls, steps = runs[True, speculate]
    assert plain_calls and min(plain_calls) > 8  # the prompts' prefill; no decode step
    verified = [n for n in spec_calls if n <= 6]  # each layer's, in a step that guessed
    assert steps and verified and len(verified) % len(pair.model.layers) == 0
    assert not runs[False, speculate][1]  # off: MLX's attention throughout


def test_a_process_whose_engine_routed_the_attention_keeps_mlxs_outside_the_engine(pair):
    """The routing is per model module, so it reaches every model of that architecture in the
    process; outside the engine's forwards MLX's attention runs as before: a user's cached
    forward gives the same logits bit for bit, its gradient reaches the attention's
    projections (NumPy would cut it), and it compiles (NumPy cannot read a traced array)."""
    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache

    model = pair.model
    ids = mx.array([[1, 5, 9, 14, 3, 7, 2, 4]])

    def loss(ids):
        logits = model(ids[:, :-1], cache=make_prompt_cache(model))
        return nn.losses.cross_entropy(logits, ids[:, 1:]).mean()

    def run():
        logits = model(ids, cache=make_prompt_cache(model))
        value, grads = nn.value_and_grad(model, loss)(ids)
        q_grad = grads["model"]["layers"][0]["self_attn"]["q_proj"]["weight"]
        return logits, value, mx.abs(q_grad).sum().item(), mx.compile(loss)(ids)

    before = run()
    generate(pair, [[{"role": "user", "content": "Hi there"}]], SamplingParams(max_tokens=2))
    after = run()
    assert mx.array_equal(before[0], after[0]) and mx.array_equal(before[1], after[1])
    assert after[2] == before[2] > 0
    assert mx.allclose(after[3], before[3])


def test_a_choices_rows_scoring_goes_through_it_to_the_same_answer(pair, monkeypatch):
    """Every forward of an engine step takes it, a choices row's scoring of its multi-token
    choices (after the batch's step) too: the same answers and choice log-probabilities."""
    from batchrun.engine.backends.text import TextBackend
    from batchrun.engine.config import EngineConfig
    from batchrun.engine.engine import Engine
    from batchrun.engine.types import Constraint

    choices = ["positive", "negative", "neutral", "mixed feelings"]
    scoring, calls = [False], []
    score = TextBackend.score_choices

    def answering(*args):
        scoring[0] = True
        try:
            return score(*args)
        finally:
            scoring[0] = False

    attention = ha.attention
    monkeypatch.setattr(TextBackend, "score_choices", answering)
    monkeypatch.setattr(ha, "attention", lambda q, *a: (scoring[0] and calls.append(q.shape))
                        or attention(q, *a))
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(ha, "ENABLED", on)
        engine = Engine(pair.model, pair.tokenizer, EngineConfig(prefix_cache=False),
                        pair.context_length)
        prompts = [f"Review: it is {w}. Sentiment:" for w in ("great", "awful", "fine")]
        outs[on] = [(o.text, o.choice_logprobs) for o in engine.generate(
            prompts, SamplingParams(constraint=Constraint.choices(choices)))]
    assert [t for t, _ in outs[True]] == [t for t, _ in outs[False]]
    for (_, with_numpy), (_, with_mlx) in zip(outs[True], outs[False], strict=True):
        assert with_numpy == pytest.approx(with_mlx, abs=1e-4)
    assert calls  # the multi-token choice's forward, with the feature on
