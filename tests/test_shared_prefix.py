"""Shared-prefix attention: rows that start with the same cached prefix attend one copy of its
KV, and give the same tokens as without it: alone or batched, cold, warm or with a damaged
cache, with two prefixes in one batch, greedy or seeded."""

import logging

import mlx.core as mx
import pytest

from batchrun.cache import block_layout, make_prefix_cache
from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.kernels import shared_prefix
from batchrun.engine.kernels.shared_prefix import (
    PrefixedCache,
    SharedPrefix,
    SharedPrefixBatchCache,
    attention_with_prefix,
)
from batchrun.engine.types import SamplingParams

FIRST = "You label product reviews as positive, negative or neutral. " + " ".join(
    f"Example {i}: the kettle is sturdy and quiet, so it is positive." for i in range(14))
SECOND = "Translate the review into a one-word mood. " + " ".join(
    f"Sample {i}: the lamp flickers and hums, so the mood is gloomy." for i in range(14))


def rows(instruction: str, n: int, start: int = 0) -> list[list[dict]]:
    return [[{"role": "system", "content": instruction},
             {"role": "user", "content": f"Review {i}: it is {'great' if i % 2 else 'awful'}"}]
            for i in range(start, start + n)]


GREEDY = SamplingParams(max_tokens=10)


def run(demo, chats, cache_dir=None, shared=True, prefix=True, concurrency=16, params=GREEDY):
    outs, engine = run_outputs(demo, chats, cache_dir, concurrency, shared, prefix, params)
    return [o.token_ids for o in outs], engine


def run_outputs(demo, chats, cache_dir=None, concurrency=16, shared=True, prefix=True,
                params=GREEDY):
    cache = None
    if prefix:
        cache = make_prefix_cache(demo.fingerprint, 1 << 30, cache_dir, block_size=32,
                                  layout=block_layout(demo.model))
    engine = Engine(demo.model, demo.tokenizer,
                    EngineConfig(max_concurrency=concurrency, shared_prefix=shared),
                    demo.context_length, prefix_cache=cache, model_fingerprint=demo.fingerprint)
    return engine.generate(chats, params), engine


@pytest.fixture(scope="module")
def mixed():
    return rows(FIRST, 10) + rows(SECOND, 10) + rows(FIRST, 6, start=10)


@pytest.fixture(scope="module")
def reference(demo, mixed):
    return run(demo, mixed, prefix=False)[0]


@pytest.mark.parametrize("concurrency", [1, 64])
def test_greedy_tokens_are_the_same_as_without_a_prefix_cache(demo, mixed, reference,
                                                              concurrency):
    tokens, engine = run(demo, mixed, concurrency=concurrency)
    assert engine.scheduler.shares_prefix
    assert engine.get_cache_stats()["hit_tokens"] > 0
    assert tokens == reference


def test_cold_warm_and_damaged_disk_caches_give_the_same_tokens(demo, mixed, reference,
                                                                tmp_path):
    folder = tmp_path / "cache"
    cold, _ = run(demo, mixed, folder)
    warm, engine = run(demo, mixed, folder)
    assert engine.get_cache_stats()["disk_loaded_blocks"] > 0
    for entry in folder.rglob("*.safetensors"):
        data = bytearray(entry.read_bytes())
        data[len(data) // 2] ^= 0xFF
        entry.write_bytes(bytes(data))
    damaged, _ = run(demo, mixed, folder)
    assert cold == warm == damaged == reference


def test_seeded_sampling_is_unchanged(demo, mixed):
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=3)
    plain, _ = run(demo, mixed, prefix=False, params=params)
    shared, _ = run(demo, mixed, params=params)
    assert shared == plain


def test_two_prefixes_in_one_batch_are_held_once_each(demo, mixed):
    seen = []
    real = shared_prefix.attention_with_prefix

    def spy(queries, keys, values, cache, scale, mask, sinks=None):
        seen.append([id(p) for p, _ in cache.groups()])
        return real(queries, keys, values, cache, scale, mask, sinks)

    shared_prefix.attention_with_prefix = spy
    try:
        tokens, engine = run(demo, mixed, concurrency=64)
    finally:
        shared_prefix.attention_with_prefix = real
    assert engine.faults == 0
    assert max(len(groups) for groups in seen) == 2  # both instructions, one copy each


def test_a_row_holds_only_its_own_tokens_in_the_memory_budget(demo, mixed, reference):
    """Under a KV budget that fits a few whole rows, sharing the prefix runs many more at once."""
    probe = run(demo, mixed[:1], prefix=False)[1]
    whole = len(probe.prompts.encode_chat(mixed[0])) + 10
    budget = probe.memory.cost([whole]) * 3
    batches = {}
    for shared in (True, False):
        cache = make_prefix_cache(demo.fingerprint, 1 << 30, None, block_size=32,
                                  layout=block_layout(demo.model))
        engine = Engine(demo.model, demo.tokenizer,
                        EngineConfig(max_concurrency=64, shared_prefix=shared,
                                     kv_budget_bytes=budget),
                        demo.context_length, prefix_cache=cache,
                        model_fingerprint=demo.fingerprint)
        outs = engine.generate(mixed, SamplingParams(max_tokens=10))
        assert [o.token_ids for o in outs] == reference
        batches[shared] = engine.stats.mean_batch_size
    assert batches[False] <= 3
    assert batches[True] > 2 * batches[False]


PREAMBLE = ("Read the customer's review below with care, then answer with a single word "
            "that names its mood, nothing else. The review:")


def tail_rows() -> list[list[dict]]:
    """Rows that go on sharing ~25 tokens past the instruction's last whole block, one that
    leaves the preamble early, and one whose whole question is the preamble's start."""
    chats = [[{"role": "system", "content": FIRST},
              {"role": "user", "content": f"{PREAMBLE} item {i} is {'fine' if i % 2 else 'bad'}"}]
             for i in range(30)]
    chats.insert(5, [{"role": "system", "content": FIRST},
                     {"role": "user", "content": "Quick one: the kettle leaks."}])
    chats.append([{"role": "system", "content": FIRST},
                  {"role": "user", "content": PREAMBLE[:40]}])
    return chats


@pytest.mark.parametrize("concurrency", [1, 64])
def test_tokens_rows_share_past_their_cached_blocks_are_computed_once(demo, concurrency,
                                                                      tmp_path):
    """The instruction and the question's preamble end mid-block: the rows attend one copy of
    what they share past the blocks too, cold and warm, and every row's tokens are those
    without a cache."""
    chats = tail_rows()
    reference, _ = run(demo, chats, prefix=False)
    groups = []
    real = shared_prefix.attention_with_prefix

    def spy(queries, keys, values, cache, scale, mask, sinks=None):
        groups.append(max(len(rows) for _, rows in cache.groups()))
        return real(queries, keys, values, cache, scale, mask, sinks)

    shared_prefix.attention_with_prefix = spy
    try:
        for _ in ("cold", "warm"):
            outs, engine = run_outputs(demo, chats, tmp_path, concurrency)
            assert [o.token_ids for o in outs] == reference
            cached = [o.cached_tokens for o in outs]
            blocks = engine.get_cache_stats()["hit_tokens"] // len(chats)
            preamble = [c for i, c in enumerate(cached) if i not in (5, len(chats) - 1)]
            assert len(set(preamble)) == 1 and preamble[0] >= blocks + 16  # one long tail
            assert cached[5] < preamble[0] and cached[-1] < preamble[0]
            assert outs[-1].prompt_tokens > cached[-1]  # a row keeps a token of its own
    finally:
        shared_prefix.attention_with_prefix = real
    if concurrency == 64:  # the 30 rows with the preamble attend one copy of it together
        assert max(groups) == 30


def test_a_tail_that_fails_to_compute_leaves_the_rows_to_compute_it(demo, monkeypatch,
                                                                     caplog, tmp_path):
    from batchrun.engine.backends.text import TextBackend

    chats = tail_rows()
    reference, _ = run(demo, chats, prefix=False)
    run(demo, chats, tmp_path)  # the blocks on disk: the next run only computes the tail

    def broken(self, base, tokens):
        raise RuntimeError("device lost")

    monkeypatch.setattr(TextBackend, "_extend", broken)
    with caplog.at_level(logging.WARNING, logger="batchrun"):
        outs, _ = run_outputs(demo, chats, tmp_path, concurrency=64)
    assert [o.token_ids for o in outs] == reference
    assert all(o.cached_tokens % 32 == 0 for o in outs)  # the blocks only
    assert any("RuntimeError: device lost" in r.message for r in caplog.records)


def test_a_row_takes_the_longest_kept_tail_it_continues_with():
    def prefix(tail=()):
        return SharedPrefix([mx.zeros((1, 1, 4 + len(tail), 2))],
                            [mx.zeros((1, 1, 4 + len(tail), 2))], tail)

    base = prefix()
    short, long = base.add_tail(prefix((7, 8))), base.add_tail(prefix((7, 8, 9)))
    assert base.tail_for([0, 0, 0, 0, 7, 8, 9, 5], 4) is long
    assert base.tail_for([0, 0, 0, 0, 7, 8, 9], 4) is short  # a token of its own is left
    assert base.tail_for([0, 0, 0, 0, 7, 1, 9, 5], 4) is None
    for n in range(shared_prefix.TAILS_KEPT):
        base.add_tail(prefix((1, n)))
    assert short not in base.tails and len(base.tails) == shared_prefix.TAILS_KEPT


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("host", [False, True])  # the CPU's NumPy path for large prefix parts
def test_cascade_attention_equals_attention_over_the_whole_sequence(with_sinks, host,
                                                                    monkeypatch):
    monkeypatch.setattr(shared_prefix, "HOST_MIN_SCORES", 0 if host else 1 << 62)
    mx.random.seed(0)
    B, heads, kv_heads, L, D, P = 3, 4, 2, 5, 16, 40
    q = mx.random.normal((B, heads, L, D))
    prefix_k = mx.random.normal((1, kv_heads, P, D))
    prefix_v = mx.random.normal((1, kv_heads, P, D))
    own_k, own_v = mx.random.normal((B, kv_heads, L, D)), mx.random.normal((B, kv_heads, L, D))
    cache = SharedPrefixBatchCache([SharedPrefix([prefix_k], [prefix_v])] * 2 + [None], 0)
    mask = mx.tril(mx.ones((L, L), dtype=mx.bool_))[None, None]
    sinks = mx.random.normal((heads,)) if with_sinks else None
    got = attention_with_prefix(q, own_k, own_v, cache, 0.25, mask, sinks)
    for b in range(B):
        keys = own_k[b: b + 1] if b == 2 else mx.concatenate([prefix_k, own_k[b: b + 1]], 2)
        values = own_v[b: b + 1] if b == 2 else mx.concatenate([prefix_v, own_v[b: b + 1]], 2)
        full = mx.concatenate([mx.ones((L, keys.shape[2] - L), dtype=mx.bool_),
                               mx.tril(mx.ones((L, L), dtype=mx.bool_))], axis=1)
        want = mx.fast.scaled_dot_product_attention(q[b: b + 1], keys, values, scale=0.25,
                                                    mask=full[None, None], sinks=sinks)
        assert mx.allclose(got[b: b + 1], want, atol=1e-5).item()


def test_a_copied_batch_still_shares_its_prefix():
    import copy

    prefix = SharedPrefix([mx.zeros((1, 2, 8, 4))], [mx.zeros((1, 2, 8, 4))])
    batch = PrefixedCache.merge([PrefixedCache(prefix, 0), PrefixedCache(prefix, 0)])
    clone = copy.deepcopy(batch)
    assert clone.prefixes[0] is prefix and clone.prefixes[1] is prefix
    assert clone.offset.tolist() == [8, 8]  # positions count the prefix


def test_an_architecture_without_the_shared_attention_function_falls_back_once(caplog):
    class Attention:
        pass

    class Layer:
        self_attn = Attention()

    class Model:
        layers = [Layer()]

    with caplog.at_level(logging.WARNING, logger="batchrun"):
        assert not shared_prefix.install(Model())
        assert not shared_prefix.install(Model())
    assert len([r for r in caplog.records if "shared attention function" in r.message]) == 1


@pytest.mark.parametrize("dtype,atol", [(mx.float32, 1e-5), (mx.bfloat16, 3e-2)])
def test_the_fused_prefix_part_equals_the_exact_one(dtype, atol):
    """The GPU's prefix part (fused attention, its log-sum-exp read from a reference key)
    against materialized scores; scores spread wide, as a sink token makes them."""
    mx.random.seed(1)
    rows, kv_heads, width, D, P = 3, 2, 6, 16, 50
    q = mx.random.normal((rows, kv_heads, width, D)) * 2
    keys = mx.random.normal((1, kv_heads, P, D))
    keys[:, :, 0] = keys[:, :, 0] * 6  # a dominant key
    values = mx.random.normal((1, kv_heads, P, D))
    want_out, want_lse = shared_prefix._attend_prefix(q * 0.25, keys, values)
    out, lse = shared_prefix._attend_prefix_fused(q.astype(dtype), keys.astype(dtype),
                                                  values.astype(dtype), 0.25)
    assert mx.allclose(out, want_out, atol=atol).item()
    assert mx.allclose(lse, want_lse, atol=atol, rtol=atol).item()


@pytest.mark.parametrize("knobs,dtype,atol", [
    ({"ASYNC_CHUNKS": True, "ASYNC_WINDOW": None}, mx.float32, 0.0),
    ({"ASYNC_CHUNKS": True, "ASYNC_WINDOW": 2}, mx.float32, 0.0),
    ({"LOW_PRECISION_SCORES": True}, mx.bfloat16, 3e-2),
    ({"LOW_PRECISION_SCORES": True}, mx.float32, 0.0),  # a float32 model keeps float32 scores
])
def test_the_prefix_part_s_speed_knobs_keep_its_result(monkeypatch, knobs, dtype, atol):
    """Scheduling the evaluated chunks without waiting (windowed, the default, or not at all)
    changes nothing; half-precision scores stay within half precision of the float32 ones."""
    mx.random.seed(2)
    rows, kv_heads, width, D, P = 5, 2, 6, 16, 70
    q = mx.random.normal((rows, kv_heads, width, D)) * 0.5
    keys = mx.random.normal((1, kv_heads, P, D)).astype(dtype)
    values = mx.random.normal((1, kv_heads, P, D)).astype(dtype)
    monkeypatch.setattr(shared_prefix, "EVAL_CHUNKS_ABOVE", 1)  # a prefill's chunking, small
    monkeypatch.setattr(shared_prefix, "EVAL_CHUNK_ELEMENTS", kv_heads * width * P)
    monkeypatch.setattr(shared_prefix, "ASYNC_CHUNKS", False)  # each chunk waited for
    want_out, want_lse = shared_prefix._attend_prefix(q, keys.astype(mx.float32),
                                                      values.astype(mx.float32))
    for name, value in knobs.items():
        monkeypatch.setattr(shared_prefix, name, value)
    out, lse = shared_prefix._attend_prefix(q, keys, values)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert mx.allclose(out, want_out, atol=atol, rtol=atol).item()
    assert mx.allclose(lse, want_lse, atol=atol, rtol=atol).item()


def test_a_prefix_computed_in_steps_on_the_cpu_matches_one_computed_whole(demo, monkeypatch):
    """On the CPU a shared prefix is computed a few hundred tokens at a time, each step
    attending the ones before as a shared prefix: the KV is the whole prefill's."""
    from batchrun.engine.backends import text
    from batchrun.engine.sequence import Sequence

    monkeypatch.setattr(text, "CPU_PREFIX_STEP", 48)
    backend = text.TextBackend(demo.model, demo.tokenizer)
    backend.start(4, EngineConfig())
    prompt = demo.tokenizer.encode(FIRST + " " + SECOND)
    seq = Sequence(0, prompt, GREEDY, 10)
    assert not backend.share_prefixes(False)
    whole = backend.compute_prefix(seq, 160, [])
    assert backend.share_prefixes(True)
    stepped = backend.compute_prefix(seq, 160, [])
    assert len(stepped) == len(whole)
    for (k1, v1), (k2, v2) in zip(whole, stepped, strict=True):
        assert k1.shape == k2.shape == (1, k1.shape[1], 160, k1.shape[3])
        assert mx.allclose(k1, k2, atol=1e-4).item() and mx.allclose(v1, v2, atol=1e-4).item()


def test_the_tail_is_what_most_rows_share_and_pays_for_its_copy():
    from batchrun.engine.backends.text import best_tail

    preamble = list(range(100, 124))
    rows = [preamble + [i, 7] for i in range(20)]
    assert best_tail(rows, 64, 300) == preamble  # 24 tokens x 19 rows saved >= 300
    outliers = [[5, 6, 7], preamble[:1] + [9, 9]]  # one leaves at once, one after a token
    assert best_tail(outliers + rows, 64, 300) == preamble  # they do not cut it for the rest
    assert best_tail(rows, 16, 200) == preamble[:16]  # at most a block
    assert best_tail(rows, 64, 24 * 19 + 1) == []  # saves less than the prefix's copy
    assert best_tail([preamble + [1]], 64, 0) == []  # one row alone shares with nobody


def test_the_attention_shape_is_the_models_even_with_a_scale_of_its_own(demo):
    """The kernels compiled ahead are for the model's own head size: read from the attention
    module, not inferred from its scale (which some models set otherwise)."""
    attention = demo.model.layers[0].self_attn
    dtype, head_dim, group = shared_prefix.attention_shape(demo.model)
    assert (dtype, head_dim, group) == (mx.float32, attention.head_dim,
                                        attention.n_heads // attention.n_kv_heads)
    real = attention.scale
    try:
        attention.scale = real * 0.5  # a model scaling its scores its own way
        assert shared_prefix.attention_shape(demo.model)[1] == attention.head_dim
    finally:
        attention.scale = real
