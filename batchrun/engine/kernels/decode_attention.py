"""Decode attention for a continuous batch, from each row's valid key range instead of a mask.

In a continuous batch each row's keys start at its own offset (left padding, or a row that
joined late) and end at the batch's current length. mlx-lm passes that as an array mask, and
MLX 0.32's fused decode attention on CUDA takes no array mask: every step fell back to unfused
attention, ~6x slower a layer at 256 positions (BENCHMARKS.md, Decode throughput). Here a row's
range is its start (`BatchKVCache.left_padding`) and the keys' length, and on CUDA one kernel
runs split-K flash decoding over it (compiled by NVRTC, nvrtc.py, and launched through
`mx.fast.precompiled_cuda_kernel`):

- a thread block takes one (row, KV head, split of the keys): the G query heads of that KV
  head read each key and value once (GQA);
- in a warp a few lanes hold one key (16 bytes each, the queries' matching slices in
  registers), so a warp takes several keys at once; each key group's running max, sum and
  output rescale as in flash attention, and the warp merges its groups at the end (GROUPED);
- the warps of a block, then the splits (MLX ops), merge by log-sum-exp.

It returns the output and each query's log-sum-exp, which the shared-prefix attention
(shared_prefix.py) merges with the prefix's part. Elsewhere (Metal, CPU) `reference` computes
the same contract with MLX ops; the engine uses the kernel only on CUDA.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import struct
from functools import cache

import mlx.core as mx

from batchrun.engine.kernels.nvrtc import NvrtcError, compile_ptx, wait_ahead

log = logging.getLogger("batchrun")

# False (or BATCHRUN_DECODE_KERNEL=0): decode steps take MLX's attention with mlx-lm's mask.
ENABLED = os.environ.get("BATCHRUN_DECODE_KERNEL", "1") != "0"
# True: decode steps take this path on every device, through `reference` where the kernel does
# not run (tests check the path's plumbing on the CPU this way).
EVERYWHERE = False
# Head dimensions the kernel is written for (Gemma's 256: a warp's 32 lanes hold one key).
HEAD_DIMS = (64, 128, 256)
# Warps a thread block: 2 measured fastest with GROUPED at every shape checked (1,024 rows x
# 256 keys: 0.36 ms against 0.39 with 4 and 0.59 with 8; benchmarks/history/, 2026-12-03).
WARPS = 2
# How a warp's lanes share the work (a define of the kernel's source):
# - GROUPED: D / VEC lanes hold one key (VEC elements of 16 bytes each, the queries' matching
#   slices in registers): a warp takes several keys at once, scores them with a few shuffles,
#   and each key group keeps its own running max, sum and output until the warp merges them;
# - otherwise: a lane scores one key of 32 against the queries in shared memory, then each lane
#   accumulates its D / 32 dimensions over those 32 keys (the first version, kept for the
#   check script's comparison).
GROUPED = True
# Splits of the keys: enough thread blocks to fill the GPU when the batch is narrow, each
# split at least MIN_SPLIT_KEYS keys.
TARGET_BLOCKS = 1024
MIN_SPLIT_KEYS = 128
SHARED_LIMIT = 48 * 1024  # static shared memory a block may declare
# GROUPED: a lane holds VEC query and VEC output values for each of the G query heads, in
# registers; beyond 8 heads a KV head they would spill.
MAX_GROUPED_HEADS = 8

# One variant's source: self-contained (no includes), compiled by NVRTC (nvrtc.py) with these
# defines first: NAME (the kernel's name), T_KIND (the inputs' type: 0 float32, 1 float16,
# 2 bfloat16), D (head dimension), G (query heads a KV head), NW (warps a block), GROUPED
# (see above). Grid:
# (splits, kv_heads, rows) blocks of NW * 32 threads. Inputs, row-contiguous: q (rows,
# kv_heads * G, 1, D), k and v (rows, kv_heads, capacity, D) of which the first `length`
# slots are the keys, starts (rows,) int32; scalars: scale, length, capacity. Outputs: out
# (rows, kv_heads * G, splits, D) float32, each split's output normalized by its own sum; lse
# (rows, kv_heads * G, splits) float32, -inf for a split without keys.
_SOURCE = r"""
#define BR_INF __int_as_float(0x7f800000)
typedef unsigned short br_u16;
template <int KIND> struct BrType { typedef br_u16 type; };
template <> struct BrType<0> { typedef float type; };
typedef BrType<T_KIND>::type T;

template <int KIND> __device__ __forceinline__ float br_in(float x) { return x; }
template <int KIND> __device__ __forceinline__ float br_in(br_u16 x) {
  if (KIND == 2) return __uint_as_float(((unsigned)x) << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
}
template <int N> struct alignas(sizeof(T) * N) BrVec { T x[N]; };

#if GROUPED
extern "C" __global__ void NAME(const T* q, const T* k, const T* v, const int* starts,
                                float* out, float* lse, float scale, int length, int capacity) {
  // elements a lane loads at once: 16 bytes, or a 32nd of a row too long for 32 such loads
  constexpr int VEC = D * sizeof(T) > 512 ? D / 32 : 16 / sizeof(T);
  constexpr int LPK = D / VEC;                // lanes that hold one key's row
  constexpr int KPW = 32 / LPK;               // keys a warp takes at once
  constexpr int U = G <= 2 ? 8 : (G <= 4 ? 4 : 2);  // loads a lane has in flight (each way)
  constexpr int STEP = NW * KPW;              // keys the block takes at once
  static_assert(LPK <= 32 && 32 % LPK == 0, "a row must split evenly over lanes");
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int splits = gridDim.x, kv_heads = gridDim.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kg = lane / LPK, dg = lane % LPK;  // key group, 16-byte slice of the row
  const int start = starts[b];
  const int per_split = (length - start + splits - 1) / splits;
  const int lo = start + split * per_split;
  const int hi = min(length, lo + per_split);

  __shared__ float m_s[NW][G];
  __shared__ float l_s[NW][G];
  __shared__ float o_s[NW][G][D];

  // This lane's slice of the G queries, scaled, in registers.
  const T* qb = q + ((size_t)b * kv_heads * G + (size_t)kvh * G) * D + dg * VEC;
  float qr[G][VEC];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    const BrVec<VEC> qv = *reinterpret_cast<const BrVec<VEC>*>(qb + g * D);
    #pragma unroll
    for (int e = 0; e < VEC; ++e) qr[g][e] = br_in<T_KIND>(qv.x[e]) * scale;
  }

  const size_t head = ((size_t)b * kv_heads + kvh) * capacity * D + dg * VEC;
  const T* kb = k + head;
  const T* vb = v + head;

  // Each key group keeps its own running max, sum and output (flash attention's rescaling).
  float m[G], l[G], o[G][VEC];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -BR_INF;
    l[g] = 0.f;
    #pragma unroll
    for (int e = 0; e < VEC; ++e) o[g][e] = 0.f;
  }

  // `base` is the same for the whole warp (the shuffles need every lane).
  for (int base = lo + warp * KPW; base < hi; base += STEP * U) {
    BrVec<VEC> kr[U], vr[U];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int key = base + kg + u * STEP;
      if (key < hi) {
        kr[u] = *reinterpret_cast<const BrVec<VEC>*>(kb + (size_t)key * D);
        vr[u] = *reinterpret_cast<const BrVec<VEC>*>(vb + (size_t)key * D);
      } else {
        #pragma unroll
        for (int e = 0; e < VEC; ++e) kr[u].x[e] = vr[u].x[e] = T(0);
      }
    }
    float s[U][G];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      #pragma unroll
      for (int g = 0; g < G; ++g) {
        float acc = 0.f;
        #pragma unroll
        for (int e = 0; e < VEC; ++e) acc += qr[g][e] * br_in<T_KIND>(kr[u].x[e]);
        #pragma unroll
        for (int off = 1; off < LPK; off <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        s[u][g] = base + kg + u * STEP < hi ? acc : -BR_INF;
      }
    }
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      float top = m[g];
      #pragma unroll
      for (int u = 0; u < U; ++u) top = fmaxf(top, s[u][g]);
      if (top == -BR_INF) continue;  // no key of this group yet
      const float corr = expf(m[g] - top);
      l[g] *= corr;
      #pragma unroll
      for (int e = 0; e < VEC; ++e) o[g][e] *= corr;
      #pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = expf(s[u][g] - top);
        l[g] += p;
        #pragma unroll
        for (int e = 0; e < VEC; ++e) o[g][e] += p * br_in<T_KIND>(vr[u].x[e]);
      }
      m[g] = top;
    }
  }

  // Merge the warp's key groups, then its lanes of group 0 hold the warp's part.
  #pragma unroll
  for (int off = LPK; off < 32; off <<= 1) {
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      const float m_o = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float l_o = __shfl_xor_sync(0xffffffffu, l[g], off);
      const float top = fmaxf(m[g], m_o);
      const float a = m[g] == -BR_INF ? 0.f : expf(m[g] - top);
      const float c = m_o == -BR_INF ? 0.f : expf(m_o - top);
      l[g] = l[g] * a + l_o * c;
      #pragma unroll
      for (int e = 0; e < VEC; ++e)
        o[g][e] = o[g][e] * a + __shfl_xor_sync(0xffffffffu, o[g][e], off) * c;
      m[g] = top;
    }
  }
  if (kg == 0) {
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      if (dg == 0) {
        m_s[warp][g] = m[g];
        l_s[warp][g] = l[g];
      }
      #pragma unroll
      for (int e = 0; e < VEC; ++e) o_s[warp][g][dg * VEC + e] = o[g][e];
    }
  }
#else
extern "C" __global__ void NAME(const T* q, const T* k, const T* v, const int* starts,
                                float* out, float* lse, float scale, int length, int capacity) {
  constexpr int PER = D / 32;                 // output dims a lane accumulates
  constexpr int VEC = 16 / sizeof(T);         // elements of a 16-byte load
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int splits = gridDim.x, kv_heads = gridDim.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int start = starts[b];
  const int per_split = (length - start + splits - 1) / splits;
  const int lo = start + split * per_split;
  const int hi = min(length, lo + per_split);

  __shared__ float q_s[G][D];
  __shared__ float p_s[NW][G][32];
  __shared__ float m_s[NW][G];
  __shared__ float l_s[NW][G];
  __shared__ float o_s[NW][G][D];

  const T* qb = q + ((size_t)b * kv_heads * G + (size_t)kvh * G) * D;
  for (int i = threadIdx.x; i < G * D; i += NW * 32)
    q_s[i / D][i % D] = br_in<T_KIND>(qb[i]) * scale;
  __syncthreads();

  const size_t head = ((size_t)b * kv_heads + kvh) * capacity * D;
  const T* kb = k + head;
  const T* vb = v + head;

  float m[G], l[G], o[G][PER];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -BR_INF;
    l[g] = 0.f;
    #pragma unroll
    for (int e = 0; e < PER; ++e) o[g][e] = 0.f;
  }

  for (int base = lo + warp * 32; base < hi; base += NW * 32) {
    const int key = base + lane;
    float s[G];
    #pragma unroll
    for (int g = 0; g < G; ++g) s[g] = 0.f;
    if (key < hi) {
      const T* kr = kb + (size_t)key * D;
      #pragma unroll
      for (int c = 0; c < D; c += VEC) {
        const BrVec<VEC> kv = *reinterpret_cast<const BrVec<VEC>*>(kr + c);
        #pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float kf = br_in<T_KIND>(kv.x[j]);
          #pragma unroll
          for (int g = 0; g < G; ++g) s[g] += q_s[g][c + j] * kf;
        }
      }
    } else {
      #pragma unroll
      for (int g = 0; g < G; ++g) s[g] = -BR_INF;
    }
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      float top = s[g];
      #pragma unroll
      for (int off = 16; off > 0; off >>= 1)
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
      const float m_new = fmaxf(m[g], top);
      float p = 0.f, corr = 1.f;
      if (m_new != -BR_INF) {
        p = expf(s[g] - m_new);
        corr = expf(m[g] - m_new);
      }
      m[g] = m_new;
      l[g] = l[g] * corr + p;   // this lane's keys; summed over the warp at the end
      #pragma unroll
      for (int e = 0; e < PER; ++e) o[g][e] *= corr;
      p_s[warp][g][lane] = p;
    }
    __syncwarp();
    const int n = min(32, hi - base);
    #pragma unroll 4
    for (int j = 0; j < n; ++j) {
      const BrVec<PER> vv =
          *reinterpret_cast<const BrVec<PER>*>(vb + (size_t)(base + j) * D + lane * PER);
      #pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = p_s[warp][g][j];
        #pragma unroll
        for (int e = 0; e < PER; ++e) o[g][e] += p * br_in<T_KIND>(vv.x[e]);
      }
    }
    __syncwarp();
  }

  #pragma unroll
  for (int g = 0; g < G; ++g) {
    float sum = l[g];
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) {
      m_s[warp][g] = m[g];
      l_s[warp][g] = sum;
    }
    #pragma unroll
    for (int e = 0; e < PER; ++e) o_s[warp][g][lane * PER + e] = o[g][e];
  }
#endif
  __syncthreads();

  for (int i = threadIdx.x; i < G * D; i += NW * 32) {
    const int g = i / D, d = i % D;
    float top = -BR_INF;
    #pragma unroll
    for (int w = 0; w < NW; ++w) top = fmaxf(top, m_s[w][g]);
    float total = 0.f, acc = 0.f;
    if (top != -BR_INF) {
      #pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float f = expf(m_s[w][g] - top);
        total += l_s[w][g] * f;
        acc += o_s[w][g][d] * f;
      }
    }
    const size_t row = ((size_t)b * kv_heads * G + (size_t)kvh * G + g) * splits + split;
    out[row * D + d] = total > 0.f ? acc / total : 0.f;
    if (d == 0) lse[row] = total > 0.f ? top + logf(total) : -BR_INF;
  }
}
"""
_KINDS = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}
_refused: list[str] = []  # why the kernel cannot run in this process, once known


def variant_source(name: str, dtype: mx.Dtype, D: int, G: int, warps: int,
                   grouped: bool) -> str:
    defines = {"NAME": name, "T_KIND": _KINDS[dtype], "D": D, "G": G, "NW": warps,
               "GROUPED": int(grouped)}
    return "".join(f"#define {k} {v}\n" for k, v in defines.items()) + _SOURCE


@cache
def _compiled(dtype: mx.Dtype, D: int, G: int, warps: int, grouped: bool
              ) -> tuple[str, bytes]:
    """(name, PTX) of one variant; the name carries the source's hash: MLX keeps loaded
    modules by name."""
    source = variant_source("", dtype, D, G, warps, grouped)
    name = f"batchrun_ranged_decode_{hashlib.sha256(source.encode()).hexdigest()[:16]}"
    return name, compile_ptx(variant_source(name, dtype, D, G, warps, grouped), name + ".cu")


@cache
def _as_float32(x: float) -> float:
    """`x` rounded to float32: MLX passes a float scalar only if float32 holds it exactly."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _launch(queries: mx.array, keys: mx.array, values: mx.array, starts: mx.array,
            scale: float, length: int, splits: int) -> tuple[mx.array, mx.array]:
    rows, heads, _, D = queries.shape
    kv_heads = keys.shape[1]
    name, ptx = _compiled(queries.dtype, D, heads // kv_heads, WARPS, GROUPED)
    return mx.fast.precompiled_cuda_kernel(
        name=name, compiled_source=ptx, inputs=[queries, keys, values, starts],
        output_shapes=[(rows, heads, splits, D), (rows, heads, splits)],
        output_dtypes=[mx.float32, mx.float32],
        scalars=[_as_float32(scale), int(length), keys.shape[2]],
        grid=(WARPS * 32 * splits, kv_heads, rows), threadgroup=(WARPS * 32, 1, 1),
        ensure_row_contiguous=True)


def on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def wanted() -> bool:
    """Whether decode steps may take this path on this device at all."""
    return ENABLED and (EVERYWHERE or on_cuda())


def _kernel_takes(queries: mx.array, keys: mx.array) -> bool:
    """Whether the kernel runs this call: CUDA, a head dimension and dtype it was written for,
    and NVRTC compiled it (a failure is logged once, and the process keeps MLX's attention)."""
    G = queries.shape[1] // keys.shape[1]
    if not (on_cuda() and queries.shape[-1] in HEAD_DIMS and queries.dtype == keys.dtype
            and keys.dtype in _KINDS and fits(G, queries.shape[-1])) or _refused:
        return False
    try:
        wait_ahead()
        _compiled(keys.dtype, queries.shape[-1], G, WARPS, GROUPED)
        _verify(keys.dtype, queries.shape[-1], G, WARPS, GROUPED)
    except (NvrtcError, OSError, ValueError, RuntimeError) as e:
        _refuse(e)
        return False
    return True


# How far a variant's first results may be from `reference`'s, by input type.
TOLERANCE = {mx.float32: 1e-4, mx.float16: 5e-3, mx.bfloat16: 3e-2}


@cache
def _verify(dtype: mx.Dtype, D: int, G: int, warps: int, grouped: bool) -> None:
    """A variant's first call, before any row depends on it: small random inputs (two rows,
    one left-padded, two splits, keys a slice of a larger buffer) against `reference`;
    ValueError if they differ (a GPU or driver it was never run on, say)."""
    key = mx.random.key(0)
    q, k, v = (mx.random.normal(shape, key=mx.random.split(key, 3)[i]).astype(dtype)
               for i, shape in enumerate([(2, G, 1, D), (2, 1, 300, D), (2, 1, 300, D)]))
    starts = mx.array([0, 37], mx.int32)
    out, lse = _launch(q, k, v, starts, D ** -0.5, 260, 2)
    with mx.stream(mx.cpu):  # exact float32 (CUDA's float32 matmuls may round as TF32)
        expected, expected_lse = reference(q, k[..., :260, :], v[..., :260, :], starts,
                                           D ** -0.5, 2)
    error = max(mx.abs(out - expected).max().item(), mx.abs(lse - expected_lse).max().item())
    if not error <= TOLERANCE[dtype]:  # NaN fails too
        raise ValueError(f"its results differ from MLX's by {error:.3g} on a test input")


def compile_call(dtype: mx.Dtype, D: int, G: int):
    """The compile call of the variant decode steps of this shape take (None: none), to run
    ahead of the first step (nvrtc.compile_ahead)."""
    if not (ENABLED and dtype in _KINDS and dtype != mx.float32 and D in HEAD_DIMS
            and fits(G, D)):
        return None
    return lambda: _compiled(dtype, D, G, WARPS, GROUPED)


def fits(G: int, D: int) -> bool:
    """Whether a block's registers and shared memory hold G query heads of size D."""
    return shared_bytes(G, D) <= SHARED_LIMIT and (G <= MAX_GROUPED_HEADS or not GROUPED)


def shared_bytes(G: int, D: int) -> int:
    """The kernel's static shared memory (float32): m_s, l_s and o_s, and without GROUPED also
    q_s and p_s."""
    merge = 2 * WARPS * G + WARPS * G * D
    return 4 * (merge if GROUPED else merge + G * D + WARPS * G * 32)


def _refuse(error: Exception) -> None:
    _refused.append(str(error))
    log.warning("the decode attention kernel is not available (%s); decode steps take MLX's "
                "attention with a mask", error)


def serves(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    """Whether a decode step takes this path: one query a row, whole query heads per KV head,
    and the kernel on CUDA for this dtype and head dimension (EVERYWHERE: `reference`
    elsewhere)."""
    if not ENABLED or queries.shape[2] != 1 or queries.shape[1] % keys.shape[1] \
            or values.shape[-1] != queries.shape[-1]:
        return False
    return EVERYWHERE or (_kernel_takes(queries, keys) and keys.dtype != mx.float32)


def splits_for(rows: int, kv_heads: int, keys: int) -> int:
    """Splits of the keys: a narrow batch spreads a long context over more thread blocks."""
    spread = math.ceil(TARGET_BLOCKS / max(1, rows * kv_heads))
    return max(1, min(spread, keys // MIN_SPLIT_KEYS))


def ranged_attention(queries: mx.array, keys: mx.array, values: mx.array, starts: mx.array,
                     scale: float, length: int | None = None, with_lse: bool = False,
                     splits: int | None = None) -> tuple[mx.array, mx.array | None]:
    """Attention of each row's one query (rows, heads, 1, D) over its keys [starts[row],
    length) of `keys` and `values` (rows, kv_heads, capacity, D): a batch cache's buffers,
    whose first `length` slots (None: all) are filled. (output, log-sum-exp or None); with
    `with_lse` the output is float32 (it is merged further), otherwise the queries' dtype. On
    CUDA the kernel, elsewhere `reference`."""
    rows, heads, _, D = queries.shape
    kv_heads = keys.shape[1]
    length = keys.shape[2] if length is None else length
    n = splits or splits_for(rows, kv_heads, length)
    starts = starts.astype(mx.int32) if starts.dtype != mx.int32 else starts
    out = None
    if _kernel_takes(queries, keys):
        try:
            out, lse = _launch(queries, keys, values, starts, scale, length, n)
        except (ValueError, RuntimeError) as e:  # MLX refused the launch: keep MLX's path
            _refuse(e)
    if out is None:
        out, lse = reference(queries, keys[..., :length, :], values[..., :length, :], starts,
                             scale, n)
    if n > 1:
        out, lse = merge_splits(out, lse)
    else:
        out, lse = out[:, :, 0], lse[:, :, 0]
    out = out[:, :, None]
    if with_lse:
        return out, lse
    return out.astype(queries.dtype), None


def merge_splits(out: mx.array, lse: mx.array) -> tuple[mx.array, mx.array]:
    """Splits' outputs (rows, heads, splits, D) and log-sum-exps (rows, heads, splits) as one:
    (rows, heads, D) float32, (rows, heads). A split without keys has -inf and weighs 0."""
    total = mx.logsumexp(lse, axis=-1)
    weights = mx.exp(lse - mx.where(mx.isinf(total), 0.0, total)[..., None])  # no keys: 0
    return (weights[..., None] * out.astype(mx.float32)).sum(axis=2), total


def split_bounds(starts: mx.array, length: int, splits: int) -> tuple[mx.array, mx.array]:
    """Each row's keys [lo, hi) in each split, as the kernel cuts them: (rows, splits) each."""
    per = (length - starts + splits - 1) // splits  # (rows,)
    lo = starts[:, None] + mx.arange(splits)[None] * per[:, None]
    return lo, mx.minimum(lo + per[:, None], length)


def reference(queries: mx.array, keys: mx.array, values: mx.array, starts: mx.array,
              scale: float, splits: int = 1) -> tuple[mx.array, mx.array]:
    """The kernel's contract in MLX ops, float32: each split's normalized output (rows, heads,
    splits, D) and log-sum-exp (rows, heads, splits)."""
    rows, heads, _, D = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    G = heads // kv_heads
    q = (queries.astype(mx.float32) * scale).reshape(rows, kv_heads, G, D)
    scores = q @ keys.astype(mx.float32).swapaxes(-1, -2)  # (rows, kv_heads, G, length)
    lo, hi = split_bounds(starts, length, splits)
    position = mx.arange(length)
    inside = ((position >= lo[..., None]) & (position < hi[..., None]))  # (rows, splits, len)
    # (rows, kv_heads, G, splits, D) and (rows, kv_heads, G, splits)
    out, lse = attend(scores[:, :, :, None], values[:, :, None], inside[:, None, None])
    return (out.reshape(rows, heads, splits, D), lse.reshape(rows, heads, splits))


def attend(scores: mx.array, values: mx.array, mask: mx.array | None
           ) -> tuple[mx.array, mx.array]:
    """Softmax attention from float32 scores: (output, log-sum-exp of the scores); a row with
    nothing to attend gives zeros and -inf."""
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    peak = mx.max(scores, axis=-1, keepdims=True)
    peak = mx.where(mx.isinf(peak), 0.0, peak)
    weights = mx.exp(scores - peak)
    total = mx.sum(weights, axis=-1, keepdims=True)
    out = (weights @ values.astype(mx.float32)) / mx.maximum(total, 1e-30)
    return out, (peak + mx.log(total))[..., 0]
