"""The prefix part of cascade attention on CUDA: every row's queries against one shared prefix,
fused on tensor cores.

Rows under a shared prefix (shared_prefix.py) attend its keys with no mask, so the prefix part
of a step is one plain attention: all the rows' queries of a KV head against that head's
prefix keys. In MLX ops it materializes the score matrix in float32 (a labeling prefill of 870
rows x ~42 queries x 32 heads under 1,763 keys writes and reads 8 GB a layer) and on CUDA
MLX's fused attention materializes these shapes too. This kernel is flash attention for that
one case, compiled by NVRTC (nvrtc.py) and launched through `mx.fast.precompiled_cuda_kernel`:

- a thread block takes 64 queries of one KV head (16 a warp), wherever they come from: query
  m of a head is row m // width's query m % width, so the rows' queries need no gathering;
- it walks the prefix in tiles of 64 keys held in shared memory; each warp's scores come from
  `mma.sync` (half-precision inputs, float32 sums), the running max and sum as in flash
  attention, and the weights go back through `mma.sync` against the values (read transposed
  by `ldmatrix`) without leaving registers;
- it writes each query's output, normalized, and its log-sum-exp, both float32, which
  `shared_prefix.attention_with_prefix` merges with the row's own part.

The weights are rounded to the inputs' type for the second product, as flash attention does:
a half-precision model's outputs differ from the float32-score path by that rounding. Float32
models keep the MLX path. `reference` is the contract in MLX ops (tests, and the check every
compiled variant passes before a row uses it).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from functools import cache

import mlx.core as mx

from batchrun.engine.kernels.decode_attention import _as_float32, attend, on_cuda
from batchrun.engine.kernels.nvrtc import NvrtcError, compile_ptx, wait_ahead

log = logging.getLogger("batchrun")

# False (or BATCHRUN_PREFIX_KERNEL=0): the prefix part stays in MLX ops on CUDA.
ENABLED = os.environ.get("BATCHRUN_PREFIX_KERNEL", "1") != "0"
# False (or BATCHRUN_CASCADE_KERNEL=0): a prefill under one prefix keeps the prefix kernel for
# its prefix part and MLX's ops for the rest (the cascade kernel's A/B switch).
CASCADE_ENABLED = os.environ.get("BATCHRUN_CASCADE_KERNEL", "1") != "0"
# True: the prefix part takes this module on every device, through `reference` where the kernel
# does not run (tests check the plumbing on the CPU this way).
EVERYWHERE = False
HEAD_DIMS = (64, 128)
QUERIES_A_BLOCK = 64  # 4 warps of 16 queries
# Queries of a KV head a call may hold: the launch's grid counts threads (two a query) in an int.
MAX_QUERIES = 2 ** 30
# mma.sync's m16n8k16 shape for 16-bit inputs, and ldmatrix: Ampere (8.0) on.
OLDEST_ARCH = 80

# The kernels' source, self-contained (no includes), compiled by NVRTC with these defines
# first: NAME and CASCADE_NAME (the two kernels'), T_KIND (1 float16, 2 bfloat16), D (head
# dimension). Both take grids of 128-thread blocks and the softmax scale times log2(e).
# NAME, the prefix part alone: q (rows, kv_heads, width, D), k and v (kv_heads, length, D);
# out (rows, kv_heads, width, D) and lse (rows, kv_heads, width), float32 (natural log).
# CASCADE_NAME, a prefill's whole attention: queries (rows, L, heads, D), the same prefix, and
# the rows' own keys and values in their cache with its left padding; out in q's type and
# layout.
_SOURCE = r"""
#define BR_INF __int_as_float(0x7f800000)
#if T_KIND == 2
#define BR_AB "bf16"
#else
#define BR_AB "f16"
#endif
typedef unsigned short br_u16;
typedef unsigned int br_u32;
struct alignas(16) BrV16 { br_u32 x[4]; };

// Two floats as one register of two 16-bit values, `lo` in the low half (the lower index).
__device__ __forceinline__ br_u32 br_pack(float lo, float hi) {
  br_u32 r;
#if T_KIND == 2
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

// c (16x8, float32) += a (16x16, row-major) * b (16x8, column-major), one warp.
__device__ __forceinline__ void br_mma(float* c, const br_u32* a, br_u32 b0, br_u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32." BR_AB "." BR_AB ".f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 tiles of 16-bit values from shared memory, transposed: lane L gives the address of
// row L % 8 of tile L / 8.
__device__ __forceinline__ void br_ldmatrix_t(br_u32* r, const br_u16* row) {
  unsigned address;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
      : "=r"(address) : "l"(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address) : "memory");
}

constexpr int BR_BN = 64;        // keys a tile
constexpr int BR_KS = D + 8;     // a key's stride in shared memory: conflict-free reads
constexpr int BR_NT = BR_BN / 8; // score tiles (8 keys each) a tile of keys
constexpr int BR_KD = D / 16;    // steps of 16 along the head dimension
constexpr int BR_DT = D / 8;     // output tiles (8 dimensions each)

// Flash attention's running state for a thread's two query rows (g and g + 8 of its warp's
// 16): the output fragments, and each row's running max (log2 units) and sum.
struct BrState {
  float o[BR_DT][4];
  float top[2];
  float sum[2];
};

// Attends keys [begin, end) of kb / vb (key j at kb + j * D) into `st`, key j counting for
// the thread's row r only if j <= lim[r]. Every thread of the block calls it with the same
// begin and end (it synchronizes the block for each tile).
__device__ __forceinline__ void br_keys(BrState& st, const br_u32 (&qa)[BR_KD][4],
                                        const br_u16* kb, const br_u16* vb, int begin, int end,
                                        const int (&lim)[2], float scale_log2,
                                        br_u16* k_s, br_u16* v_s) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int base = begin; base < end; base += BR_BN) {
    __syncthreads();  // the previous tile is read
    for (int i = threadIdx.x; i < BR_BN * D / 8; i += 128) {
      const int key = i / (D / 8), c = (i % (D / 8)) * 8;
      BrV16 kv = {{0u, 0u, 0u, 0u}}, vv = {{0u, 0u, 0u, 0u}};
      if (base + key < end) {
        kv = *reinterpret_cast<const BrV16*>(kb + (size_t)(base + key) * D + c);
        vv = *reinterpret_cast<const BrV16*>(vb + (size_t)(base + key) * D + c);
      }
      *reinterpret_cast<BrV16*>(k_s + key * BR_KS + c) = kv;
      *reinterpret_cast<BrV16*>(v_s + key * BR_KS + c) = vv;
    }
    __syncthreads();

    // Scores: s[n] holds keys n*8 + 2t, +1 of rows g (0, 1) and g + 8 (2, 3).
    float s[BR_NT][4];
    #pragma unroll
    for (int n = 0; n < BR_NT; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
      const br_u16* kr = k_s + (n * 8 + g) * BR_KS + 2 * t;
      #pragma unroll
      for (int ks = 0; ks < BR_KD; ++ks)
        br_mma(s[n], qa[ks], *reinterpret_cast<const br_u32*>(kr + ks * 16),
               *reinterpret_cast<const br_u32*>(kr + ks * 16 + 8));
    }
    float next[2] = {st.top[0], st.top[1]};
    #pragma unroll
    for (int n = 0; n < BR_NT; ++n) {
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = base + n * 8 + 2 * t + (i & 1);
        const float x = j < end && j <= lim[i >> 1] ? s[n][i] * scale_log2 : -BR_INF;
        s[n][i] = x;
        next[i >> 1] = fmaxf(next[i >> 1], x);
      }
    }
    float corr[2], base2[2];
    #pragma unroll
    for (int r = 0; r < 2; ++r) {  // a row's four threads share its max
      next[r] = fmaxf(next[r], __shfl_xor_sync(0xffffffffu, next[r], 1));
      next[r] = fmaxf(next[r], __shfl_xor_sync(0xffffffffu, next[r], 2));
      // A row with no key so far keeps its max at -inf; the exponentials then subtract 0
      // instead (all of them are 0), so that -inf - -inf makes no NaN.
      base2[r] = next[r] == -BR_INF ? 0.f : next[r];
      corr[r] = exp2f(st.top[r] - base2[r]);
      st.top[r] = next[r];
      st.sum[r] *= corr[r];
    }
    #pragma unroll
    for (int d = 0; d < BR_DT; ++d) {
      st.o[d][0] *= corr[0]; st.o[d][1] *= corr[0];
      st.o[d][2] *= corr[1]; st.o[d][3] *= corr[1];
    }
    #pragma unroll
    for (int n = 0; n < BR_NT; ++n) {
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float p = exp2f(s[n][i] - base2[i >> 1]);
        s[n][i] = p;
        st.sum[i >> 1] += p;
      }
    }
    // Weights times values: the score tiles of 16 keys are the next product's A fragments.
    #pragma unroll
    for (int kk = 0; kk < BR_BN / 16; ++kk) {
      const br_u32 pa[4] = {br_pack(s[2 * kk][0], s[2 * kk][1]),
                            br_pack(s[2 * kk][2], s[2 * kk][3]),
                            br_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                            br_pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      #pragma unroll
      for (int d = 0; d < BR_DT; d += 2) {
        br_u32 b[4];
        br_ldmatrix_t(b, v_s + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * BR_KS
                             + (d + (lane >> 4)) * 8);
        br_mma(st.o[d], pa, b[0], b[1]);
        br_mma(st.o[d + 1], pa, b[2], b[3]);
      }
    }
  }
}

// A thread's query fragments for its two rows at offsets at[r] of q (zeros where !valid[r]).
__device__ __forceinline__ void br_queries(br_u32 (&qa)[BR_KD][4], const br_u16* q,
                                           const size_t (&at)[2], const bool (&valid)[2]) {
  const int t = threadIdx.x & 3;
  #pragma unroll
  for (int ks = 0; ks < BR_KD; ++ks) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = i & 1, col = ks * 16 + (i >> 1) * 8 + 2 * t;
      qa[ks][i] = valid[r] ? *reinterpret_cast<const br_u32*>(q + at[r] + col) : 0u;
    }
  }
}

__device__ __forceinline__ void br_start(BrState& st) {
  #pragma unroll
  for (int d = 0; d < BR_DT; ++d) st.o[d][0] = st.o[d][1] = st.o[d][2] = st.o[d][3] = 0.f;
  st.top[0] = st.top[1] = -BR_INF;
  st.sum[0] = st.sum[1] = 0.f;
}

// A fresh state that has attended KV head kvh's prefix (k, v: (kv_heads, length, D)), every
// key of it.
__device__ __forceinline__ void br_prefix(BrState& st, const br_u32 (&qa)[BR_KD][4],
                                          const br_u16* k, const br_u16* v, int kvh, int length,
                                          float scale_log2, br_u16* k_s, br_u16* v_s) {
  br_start(st);
  const int all[2] = {length, length};
  br_keys(st, qa, k + (size_t)kvh * length * D, v + (size_t)kvh * length * D, 0, length, all,
          scale_log2, k_s, v_s);
}

// The row sums, whole across each row's four threads.
__device__ __forceinline__ void br_finish(BrState& st) {
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    st.sum[r] += __shfl_xor_sync(0xffffffffu, st.sum[r], 1);
    st.sum[r] += __shfl_xor_sync(0xffffffffu, st.sum[r], 2);
  }
}

// The prefix part alone. Grid: (blocks of 64 queries, kv_heads); query m of a KV head is row
// m / width's query m % width. Outputs float32: out normalized, lse (natural log).
extern "C" __global__ void __launch_bounds__(128)
NAME(const br_u16* q, const br_u16* k, const br_u16* v, float* out, float* lse,
     float scale_log2, int width, int total, int length) {
  __shared__ __align__(16) br_u16 k_s[BR_BN * BR_KS];
  __shared__ __align__(16) br_u16 v_s[BR_BN * BR_KS];
  const int kvh = blockIdx.y, kv_heads = gridDim.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  int m[2];
  size_t at[2];
  bool valid[2];
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    m[r] = blockIdx.x * 64 + warp * 16 + g + 8 * r;
    const int row = m[r] / width, w = m[r] % width;
    at[r] = (((size_t)row * kv_heads + kvh) * width + w) * D;
    valid[r] = m[r] < total;
  }
  br_u32 qa[BR_KD][4];
  br_queries(qa, q, at, valid);
  BrState st;
  br_prefix(st, qa, k, v, kvh, length, scale_log2, k_s, v_s);
  br_finish(st);
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!valid[r]) continue;
    float* row = out + at[r] + 2 * t;
    #pragma unroll
    for (int d = 0; d < BR_DT; ++d)
      *reinterpret_cast<float2*>(row + d * 8) =
          make_float2(st.o[d][2 * r] / st.sum[r], st.o[d][2 * r + 1] / st.sum[r]);
    if (t == 0) lse[at[r] / D] = (st.top[r] + log2f(st.sum[r])) * 0.69314718055994531f;
  }
}

// A prefill's whole attention for rows under one shared prefix: the prefix's keys, then each
// row's own keys in its cache (ok, ov: (rows, kv_heads, stride, D), the row's keys from
// pad[row] to used), causal, in one pass. Grid: (rows * tiles, kv_heads), tiles = the blocks
// of 64 a row's width (query heads a KV head x L queries) takes; query m of a row is query
// m % L of its KV head's query head m / L, at key position used - L + m % L. Queries and
// output are (rows, L, heads, D), the layout a model's projections give and take; the output
// in the queries' type.
extern "C" __global__ void __launch_bounds__(128)
CASCADE_NAME(const br_u16* q, const br_u16* k, const br_u16* v, const br_u16* ok,
             const br_u16* ov, const int* pad, br_u16* out, float scale_log2, int width,
             int L, int length, int stride, int used) {
  __shared__ __align__(16) br_u16 k_s[BR_BN * BR_KS];
  __shared__ __align__(16) br_u16 v_s[BR_BN * BR_KS];
  const int kvh = blockIdx.y, kv_heads = gridDim.y;
  const int tiles = (width + 63) / 64;
  const int row = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  size_t at[2];
  bool valid[2];
  int lim[2];
  const int group = width / L, heads = kv_heads * group;
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int m = tile * 64 + warp * 16 + g + 8 * r;
    at[r] = (((size_t)row * L + m % L) * heads + kvh * group + m / L) * D;
    valid[r] = m < width;
    lim[r] = used - L + m % L;
  }
  br_u32 qa[BR_KD][4];
  br_queries(qa, q, at, valid);
  BrState st;
  br_prefix(st, qa, k, v, kvh, length, scale_log2, k_s, v_s);
  const size_t own = ((size_t)row * kv_heads + kvh) * stride * D;
  br_keys(st, qa, ok + own, ov + own, pad[row], used, lim, scale_log2, k_s, v_s);
  br_finish(st);
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!valid[r]) continue;
    br_u16* dst = out + at[r] + 2 * t;
    #pragma unroll
    for (int d = 0; d < BR_DT; ++d)
      *reinterpret_cast<br_u32*>(dst + d * 8) =
          br_pack(st.o[d][2 * r] / st.sum[r], st.o[d][2 * r + 1] / st.sum[r]);
  }
}
"""
_KINDS = {mx.float16: 1, mx.bfloat16: 2}
_refused: list[str] = []  # why the kernel cannot run in this process, once known
_cascade_refused: list[str] = []  # why the cascade kernel alone cannot run, once known
CASCADE = "_cascade"  # the cascade kernel's name is the variant's with this added


def variant_source(name: str, dtype: mx.Dtype, D: int) -> str:
    defines = {"NAME": name, "CASCADE_NAME": name + CASCADE, "T_KIND": _KINDS[dtype], "D": D}
    return "".join(f"#define {k} {v}\n" for k, v in defines.items()) + _SOURCE


@cache
def _compiled(dtype: mx.Dtype, D: int) -> tuple[str, bytes]:
    """(name, PTX) of one variant (both kernels); the name carries the source's hash (MLX
    keeps loaded modules by name)."""
    source = variant_source("", dtype, D)
    name = f"batchrun_prefix_attention_{hashlib.sha256(source.encode()).hexdigest()[:16]}"
    return name, compile_ptx(variant_source(name, dtype, D), name + ".cu", OLDEST_ARCH)


def _launch(q: mx.array, keys: mx.array, values: mx.array, scale: float
            ) -> tuple[mx.array, mx.array]:
    rows, kv_heads, width, D = q.shape
    total = rows * width
    name, ptx = _compiled(q.dtype, D)
    blocks = math.ceil(total / QUERIES_A_BLOCK)
    return mx.fast.precompiled_cuda_kernel(
        name=name, compiled_source=ptx, inputs=[q, keys, values],
        output_shapes=[(rows, kv_heads, width, D), (rows, kv_heads, width)],
        output_dtypes=[mx.float32, mx.float32],
        scalars=[_as_float32(scale * math.log2(math.e)), width, total, keys.shape[2]],
        grid=(blocks * 128, kv_heads, 1), threadgroup=(128, 1, 1),
        ensure_row_contiguous=True)


def _launch_cascade(queries: mx.array, own_keys: mx.array, own_values: mx.array,
                    pad: mx.array, used: int, keys: mx.array, values: mx.array, scale: float
                    ) -> mx.array:
    B, n_heads, L, D = queries.shape
    kv_heads = keys.shape[1]
    width = n_heads // kv_heads * L
    name, ptx = _compiled(queries.dtype, D)
    tiles = math.ceil(width / QUERIES_A_BLOCK)
    out = mx.fast.precompiled_cuda_kernel(
        name=name + CASCADE, compiled_source=ptx,
        inputs=[queries.transpose(0, 2, 1, 3), keys, values, own_keys, own_values,
                pad.astype(mx.int32)],
        output_shapes=[(B, L, n_heads, D)], output_dtypes=[queries.dtype],
        scalars=[_as_float32(scale * math.log2(math.e)), width, L, keys.shape[2],
                 own_keys.shape[2], used],
        grid=(B * tiles * 128, kv_heads, 1), threadgroup=(128, 1, 1),
        ensure_row_contiguous=True)[0]
    # A model's queries come (rows, L, heads, D) in memory, transposed to (rows, heads, L, D):
    # read that way they need no copy, and the output goes back the way the model's output
    # projection reads it (mlx-lm: transposed to (rows, L, heads, D), then flattened).
    return out.transpose(0, 2, 1, 3)


# How far a variant's first results may be from `reference`'s, by input type (the weights are
# rounded to it for the second product).
TOLERANCE = {mx.float16: 5e-3, mx.bfloat16: 3e-2}


@cache
def _verify(dtype: mx.Dtype, D: int) -> None:
    """A variant's first call, before any row depends on it: small random inputs (a width that
    does not fill the last block, a length that does not fill the last tile) against
    `reference`; ValueError if they differ (a GPU or driver it was never run on, say)."""
    key = mx.random.key(0)
    parts = mx.random.split(key, 3)
    q = mx.random.normal((3, 2, 37, D), key=parts[0]).astype(dtype)
    k = mx.random.normal((1, 2, 150, D), key=parts[1]).astype(dtype)
    v = mx.random.normal((1, 2, 150, D), key=parts[2]).astype(dtype)
    out, lse = _launch(q, k, v, D ** -0.5)
    with mx.stream(mx.cpu):  # exact float32 (CUDA's float32 matmuls may round as TF32)
        expected, expected_lse = reference(q, k, v, D ** -0.5)
    _check_close(max(mx.abs(out - expected).max().item(),
                     mx.abs(lse - expected_lse).max().item()), dtype)


@cache
def _verify_cascade(dtype: mx.Dtype, D: int) -> None:
    """The cascade kernel's first call, as `_verify`: two blocks a row, a prefix length that
    does not fill its last tile, rows with no left padding, some, and more than where their
    new tokens start (padding queries, which see the prefix only)."""
    parts = mx.random.split(mx.random.key(1), 5)
    k = mx.random.normal((1, 2, 150, D), key=parts[0]).astype(dtype)
    v = mx.random.normal((1, 2, 150, D), key=parts[1]).astype(dtype)
    # Two query heads a KV head, laid out as a model's queries are (no copy for the kernel: a
    # copy's first use cost ~0.1 s on the H200: benchmarks/history/scripts/first_use_profile.py).
    queries = mx.random.normal((3, 37, 4, D), key=parts[2]).astype(dtype).transpose(0, 2, 1, 3)
    own_k = mx.random.normal((3, 2, 64, D), key=parts[3]).astype(dtype)
    own_v = mx.random.normal((3, 2, 64, D), key=parts[4]).astype(dtype)
    pad = mx.array([0, 7, 20])  # the 37 new tokens start at 13
    whole = _launch_cascade(queries, own_k, own_v, pad, 50, k, v, D ** -0.5)
    with mx.stream(mx.cpu):
        expected = cascade_reference(queries, own_k, own_v, pad, 50, k, v, D ** -0.5,
                                     mx.float32)
    _check_close(mx.abs(whole.astype(mx.float32) - expected).max().item(), dtype)


def _check_close(error: float, dtype: mx.Dtype) -> None:
    """A check's largest difference from the reference, within TOLERANCE or ValueError."""
    if not error <= TOLERANCE[dtype]:  # NaN fails too
        raise ValueError(f"its results differ from MLX's by {error:.3g} on a test input")


def _refuse(error: Exception) -> None:
    _refused.append(str(error))
    log.warning("the shared-prefix attention kernel is not available (%s); the prefix part "
                "of attention takes MLX's ops", error)


def _refuse_cascade(error: Exception) -> None:
    _cascade_refused.append(str(error))
    log.warning("the shared-prefix prefill kernel is not available (%s); prefills under a "
                "shared prefix take the prefix kernel and MLX's ops", error)


def _cascade_takes(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    """Whether the cascade kernel runs this call: the prefix kernel would (same module), and
    its own check passed. A cascade failure leaves the prefix kernel serving."""
    if _cascade_refused or not _kernel_takes(queries, keys, values):
        return False
    try:
        _verify_cascade(queries.dtype, queries.shape[-1])
    except (ValueError, RuntimeError) as e:
        _refuse_cascade(e)
        return False
    return True


def _kernel_takes(q: mx.array, keys: mx.array, values: mx.array) -> bool:
    """Whether the kernel runs this call: CUDA, a half-precision type and head dimension it was
    written for, and NVRTC compiled it and its check passed (a failure is logged once, and
    the process keeps MLX's ops)."""
    if _refused or not on_cuda() or q.dtype not in _KINDS or keys.dtype != q.dtype \
            or values.dtype != q.dtype or q.shape[-1] not in HEAD_DIMS:
        return False
    try:
        wait_ahead()
        _compiled(q.dtype, q.shape[-1])
        _verify(q.dtype, q.shape[-1])
    except (NvrtcError, OSError, ValueError, RuntimeError) as e:
        _refuse(e)
        return False
    return True


def compile_call(dtype: mx.Dtype, D: int):
    """The compile call of the variant prefix parts of this shape take (None: none), to run
    ahead of the first one (nvrtc.compile_ahead)."""
    if not (ENABLED and dtype in _KINDS and D in HEAD_DIMS):
        return None
    return lambda: _compiled(dtype, D)


def serves(q: mx.array, keys: mx.array, values: mx.array) -> bool:
    """Whether the prefix part of this call takes this path: keys to attend, values the size
    of the keys, and the kernel on CUDA for this dtype and head dimension (EVERYWHERE:
    `reference` elsewhere)."""
    if not ENABLED or keys.shape[2] == 0 or values.shape[-1] != q.shape[-1] \
            or q.shape[0] * q.shape[2] >= MAX_QUERIES:
        return False
    return EVERYWHERE or _kernel_takes(q, keys, values)


def prefix_attention(q: mx.array, keys: mx.array, values: mx.array, scale: float
                     ) -> tuple[mx.array, mx.array] | None:
    """Every row's queries q (rows, kv_heads, width, D), unscaled, against one prefix's keys
    and values (1, kv_heads, length, D), with no mask: (output (rows, kv_heads, width, D),
    log-sum-exp (rows, kv_heads, width)), float32. The kernel on CUDA (EVERYWHERE: `reference`
    where it does not run); None when MLX refused its launch (logged once): the caller's MLX
    ops then bound their score matrix, which `reference` does not."""
    if _kernel_takes(q, keys, values):
        try:
            return _launch(q, keys, values, scale)
        except (ValueError, RuntimeError) as e:  # MLX refused the launch: keep MLX's ops
            _refuse(e)
            return None
    return reference(q, keys, values, scale) if EVERYWHERE else None


def reference(q: mx.array, keys: mx.array, values: mx.array, scale: float
              ) -> tuple[mx.array, mx.array]:
    """The kernel's contract in MLX ops, float32 throughout."""
    rows, kv_heads, width, D = q.shape
    flat = (q.astype(mx.float32) * scale).transpose(1, 0, 2, 3).reshape(kv_heads, -1, D)
    scores = flat @ keys[0].astype(mx.float32).swapaxes(-1, -2)  # (kv_heads, rows*width, length)
    out, lse = attend(scores, values[0], None)
    return (out.reshape(kv_heads, rows, width, -1).transpose(1, 0, 2, 3),
            lse.reshape(kv_heads, rows, width).transpose(1, 0, 2))


def serves_cascade(queries: mx.array, own_keys: mx.array, keys: mx.array,
                   values: mx.array) -> bool:
    """Whether a prefill's whole attention (`cascade_attention`) takes this path: more than one
    query a row (decode steps keep the prefix part apart: a block a row would read the prefix
    once a row), keys to attend, the rows' own keys of the queries' type, and the kernel on
    CUDA (EVERYWHERE: `cascade_reference` elsewhere)."""
    B, n_heads, L, D = queries.shape
    if not (ENABLED and CASCADE_ENABLED) or L < 2 or keys.shape[2] == 0 or values.shape[-1] != D \
            or own_keys.dtype != queries.dtype or own_keys.shape[-1] != D \
            or B * math.ceil(n_heads // keys.shape[1] * L / QUERIES_A_BLOCK) * 128 >= 2 ** 31:
        return False  # (the last: the launch's grid counts threads in an int)
    return EVERYWHERE or _cascade_takes(queries, keys, values)


def cascade_attention(queries: mx.array, own_keys: mx.array, own_values: mx.array,
                      pad: mx.array, used: int, keys: mx.array, values: mx.array,
                      scale: float) -> mx.array | None:
    """A prefill's attention for rows that all start with one shared prefix, in one kernel:
    queries (B, n_heads, L, D), unscaled, against the prefix's keys and values (1, kv_heads,
    length, D), then against each row's own keys and values (B, kv_heads, stride, D; row b's
    are positions pad[b] to `used`, the L queries the last L of them), causal. Output in the
    queries' type and shape; the weights are rounded to that type for the second product, as
    the prefix kernel's are. The kernel on CUDA (EVERYWHERE: `cascade_reference`); None when
    MLX refused its launch (logged once): the caller takes its parts apart."""
    if _cascade_takes(queries, keys, values):
        try:
            return _launch_cascade(queries, own_keys, own_values, pad, used, keys, values,
                                   scale)
        except (ValueError, RuntimeError) as e:
            _refuse_cascade(e)
            return None
    if not EVERYWHERE:
        return None
    return cascade_reference(queries, own_keys, own_values, pad, used, keys, values, scale)


def cascade_reference(queries: mx.array, own_keys: mx.array, own_values: mx.array,
                      pad: mx.array, used: int, keys: mx.array, values: mx.array,
                      scale: float, dtype: mx.Dtype | None = None) -> mx.array:
    """`cascade_attention`'s contract in MLX ops: float32 throughout, the result cast to
    `dtype` (by default the queries')."""
    B, n_heads, L, D = queries.shape
    kv_heads = keys.shape[1]
    width = n_heads // kv_heads * L
    q = (queries.astype(mx.float32) * scale).reshape(B, kv_heads, width, D)
    prefix = q @ keys.astype(mx.float32).swapaxes(-1, -2)  # (B, kv_heads, width, length)
    own = q @ own_keys[:, :, :used].astype(mx.float32).swapaxes(-1, -2)
    key = mx.arange(used)
    last = used - L + mx.arange(width) % L  # each query's own position
    seen = (key >= pad.reshape(B, 1, 1, 1)) & (key <= last[:, None])
    scores = mx.concatenate([prefix, mx.where(seen, own, -mx.inf)], axis=-1)
    both = mx.concatenate([mx.broadcast_to(values, (B,) + values.shape[1:]),
                           own_values[:, :, :used]], axis=2).astype(mx.float32)
    out = mx.softmax(scores, axis=-1) @ both
    return out.reshape(B, n_heads, L, D).astype(dtype or queries.dtype)
