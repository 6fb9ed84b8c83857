"""One decode step of the gated-delta rule (Qwen3.5's recurrent layers) on CUDA, in one kernel.

Off Metal, mlx-lm's step is five whole-state ops (decay, the key's read-out, the update, the
query's read-out, each through a temporary of the state's size): a row's state of every
recurrent layer (heads x value width x key width, float32: 1 MiB a layer for Qwen3.5's 2B
shape) is read and written about ten times a step, which at a batch of hundreds of rows is most
of a decode step. Here a warp takes one value row of one head of one row: it reads that row of
the state once, updates it in registers, writes it once, and reduces the two dot products with
warp shuffles. Results equal mlx-lm's to float32 rounding (the sums' order differs); the first
call checks a test input against mlx-lm's rule and, on any difference, failure to compile or
launch, the process keeps mlx-lm's rule (said once).
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import cache

import mlx.core as mx

from batchrun.engine.kernels.decode_attention import on_cuda
from batchrun.engine.kernels.nvrtc import NvrtcError, compile_ptx

log = logging.getLogger("batchrun")

ENABLED = os.environ.get("BATCHRUN_GATED_DELTA_KERNEL", "1") != "0"
WARPS = 4  # value rows a block
MAX_KEY_WIDTH = 256  # a lane holds key width / 32 state values in registers
_refused: list[str] = []

# Defines first: NAME, DK (key width, a multiple of 32). Grid: (ceil(DV / NW) blocks of NW warps,
# heads, rows). Inputs, row-contiguous float32 except the mask: q, k (rows, heads, DK) (query
# already scaled), v (rows, heads, DV), g, beta (rows, heads), state (rows, heads, DV, DK), mask
# (rows,) int32 (0: the row's state is kept). Outputs: y (rows, heads, DV), the new state.
_SOURCE = r"""
extern "C" __global__ void NAME(const float* q, const float* k, const float* v, const float* g,
                                const float* beta, const float* state, const int* mask,
                                float* y, float* state_out, int DV) {
  constexpr int PER = DK / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * NW + warp;
  if (row >= DV) return;
  const int heads = gridDim.y;
  const long bh = (long)blockIdx.z * heads + blockIdx.y;
  const float* qh = q + bh * DK;
  const float* kh = k + bh * DK;
  const float* s = state + (bh * DV + row) * DK;
  float* out = state_out + (bh * DV + row) * DK;
  const float decay = g[bh], b = beta[bh];
  float st[PER], kk[PER];
  float read = 0.f;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    st[j] = s[lane + 32 * j] * decay;
    kk[j] = kh[lane + 32 * j];
    read += st[j] * kk[j];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) read += __shfl_xor_sync(0xffffffffu, read, o);
  const float delta = (v[bh * DV + row] - read) * b;
  const bool keep = mask[blockIdx.z] != 0;
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const float n = st[j] + kk[j] * delta;
    acc += n * qh[lane + 32 * j];
    out[lane + 32 * j] = keep ? n : s[lane + 32 * j];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) y[bh * DV + row] = acc;
}
"""


@cache
def _compiled(DK: int) -> tuple[str, bytes]:
    """(name, PTX); the name carries the source's hash: MLX keeps loaded modules by name."""
    body = f"#define DK {DK}\n#define NW {WARPS}\n" + _SOURCE
    name = f"batchrun_gated_delta_step_{hashlib.sha256(body.encode()).hexdigest()[:16]}"
    return name, compile_ptx(f"#define NAME {name}\n" + body, name + ".cu")


def _launch(q, k, v, g, beta, state, mask) -> tuple[mx.array, mx.array]:
    B, H, DV, DK = state.shape
    name, ptx = _compiled(DK)
    blocks = -(-DV // WARPS)
    return mx.fast.precompiled_cuda_kernel(
        name=name, compiled_source=ptx, inputs=[q, k, v, g, beta, state, mask],
        output_shapes=[(B, H, DV), (B, H, DV, DK)], output_dtypes=[mx.float32, mx.float32],
        scalars=[DV], grid=(blocks * WARPS * 32, H, B), threadgroup=(WARPS * 32, 1, 1),
        ensure_row_contiguous=True)


def step(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
         state: mx.array, mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """mlx-lm's gated_delta_ops for one position: q, k (B, 1, Hk, Dk); v (B, 1, Hv, Dv); g and
    beta (B, 1, Hv); state (B, Hv, Dv, Dk) float32; mask (B, 1) or None. Returns y (B, 1, Hv,
    Dv) float32 and the new state."""
    B, _, Hk, DK = q.shape
    Hv = v.shape[-2]
    f32 = mx.float32
    if Hv // Hk > 1:
        q, k = mx.repeat(q, Hv // Hk, -2), mx.repeat(k, Hv // Hk, -2)
    keep = mx.ones((B,), mx.int32) if mask is None else mask.reshape(B).astype(mx.int32)
    y, new = _launch(q[:, 0].astype(f32), k[:, 0].astype(f32), v[:, 0].astype(f32),
                     g[:, 0].astype(f32), beta[:, 0].astype(f32), state.astype(f32), keep)
    return y[:, None], new


def takes(q: mx.array, decay: mx.array, state: mx.array | None) -> bool:
    """Whether this step runs the kernel: CUDA, one position, a decay a head (`decay`: g, or
    an array of its shape), a key width it holds, a state given, and the kernel compiled and
    checked in this process."""
    if not (ENABLED and not _refused and on_cuda() and q.shape[1] == 1 and decay.ndim == 3
            and state is not None and q.shape[-1] % 32 == 0 and q.shape[-1] <= MAX_KEY_WIDTH):
        return False
    try:
        _verify(q.shape[-1])
    except (NvrtcError, OSError, ValueError, RuntimeError) as e:
        _refused.append(str(e))
        log.warning("the gated-delta step kernel is off for this process (%s); mlx-lm's rule "
                    "runs instead", str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
        return False
    return True


@cache
def _verify(DK: int) -> None:
    """The kernel's first call against mlx-lm's rule (exact float32 on the CPU), on random
    inputs with grouped heads and a masked row; ValueError if they differ."""
    from mlx_lm.models.gated_delta import gated_delta_ops

    keys = mx.random.split(mx.random.key(0), 6)
    B, Hk, Hv, DV = 3, 2, 4, 48
    q = mx.random.normal((B, 1, Hk, DK), key=keys[0]) * DK ** -0.5
    k = mx.random.normal((B, 1, Hk, DK), key=keys[1]) * DK ** -0.5
    v = mx.random.normal((B, 1, Hv, DV), key=keys[2])
    g = mx.random.uniform(0.5, 1.0, (B, 1, Hv), key=keys[3])
    beta = mx.random.uniform(0.0, 1.0, (B, 1, Hv), key=keys[4])
    state = mx.random.normal((B, Hv, DV, DK), key=keys[5])
    mask = mx.array([[True], [False], [True]])
    y, new = step(q, k, v, g, beta, state, mask)
    with mx.stream(mx.cpu):
        y_ref, new_ref = gated_delta_ops(q, k, v, g, beta, state, mask)
    error = max(mx.abs(y - y_ref).max().item(), mx.abs(new - new_ref).max().item())
    if not error <= 1e-4:  # NaN fails too
        raise ValueError(f"its results differ from mlx-lm's by {error:.3g} on a test input")
