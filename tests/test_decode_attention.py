"""Decode attention from each row's key range: the contract the CUDA kernel implements (checked
here through `reference`, the same contract in MLX ops), the dispatch that picks it, and the
engine's greedy tokens when decode steps take it."""

import sys

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.base import create_causal_mask
from test_shared_prefix import FIRST, SECOND, rows, run

from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.kernels import decode_attention as da
from batchrun.engine.kernels.nvrtc import NvrtcError
from batchrun.engine.types import SamplingParams
from batchrun.models.families import build_family


def inputs(rows=5, heads=8, kv_heads=2, length=300, D=64, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((rows, heads, 1, D))
    buffer = (rows, kv_heads, length + 20, D)  # a batch cache's buffer, sliced to its length
    k = mx.random.normal(buffer)[..., :length, :]
    v = mx.random.normal(buffer)[..., :length, :]
    return q, k, v


@pytest.mark.parametrize("splits", [1, 2, 5, 64])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
def test_a_rows_range_gives_what_mlx_lms_mask_gives(splits, heads, kv_heads):
    q, k, v = inputs(heads=heads, kv_heads=kv_heads)
    length = k.shape[2]
    starts = mx.array([0, 3, 100, length - 1, 17])  # one row holds only its newest key
    mask = create_causal_mask(1, offset=length - 1, left_padding=starts)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)

    out, lse = da.ranged_attention(q, k, v, starts, 0.125, with_lse=True, splits=splits)

    assert out.shape == expected.shape and out.dtype == mx.float32
    assert mx.allclose(out, expected, atol=1e-5)
    G = heads // kv_heads
    scores = (q.reshape(5, kv_heads, G, 64) * 0.125) @ k.swapaxes(-1, -2)
    scores = mx.where((mx.arange(length) >= starts[:, None])[:, None, None], scores, -mx.inf)
    assert mx.allclose(lse, mx.logsumexp(scores, axis=-1).reshape(5, heads), atol=1e-5)


def test_a_row_without_keys_gets_zeros_not_nan_whatever_the_splits():
    q, k, v = inputs(rows=2, length=10)
    for splits in (1, 3):
        out, lse = da.ranged_attention(q, k, v, mx.array([10, 0]), 0.125, with_lse=True,
                                       splits=splits)
        assert not mx.isnan(out).any() and (out[0] == 0).all()
        assert mx.isinf(lse[0]).all() and not mx.isinf(lse[1]).any()


def test_a_cache_buffer_is_read_up_to_its_filled_length():
    q, k, v = inputs(length=40)
    buffer_k = mx.concatenate([k, mx.random.normal(k.shape)], axis=2)  # 40 more unfilled slots
    buffer_v = mx.concatenate([v, mx.random.normal(v.shape)], axis=2)
    starts = mx.array([0, 5, 39, 2, 0])
    whole, _ = da.ranged_attention(q, k, v, starts, 0.125)
    filled, _ = da.ranged_attention(q, buffer_k, buffer_v, starts, 0.125, length=40)
    assert mx.allclose(whole, filled)
    assert not mx.allclose(whole, da.ranged_attention(q, buffer_k, buffer_v, starts, 0.125)[0])


def test_splits_without_keys_weigh_nothing():
    q, k, v = inputs(rows=2, length=10)
    starts = mx.array([9, 0])
    parts, lse = da.reference(q, k, v, starts, 0.125, splits=4)
    lo, hi = da.split_bounds(starts, 10, 4)
    assert lo.tolist() == [[9, 10, 11, 12], [0, 3, 6, 9]]
    assert hi.tolist() == [[10, 10, 10, 10], [3, 6, 9, 10]]
    assert mx.isinf(lse[0, :, 1:]).all() and not mx.isinf(lse[1]).any()
    out, _ = da.merge_splits(parts, lse)
    whole, _ = da.reference(q, k, v, starts, 0.125, splits=1)
    assert mx.allclose(out, whole[:, :, 0], atol=1e-6)


def test_without_lse_the_output_keeps_the_queries_dtype():
    q, k, v = (x.astype(mx.float16) for x in inputs(rows=3, length=40))
    out, lse = da.ranged_attention(q, k, v, mx.array([0, 1, 2]), 0.125)
    assert lse is None and out.dtype == mx.float16 and out.shape == (3, 8, 1, 64)


def test_narrow_batches_split_long_contexts():
    assert da.splits_for(1024, 8, 384) == 1  # 8,192 thread blocks already
    assert da.splits_for(8, 8, 2048) == 16  # 64 (row, head) pairs: split the keys
    assert da.splits_for(8, 8, 300) == 2  # but each split keeps MIN_SPLIT_KEYS keys
    assert da.splits_for(1, 1, 50) == 1


def test_the_path_serves_decode_steps_only_where_its_kernel_runs(monkeypatch):
    q, k, v = (x.astype(mx.bfloat16) for x in inputs())
    assert not da.serves(q, k, v)  # this CPU: MLX's attention, as before
    monkeypatch.setattr(da, "EVERYWHERE", True)
    assert da.serves(q, k, v)
    assert not da.serves(mx.concatenate([q, q], axis=2), k, v)  # a prefill
    assert not da.serves(q, k, v[..., :32])  # values of another head size
    assert not da.serves(q[:, :7], k, v)  # query heads not a multiple of the KV heads
    monkeypatch.setattr(da, "ENABLED", False)
    assert not da.serves(q, k, v)


def engine_tokens(demo, prompts, concurrency):
    engine = Engine(demo.model, demo.tokenizer, EngineConfig(max_concurrency=concurrency),
                    demo.context_length)
    for p in prompts:
        engine.add_tokens(p, SamplingParams(max_tokens=12))
    return [o.token_ids for o in engine.run()]


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls of the path's reference (the CPU's stand-in for the kernel)."""
    calls = []
    original = da.reference

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(da, "reference", counting)
    return calls


@pytest.mark.parametrize("concurrency", [1, 16])
def test_greedy_tokens_do_not_change_when_decode_steps_take_row_ranges(
        demo, monkeypatch, counted, concurrency):
    # Prompts of different lengths: left padding, and rows joining a running batch.
    prompts = [list(range(3 + i % 5, 20 + (i * 7) % 40)) for i in range(24)]
    monkeypatch.setattr(da, "ENABLED", False)
    expected = engine_tokens(demo, prompts, concurrency)
    assert not counted
    monkeypatch.setattr(da, "ENABLED", True)
    monkeypatch.setattr(da, "EVERYWHERE", True)
    assert engine_tokens(demo, prompts, concurrency) == expected
    assert counted and max(counted) == min(concurrency, 24)


def test_decode_steps_of_a_model_with_attention_sinks_take_row_ranges(monkeypatch, counted,
                                                                     tmp_path):
    # gpt-oss: a sink logit a head joins the softmax's denominator on every layer
    model, tokenizer = load(str(build_family(tmp_path / "m", "gpt_oss", "tiny", "none")))
    prompts = [list(range(3 + i % 5, 20 + (i * 7) % 40)) for i in range(12)]

    def tokens():
        engine = Engine(model, tokenizer, EngineConfig(max_concurrency=8))
        for p in prompts:
            engine.add_tokens(p, SamplingParams(max_tokens=10))
        return [o.token_ids for o in engine.run()]

    monkeypatch.setattr(da, "ENABLED", False)
    expected = tokens()
    assert not counted
    monkeypatch.setattr(da, "ENABLED", True)
    monkeypatch.setattr(da, "EVERYWHERE", True)
    assert tokens() == expected
    assert counted


def test_the_kernel_takes_gemmas_head_dimension(monkeypatch):
    monkeypatch.setattr(da, "on_cuda", lambda: True)
    monkeypatch.setattr(da, "_refused", [])
    monkeypatch.setattr(da, "_compiled", lambda *args: ("name", b"ptx"))
    monkeypatch.setattr(da, "_verify", lambda *args: None)
    k = mx.zeros((1, 1, 8, 256), mx.bfloat16)
    assert da._kernel_takes(mx.zeros((1, 4, 1, 256), mx.bfloat16), k)  # Gemma 3: 4 heads of 256
    assert da.compile_call(mx.bfloat16, 256, 4) is not None
    assert not da._kernel_takes(mx.zeros((1, 4, 1, 96), mx.bfloat16), k[..., :96])


@pytest.mark.parametrize("concurrency", [1, 16])
def test_rows_holding_copies_of_cached_blocks_join_rows_without(demo, monkeypatch, counted,
                                                                 concurrency):
    """--no-shared-prefix with a prefix cache: a row without cached blocks is inserted, then,
    in the same step, rows after a freshly computed prefix (copies of its blocks): one prefill
    holds both, no fault restarts the batch, and their decode steps still take row ranges
    (with mlx-lm's own caches they took the mask: a decode job 3x slower on the H200)."""
    chats = [[{"role": "user", "content": "hi"}]] + rows(FIRST, 4) + rows(SECOND, 3)
    expected, _ = run(demo, chats, prefix=False)
    monkeypatch.setattr(da, "EVERYWHERE", True)
    tokens, engine = run(demo, chats, shared=False, concurrency=concurrency)
    assert engine.get_cache_stats()["hit_tokens"] > 0
    assert tokens == expected and engine.faults == 0
    assert counted and max(counted) == min(concurrency, len(chats))


@pytest.mark.parametrize("grouped", [True, False])
def test_the_kernel_is_not_asked_for_more_registers_or_shared_memory_than_a_block_has(
        monkeypatch, grouped):
    monkeypatch.setattr(da, "on_cuda", lambda: True)
    monkeypatch.setattr(da, "_refused", [])
    monkeypatch.setattr(da, "_compiled", lambda *args: ("name", b"ptx"))
    monkeypatch.setattr(da, "_verify", lambda *args: None)
    monkeypatch.setattr(da, "GROUPED", grouped)
    q = mx.zeros((1, 16, 1, 128), mx.bfloat16)  # 16 query heads a KV head, head size 128
    k = mx.zeros((1, 1, 8, 128), mx.bfloat16)
    if not grouped:  # the queries and the lanes' scores sit in shared memory, by warp
        monkeypatch.setattr(da, "WARPS", 8)
        assert da.shared_bytes(16, 128) > da.SHARED_LIMIT >= da.shared_bytes(8, 128)
    assert not da._kernel_takes(q, k)
    assert da._kernel_takes(q[:, :8], k)


def test_rows_under_shared_prefixes_decode_the_same_with_row_ranges(demo, monkeypatch, counted):
    chats = rows(FIRST, 8) + rows(SECOND, 8) + rows(FIRST, 4, start=8)
    expected, _ = run(demo, chats, prefix=False)
    monkeypatch.setattr(da, "EVERYWHERE", True)
    cold, engine = run(demo, chats)
    assert engine.get_cache_stats()["hit_tokens"] > 0
    assert cold == expected and counted


def test_without_a_compiler_decode_steps_keep_mlxs_attention_with_one_warning(
        monkeypatch, caplog):
    monkeypatch.setattr(da, "on_cuda", lambda: True)  # as on a CUDA machine without NVRTC
    monkeypatch.setattr(da, "_refused", [])
    da._compiled.cache_clear()

    def missing(source, name):
        raise NvrtcError("NVRTC (CUDA's runtime compiler) was not found")

    monkeypatch.setattr(da, "compile_ptx", missing)
    q, k, v = (x.astype(mx.bfloat16) for x in inputs())
    with caplog.at_level("WARNING", logger="batchrun"):
        assert not da.serves(q, k, v)
        assert not da.serves(q, k, v)
        out, _ = da.ranged_attention(q, k, v, mx.zeros((5,), mx.int32), 0.125)  # the reference
    assert out.shape == (5, 8, 1, 64)
    warnings = [r for r in caplog.records if "decode attention kernel" in r.message]
    assert len(warnings) == 1 and "NVRTC" in warnings[0].message
    da._compiled.cache_clear()


def test_a_launch_mlx_refuses_falls_back_for_the_process(monkeypatch, caplog):
    monkeypatch.setattr(da, "on_cuda", lambda: True)
    monkeypatch.setattr(da, "_refused", [])
    monkeypatch.setattr(da, "_compiled", lambda *args: ("name", b"ptx"))
    monkeypatch.setattr(da, "_verify", lambda *args: None)

    def refused(*args):
        raise ValueError("[precompiled_cuda_kernel] Invalid scalar argument type")

    monkeypatch.setattr(da, "_launch", refused)
    q, k, v = (x.astype(mx.bfloat16) for x in inputs())
    starts = mx.array([0, 3, 100, 299, 17])
    with caplog.at_level("WARNING", logger="batchrun"):
        assert da.serves(q, k, v)
        out, lse = da.ranged_attention(q, k, v, starts, 0.125, with_lse=True)
        assert not da.serves(q, k, v)  # the rest of the process: MLX's attention
    expected, _ = da.ranged_attention(q.astype(mx.float32), k.astype(mx.float32),
                                      v.astype(mx.float32), starts, 0.125, with_lse=True)
    assert mx.allclose(out, expected, atol=1e-2)
    assert sum("decode attention kernel" in r.message for r in caplog.records) == 1


def test_a_scale_float32_cannot_hold_is_rounded_for_the_launch():
    scale = 128 ** -0.5  # MLX passes a float scalar only if float32 holds it exactly
    rounded = da._as_float32(scale)
    assert rounded != scale and abs(rounded - scale) < 1e-8
    assert da._as_float32(rounded) == rounded


@pytest.mark.parametrize("broken", [False, True])
def test_a_kernel_variant_is_checked_against_the_reference_before_rows_use_it(
        monkeypatch, caplog, broken):
    monkeypatch.setattr(da, "on_cuda", lambda: True)
    monkeypatch.setattr(da, "_refused", [])
    monkeypatch.setattr(da, "_compiled", lambda *args: ("name", b"ptx"))
    da._verify.cache_clear()
    launched = []

    def launch(q, k, v, starts, scale, length, splits):  # the kernel's contract, or not
        launched.append(q.shape)
        out, lse = da.reference(q, k[..., :length, :], v[..., :length, :], starts, scale,
                                splits)
        return (out + 0.5, lse) if broken else (out, lse)

    monkeypatch.setattr(da, "_launch", launch)
    q, k, v = (x.astype(mx.bfloat16) for x in inputs())
    with caplog.at_level("WARNING", logger="batchrun"):
        assert da.serves(q, k, v) is not broken
        assert da.serves(q, k, v) is not broken
    assert len(launched) == 1  # once a variant
    warnings = [r.message for r in caplog.records if "decode attention kernel" in r.message]
    assert warnings == (["the decode attention kernel is not available (its results differ "
                         "from MLX's by 0.5 on a test input); decode steps take MLX's "
                         "attention with a mask"] if broken else [])
    da._verify.cache_clear()


@pytest.mark.skipif(sys.platform != "linux", reason="NVIDIA ships NVRTC's wheels for Linux")
@pytest.mark.parametrize("dtype,heads_per_kv", [(mx.bfloat16, (1, 4, 8)), (mx.float16, (4,)),
                                                (mx.float32, (4,))])
def test_the_kernels_source_compiles_to_ptx_with_the_launched_name(dtype, heads_per_kv):
    """No GPU here: NVRTC (from nvidia-cuda-nvrtc, a test dependency) still compiles."""
    names = set()
    for D in da.HEAD_DIMS:
        for G in heads_per_kv:
            # the ungrouped kernel (the check script's comparison) at one head size
            for grouped in (True, False) if da.HEAD_DIMS[0] == D else (True,):
                name, ptx = da._compiled(dtype, D, G, da.WARPS, grouped)
                assert ptx.endswith(b"\0")  # the driver reads PTX up to its NUL
                assert f".visible .entry {name}(".encode() in ptx
                names.add(name)
    assert len(names) == (len(da.HEAD_DIMS) + 1) * len(heads_per_kv)  # no two share a name
