"""The prefix part of cascade attention on CUDA (prefix_attention.py): its contract, checked here
through `reference` (the same contract in MLX ops) against the MLX and NumPy paths it replaces
on CUDA; the dispatch that picks it; its source compiling for the tensor cores it needs; and
the engine's greedy tokens when the prefix part takes it."""

import re
import sys
import time

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from test_shared_prefix import FIRST, SECOND, rows, run

from batchrun.engine.backends import text
from batchrun.engine.kernels import decode_attention as da
from batchrun.engine.kernels import nvrtc, shared_prefix
from batchrun.engine.kernels import prefix_attention as pa
from batchrun.engine.kernels.nvrtc import NvrtcError


def inputs(rows=3, kv_heads=2, width=12, length=150, D=64, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((rows, kv_heads, width, D)).astype(dtype)
    k = mx.random.normal((1, kv_heads, length, D)).astype(dtype)
    v = mx.random.normal((1, kv_heads, length, D)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("rows,width,length", [(1, 1, 1), (3, 12, 150), (5, 37, 64)])
def test_the_contract_is_the_prefix_part_the_mlx_and_numpy_paths_compute(rows, width, length):
    q, k, v = inputs(rows=rows, width=width, length=length)
    scale = 64 ** -0.5
    out, lse = pa.reference(q, k, v, scale)
    assert out.shape == q.shape and out.dtype == mx.float32
    assert lse.shape == q.shape[:3] and lse.dtype == mx.float32
    scaled = q * scale
    for p_out, p_lse in (shared_prefix._attend_prefix(scaled, k, v),
                         shared_prefix._attend_prefix_host(
                             scaled, mx.swapaxes(k[0], -1, -2), v[0])):
        assert mx.allclose(out, p_out, atol=1e-5) and mx.allclose(lse, p_lse, atol=1e-5)
    # And straight from the definition: softmax over the prefix's keys.
    scores = (scaled[:, :, :, None] * k[0][None, :, None]).sum(-1)  # (rows, kv, width, len)
    assert mx.allclose(lse, mx.logsumexp(scores, axis=-1), atol=1e-5)
    assert mx.allclose(out, mx.softmax(scores, axis=-1) @ v[0][None], atol=1e-5)


def prefill_chunks(B=3, heads=4, kv_heads=2, length=40, D=64, pad=(0, 2, 1), chunks=(5, 3),
                   dtype=mx.float32, seed=1):
    """A batch cache of rows under one prefix, prefilled in chunks: for each chunk, (queries,
    the cache after its keys went in, the mask mlx-lm's model passes)."""
    mx.random.seed(seed)
    k = mx.random.normal((1, kv_heads, length, D)).astype(dtype)
    v = mx.random.normal((1, kv_heads, length, D)).astype(dtype)
    prefix = shared_prefix.SharedPrefix([k], [v])
    cache = shared_prefix.SharedPrefixBatchCache([prefix] * B, 0)
    cache.left_padding = mx.array(list(pad))
    for L in chunks:
        queries = mx.random.normal((B, heads, L, D)).astype(dtype)
        mask = cache.make_mask(L)
        cache.update_and_fetch(mx.random.normal((B, kv_heads, L, D)).astype(dtype),
                               mx.random.normal((B, kv_heads, L, D)).astype(dtype))
        yield queries, cache, mask, (k, v)


def test_the_cascade_contract_is_the_whole_attention_of_a_prefill_under_one_prefix():
    """cascade_reference (the cascade kernel's contract) gives what the parts path gives
    (prefix part, own part under mlx-lm's mask, merged), and what attention over the prefix
    followed by the row's own keys gives, left padding and causality included."""
    for queries, cache, mask, (k, v) in prefill_chunks():
        B, heads, L, D = queries.shape
        used = cache._idx
        expected = shared_prefix.attention_with_prefix(
            queries, cache.keys[..., :used, :], cache.values[..., :used, :], cache, 0.125, mask)
        out = pa.cascade_reference(queries, cache.keys, cache.values, cache.left_padding, used,
                                   k, v, 0.125)
        assert out.shape == queries.shape and mx.allclose(out, expected, atol=1e-5)
        for b, pad in enumerate(cache.left_padding.tolist()):  # each row from the definition
            whole_k = mx.concatenate([k[0], cache.keys[b, :, pad:used]], axis=1)
            whole_v = mx.concatenate([v[0], cache.values[b, :, pad:used]], axis=1)
            seen = mx.arange(whole_k.shape[1])[None] <= k.shape[2] + mx.arange(
                used - L, used)[:, None] - pad
            row = mx.fast.scaled_dot_product_attention(
                queries[b: b + 1], whole_k[None], whole_v[None], scale=0.125, mask=seen)
            real = slice(max(0, pad - (used - L)), L)  # the row's queries, not its padding
            assert mx.allclose(out[b, :, real], row[0, :, real], atol=1e-5)


def test_the_whole_prefill_path_serves_rows_under_one_prefix_with_queries_to_spare(monkeypatch):
    monkeypatch.setattr(pa, "EVERYWHERE", True)
    (queries, cache, _, (k, v)), = prefill_chunks(chunks=(5,), dtype=mx.bfloat16)
    assert pa.serves_cascade(queries, cache.keys, k, v)
    assert not pa.serves_cascade(queries[:, :, :1], cache.keys, k, v)  # a decode step
    assert not pa.serves_cascade(queries, cache.keys.astype(mx.float16), k, v)
    assert not pa.serves_cascade(queries, cache.keys, k[:, :, :0], v[:, :, :0])
    monkeypatch.setattr(pa, "ENABLED", False)
    assert not pa.serves_cascade(queries, cache.keys, k, v)


def test_a_refused_cascade_launch_takes_the_parts_path_for_that_call(monkeypatch, caplog):
    monkeypatch.setattr(pa, "on_cuda", lambda: True)
    monkeypatch.setattr(pa, "_refused", [])
    monkeypatch.setattr(pa, "_cascade_refused", [])
    monkeypatch.setattr(pa, "_compiled", lambda *args: ("name", b"ptx"))
    monkeypatch.setattr(pa, "_verify", lambda *args: None)
    monkeypatch.setattr(pa, "_verify_cascade", lambda *args: None)
    prefix_parts = []

    def launch(q, k, v, scale):
        prefix_parts.append(q.shape[0])
        return pa.reference(q, k, v, scale)

    monkeypatch.setattr(pa, "_launch", launch)

    def refused(*args):
        raise RuntimeError("[precompiled_cuda_kernel] failed to load the module")

    monkeypatch.setattr(pa, "_launch_cascade", refused)
    (queries, cache, mask, _), = prefill_chunks(chunks=(5,), dtype=mx.bfloat16)
    used = cache._idx
    keys, values = cache.keys[..., :used, :], cache.values[..., :used, :]
    with caplog.at_level("WARNING", logger="batchrun"):
        out = shared_prefix.attention_with_prefix(queries, keys, values, cache, 0.125, mask)
    assert [r.message for r in caplog.records] == [
        "the shared-prefix prefill kernel is not available ([precompiled_cuda_kernel] failed "
        "to load the module); prefills under a shared prefix take the prefix kernel and MLX's "
        "ops"]
    assert prefix_parts == [3] and pa._refused == []  # the prefix kernel served its part
    monkeypatch.setattr(pa, "ENABLED", False)  # MLX's ops throughout
    expected = shared_prefix.attention_with_prefix(queries, keys, values, cache, 0.125, mask)
    assert mx.allclose(out.astype(mx.float32), expected.astype(mx.float32), atol=2e-2)


def test_the_path_serves_half_precision_prefix_parts_only_where_its_kernel_runs(monkeypatch):
    q, k, v = inputs(dtype=mx.bfloat16)
    assert not pa.serves(q, k, v)  # this CPU: NumPy or MLX ops, as before
    monkeypatch.setattr(pa, "EVERYWHERE", True)
    assert pa.serves(q, k, v)
    assert not pa.serves(q, k, v[..., :32])  # values of another head size
    assert not pa.serves(q, k[:, :, :0], v[:, :, :0])  # nothing to attend
    monkeypatch.setattr(pa, "ENABLED", False)
    assert not pa.serves(q, k, v)


def test_on_cuda_the_kernel_takes_half_precision_and_its_head_sizes_only(monkeypatch):
    monkeypatch.setattr(pa, "on_cuda", lambda: True)
    monkeypatch.setattr(pa, "_refused", [])
    monkeypatch.setattr(pa, "_compiled", lambda *args: ("name", b"ptx"))
    monkeypatch.setattr(pa, "_verify", lambda *args: None)
    for dtype, D, takes in [(mx.bfloat16, 64, True), (mx.float16, 128, True),
                            (mx.float32, 64, False), (mx.bfloat16, 96, False)]:
        q, k, v = inputs(D=D, dtype=dtype)
        assert pa.serves(q, k, v) is takes
    q, k, v = inputs(dtype=mx.bfloat16)
    assert not pa.serves(q, k.astype(mx.float16), v)  # keys of another type


@pytest.fixture
def counted(monkeypatch):
    """Counts the rows given to the path's references (the CPU's stand-ins for the kernels):
    {"prefix": [rows a call], "cascade": [...]}."""
    calls = {"prefix": [], "cascade": []}
    for kind, name in (("prefix", "reference"), ("cascade", "cascade_reference")):
        original = getattr(pa, name)

        def counting(q, *args, _kind=kind, _original=original, **kwargs):
            calls[_kind].append(q.shape[0])
            return _original(q, *args, **kwargs)

        monkeypatch.setattr(pa, name, counting)
    return calls


@pytest.mark.parametrize("concurrency", [1, 64])
def test_greedy_tokens_do_not_change_when_the_prefix_part_takes_the_path(
        demo, monkeypatch, counted, concurrency):
    """Prefills and decode steps of rows under two prefixes, mixed in batches: a prefill of
    rows under one prefix takes the whole-attention path, the rest the prefix part's."""
    chats = rows(FIRST, 6) + rows(SECOND, 6) + rows(FIRST, 4, start=6)
    expected, _ = run(demo, chats, prefix=False)
    monkeypatch.setattr(pa, "EVERYWHERE", True)
    tokens, engine = run(demo, chats, concurrency=concurrency)
    assert engine.get_cache_stats()["hit_tokens"] > 0
    assert tokens == expected
    assert counted["prefix"] and max(counted["prefix"]) > (1 if concurrency > 1 else 0)
    assert counted["cascade"]  # prefills


def test_without_a_compiler_the_prefix_part_keeps_mlxs_ops_with_one_warning(
        monkeypatch, caplog):
    monkeypatch.setattr(pa, "on_cuda", lambda: True)  # as on a CUDA machine without NVRTC
    monkeypatch.setattr(pa, "_refused", [])
    pa._compiled.cache_clear()

    def missing(*args):
        raise NvrtcError("NVRTC (CUDA's runtime compiler) was not found")

    monkeypatch.setattr(pa, "compile_ptx", missing)
    q, k, v = inputs(dtype=mx.bfloat16)
    with caplog.at_level("WARNING", logger="batchrun"):
        assert not pa.serves(q, k, v)
        assert not pa.serves(q, k, v)
        assert pa.prefix_attention(q, k, v, 0.125) is None  # the caller's MLX ops, then
    warnings = [r for r in caplog.records if "shared-prefix attention kernel" in r.message]
    assert len(warnings) == 1 and "NVRTC" in warnings[0].message
    pa._compiled.cache_clear()


def test_a_launch_mlx_refuses_falls_back_for_the_process(monkeypatch, caplog):
    monkeypatch.setattr(pa, "on_cuda", lambda: True)
    monkeypatch.setattr(pa, "_refused", [])
    monkeypatch.setattr(pa, "_compiled", lambda *args: ("name", b"ptx"))
    monkeypatch.setattr(pa, "_verify", lambda *args: None)

    def refused(*args):
        raise RuntimeError("[precompiled_cuda_kernel] failed to load the module")

    monkeypatch.setattr(pa, "_launch", refused)
    q, k, v = inputs(dtype=mx.bfloat16)
    with caplog.at_level("WARNING", logger="batchrun"):
        assert pa.serves(q, k, v)
        assert pa.prefix_attention(q, k, v, 0.125) is None  # the caller's MLX ops, which
        assert not pa.serves(q, k, v)  # bound their scores, for the rest of the process
    assert sum("shared-prefix attention kernel" in r.message for r in caplog.records) == 1
    # Through cascade attention: the refused launch's call still gets the exact result.
    monkeypatch.setattr(pa, "_refused", [])
    prefix = shared_prefix.SharedPrefix([k[:, :, :40]], [v[:, :, :40]])
    cache = shared_prefix.SharedPrefixBatchCache([prefix, prefix], 0)
    queries = mx.random.normal((2, 4, 3, 64)).astype(mx.bfloat16)
    own = mx.random.normal((2, 2, 3, 64)).astype(mx.bfloat16)
    mask = cache.make_mask(3)
    keys, values = cache.update_and_fetch(own, own)
    out = shared_prefix.attention_with_prefix(queries, keys, values, cache, 0.125, mask)
    whole_k = mx.concatenate([mx.broadcast_to(k[:, :, :40], (2, 2, 40, 64)), own], axis=2)
    causal = mx.arange(43)[None] <= mx.arange(40, 43)[:, None]
    expected = mx.fast.scaled_dot_product_attention(
        queries.astype(mx.float32), whole_k.astype(mx.float32),
        mx.concatenate([mx.broadcast_to(v[:, :, :40], (2, 2, 40, 64)), own],
                       axis=2).astype(mx.float32), scale=0.125, mask=causal)
    assert mx.allclose(out.astype(mx.float32), expected, atol=2e-2)


@pytest.mark.parametrize("broken", [False, True])
def test_a_kernel_variant_is_checked_against_the_reference_before_rows_use_it(
        monkeypatch, caplog, broken):
    monkeypatch.setattr(pa, "on_cuda", lambda: True)
    monkeypatch.setattr(pa, "_refused", [])
    monkeypatch.setattr(pa, "_compiled", lambda *args: ("name", b"ptx"))
    pa._verify.cache_clear()
    launched = []

    def launch(q, k, v, scale):  # the kernel's contract, or not
        launched.append(q.shape)
        out, lse = pa.reference(q, k, v, scale)
        return (out, lse + 0.5) if broken else (out, lse)

    monkeypatch.setattr(pa, "_launch", launch)
    q, k, v = inputs(dtype=mx.bfloat16)
    with caplog.at_level("WARNING", logger="batchrun"):
        assert pa.serves(q, k, v) is not broken
        assert pa.serves(q, k, v) is not broken
    assert len(launched) == 1  # once a variant
    # The check's inputs leave the last block of queries and the last tile of keys part-full.
    rows_, _, width, _ = launched[0]
    assert rows_ * width % pa.QUERIES_A_BLOCK and 150 % 64
    warnings = [r.message for r in caplog.records if "shared-prefix attention kernel" in r.message]
    assert warnings == (["the shared-prefix attention kernel is not available (its results "
                         "differ from MLX's by 0.5 on a test input); the prefix part of "
                         "attention takes MLX's ops"] if broken else [])
    pa._verify.cache_clear()


@pytest.mark.parametrize("broken", [False, True])
def test_the_cascade_kernel_is_checked_apart_and_its_failure_leaves_the_prefix_kernel(
        monkeypatch, caplog, broken):
    monkeypatch.setattr(pa, "on_cuda", lambda: True)
    monkeypatch.setattr(pa, "_refused", [])
    monkeypatch.setattr(pa, "_cascade_refused", [])
    monkeypatch.setattr(pa, "_compiled", lambda *args: ("name", b"ptx"))
    monkeypatch.setattr(pa, "_verify", lambda *args: None)
    pa._verify_cascade.cache_clear()
    cascaded = []

    def launch_cascade(queries, own_k, own_v, pad, used, k, v, scale):
        cascaded.append((queries.shape, pad.tolist(), used))
        out = pa.cascade_reference(queries, own_k, own_v, pad, used, k, v, scale)
        return out + 0.5 if broken else out

    monkeypatch.setattr(pa, "_launch_cascade", launch_cascade)
    (queries, cache, _, (k, v)), = prefill_chunks(chunks=(5,), dtype=mx.bfloat16)
    with caplog.at_level("WARNING", logger="batchrun"):
        assert pa.serves_cascade(queries, cache.keys, k, v) is not broken
        assert pa.serves_cascade(queries, cache.keys, k, v) is not broken
        q, pk, pv = inputs(dtype=mx.bfloat16)
        assert pa.serves(q, pk, pv)  # the prefix kernel serves on either way
    assert len(cascaded) == 1  # checked once
    # Its inputs give rows of two blocks, with no left padding, some, and more than where
    # their new tokens start (padding queries that see the prefix only).
    (_, heads, L, _), pad, used = cascaded[0]
    assert pa.QUERIES_A_BLOCK < heads // 2 * L < 2 * pa.QUERIES_A_BLOCK
    assert 0 in pad and 0 < min(p for p in pad if p) <= used - L < max(pad) < used
    warnings = [r.message for r in caplog.records if "kernel is not available" in r.message]
    assert len(warnings) == broken and all(re.fullmatch(
        r"the shared-prefix prefill kernel is not available \(its results differ from MLX's "
        r"by 0\.5\d* on a test input\); prefills under a shared prefix take the prefix kernel "
        r"and MLX's ops", w) for w in warnings)
    monkeypatch.setattr(pa, "CASCADE_ENABLED", False)  # BATCHRUN_CASCADE_KERNEL=0
    pa._verify_cascade.cache_clear()
    assert not pa.serves_cascade(queries, cache.keys, k, v)
    assert len(cascaded) == 1  # not even checked
    pa._verify_cascade.cache_clear()


def test_prefills_under_several_prefixes_or_with_sinks_keep_the_parts(monkeypatch, counted):
    monkeypatch.setattr(pa, "EVERYWHERE", True)
    (queries, cache, mask, (k, v)), = prefill_chunks(chunks=(5,))
    used = cache._idx
    keys, values = cache.keys[..., :used, :], cache.values[..., :used, :]
    shared_prefix.attention_with_prefix(queries, keys, values, cache, 0.125, mask)
    assert counted["cascade"] == [3] and counted["prefix"] == []
    sinks = mx.zeros((queries.shape[1],))
    shared_prefix.attention_with_prefix(queries, keys, values, cache, 0.125, mask, sinks)
    assert counted["cascade"] == [3] and counted["prefix"] == [3]
    other = shared_prefix.SharedPrefix([k[:, :, :20]], [v[:, :, :20]])
    cache.prefixes[1] = other  # two prefixes in the batch
    cache._groups = None
    shared_prefix.attention_with_prefix(queries, keys, values, cache, 0.125, mask)
    assert counted["cascade"] == [3] and sorted(counted["prefix"][1:]) == [1, 2]


def test_the_cascade_path_refuses_a_grid_past_an_int(monkeypatch):
    monkeypatch.setattr(pa, "EVERYWHERE", True)
    (queries, cache, _, (k, v)), = prefill_chunks(chunks=(5,))
    assert pa.serves_cascade(queries, cache.keys, k, v)
    blocks = 2 ** 31 // 128  # rows of one block each (width 10 here)
    huge = mx.broadcast_to(queries[:1], (blocks,) + queries.shape[1:])
    assert not pa.serves_cascade(huge, cache.keys, k, v)
    assert pa.serves_cascade(huge[: blocks - 1], cache.keys, k, v)


@pytest.mark.skipif(sys.platform != "linux", reason="NVIDIA ships NVRTC's wheels for Linux")
def test_the_kernels_source_compiles_for_tensor_cores_with_the_launched_name():
    """No GPU here: NVRTC (from nvidia-cuda-nvrtc, a test dependency) still compiles. The
    variants need Ampere's mma.sync shape and ldmatrix, and keep their arrays in registers."""
    names = set()
    for dtype, kind in ((mx.bfloat16, "bf16"), (mx.float16, "f16")):
        for D in pa.HEAD_DIMS:
            name, ptx = pa._compiled(dtype, D)
            text = ptx.decode()
            assert ptx.endswith(b"\0") and f".visible .entry {name}(" in text
            assert f".visible .entry {name}{pa.CASCADE}(" in text
            target = int(re.search(r"\.target sm_(\d+)", text).group(1))
            assert target >= pa.OLDEST_ARCH
            assert f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32" in text
            # A tile of 64 keys: D/16 score products and D/8 value products per 8 and 16 keys;
            # one tile loop in the prefix kernel, two (prefix, own keys) in the cascade one.
            per_tile = (64 // 8) * (D // 16) + (64 // 16) * (D // 8)
            prefix, cascade = text.split(f".visible .entry {name}{pa.CASCADE}(")
            assert prefix.count("mma.sync") == per_tile
            assert cascade.count("mma.sync") == 2 * per_tile
            assert ".local" not in text  # no array spilled to local memory
            names.add(name)
    assert len(names) == 2 * len(pa.HEAD_DIMS)  # no two share a name


def test_kernels_compiled_ahead_are_waited_for_and_a_failure_is_left_to_the_first_use(capfd):
    order = []

    def slow():
        time.sleep(0.2)
        order.append("compiled")

    def broken():
        raise NvrtcError("compiling kernel.cu failed")

    nvrtc.compile_ahead(broken, slow)
    nvrtc.wait_ahead()
    order.append("first use")
    assert order == ["compiled", "first use"]
    assert capfd.readouterr().err == ""  # no thread's traceback: the first use reports it


def test_on_cuda_a_text_backend_compiles_its_models_kernels_ahead(demo, monkeypatch):
    """A half-precision model with head size 64 and 2 query heads a KV head: the prefix
    kernel's variant and the decode kernel's, started before any row."""
    calls = []
    monkeypatch.setattr(text, "compile_ahead", lambda *c: calls.extend(c))
    monkeypatch.setattr(da, "on_cuda", lambda: True)
    monkeypatch.setattr(pa, "on_cuda", lambda: True)
    monkeypatch.setattr(pa, "_compiled", lambda *args: ("prefix", args))
    monkeypatch.setattr(da, "_compiled", lambda *args: ("decode", args))
    args = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=1,
                           intermediate_size=256, num_attention_heads=4,
                           num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    text.TextBackend(model, demo.tokenizer)
    assert [c() for c in calls] == [("prefix", (mx.bfloat16, 64)),
                                    ("decode", (mx.bfloat16, 64, 2, da.WARPS, da.GROUPED))]
    calls.clear()
    model.set_dtype(mx.float32)  # float32 models keep MLX's attention on CUDA
    text.TextBackend(model, demo.tokenizer)
    assert calls == []
