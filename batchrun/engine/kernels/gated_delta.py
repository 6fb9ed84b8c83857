"""The gated-delta rule (Qwen3.5's recurrent layers) over a prompt, a chunk of positions at a time.

mlx-lm runs the rule one position at a time wherever its Metal kernel is not available (CUDA,
the CPU): a prompt of T tokens is T steps of small ops in every recurrent layer. Here a prompt
is cut into chunks of CHUNK positions; everything within a chunk is matrix products computed
for all chunks at once, and only the state passes from chunk to chunk (T / CHUNK steps).

The rule, per head, with state S (value width x key width), for each position t:
S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T, and y_t = S_t q_t. Within a chunk
starting from S_0, with gamma_t the product of the chunk's decays up to t, the updates
w_t = beta_t (v_t - gamma_t S_0 k_t - sum_{j<t} (gamma_t / gamma_j) (k_t . k_j) w_j) solve a unit
lower-triangular system (I + A) W = beta (V - gamma K S_0^T); then
y_t = gamma_t S_0 q_t + sum_{j<=t} (gamma_t / gamma_j) (q_t . k_j) w_j and the chunk's last state
is gamma_C S_0 + sum_j (gamma_C / gamma_j) w_j k_j^T. A is nilpotent, so
(I + A)^-1 = (I - A)(I + A^2)(I + A^4)... (log2(CHUNK) products, no sequential solve). A decay
ratio is exp of a sum of log decays over its span (`_segment_sums`), never a quotient or a
difference of two sums: a decay of 0 (mlx-lm's g underflows to 0 for a large A_log) is a log
of -inf, and resets the state as mlx-lm's rule does.

A padded position (mask False) keeps the state: its decay is 1 and its beta 0. Scalar decays
(one a head) only; a per-key decay, Metal, and one-position steps stay mlx-lm's. The routing is
per model module and only inside the engine's own forwards (host_attention.forwards()): a
user's own mlx-lm calls in the process keep mlx-lm's rule. Outputs match mlx-lm's to float32
rounding (tests).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import mlx.core as mx

from batchrun.engine.kernels import gated_delta_step, host_attention

CHUNK = 32
# False (or BATCHRUN_CHUNKED_GATED_DELTA=0): mlx-lm's rule, a position at a time.
ENABLED = os.environ.get("BATCHRUN_CHUNKED_GATED_DELTA", "1") != "0"
_installed: dict[str, Any] = {}  # module name -> mlx-lm's gated_delta_update there


def chunked(q: mx.array, k: mx.array, v: mx.array, g: mx.array | None, beta: mx.array,
            state: mx.array, mask: mx.array | None = None, chunk: int = CHUNK,
            log_g: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """mlx-lm's gated_delta_ops, by chunks. q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); g and beta
    (B, T, Hv) (or, instead of g, its log `log_g`: more precise where g underflows); state
    (B, Hv, Dv, Dk); mask (B, T), True where a position counts. Returns y (B, T, Hv, Dv) in q's
    dtype and the last state (float32)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    out_dtype = q.dtype
    if Hv // Hk > 1:
        q, k = mx.repeat(q, Hv // Hk, -2), mx.repeat(k, Hv // Hk, -2)
    f32 = mx.float32
    q, k, v = q.astype(f32), k.astype(f32), v.astype(f32)
    log_g = (mx.log(g.astype(f32)) if log_g is None else log_g.astype(f32))
    beta = beta.astype(f32)
    if mask is not None:
        keep = mask[..., None]
        log_g, beta = mx.where(keep, log_g, 0.0), mx.where(keep, beta, 0.0)
    pad = -T % chunk
    if pad:
        zeros = [(0, 0), (0, pad), (0, 0), (0, 0)]
        q, k, v = mx.pad(q, zeros), mx.pad(k, zeros), mx.pad(v, zeros)
        log_g = mx.pad(log_g, [(0, 0), (0, pad), (0, 0)])
        beta = mx.pad(beta, [(0, 0), (0, pad), (0, 0)])
    n = (T + pad) // chunk

    def split(x: mx.array) -> mx.array:  # (B, T', H, ...) -> (B, H, n, chunk, ...)
        x = x.reshape(B, n, chunk, Hv, *x.shape[3:])
        return x.transpose(0, 3, 1, 2, *range(4, x.ndim))

    q, k, v = split(q), split(k), split(v)
    steps = split(log_g)  # (B, H, n, chunk): log g_t
    beta = split(beta)
    decay = mx.exp(_segment_sums(steps))  # gamma_t / gamma_j, 0 above the diagonal
    eye = mx.eye(chunk, dtype=f32)
    a = (beta[..., None] * (k @ k.swapaxes(-1, -2)) * decay) * (1 - eye)
    inverse, power = eye - a, a
    for _ in range((chunk - 1).bit_length() - 1):
        power = power @ power
        inverse = inverse @ (eye + power)
    gamma = mx.exp(mx.cumsum(steps, axis=-1))[..., None]  # gamma_t, from the chunk's start
    w_v = inverse @ (beta[..., None] * v)  # (B, H, n, chunk, Dv)
    w_k = inverse @ (beta[..., None] * gamma * k)  # (B, H, n, chunk, Dk)
    scores = (q @ k.swapaxes(-1, -2)) * decay  # (B, H, n, chunk, chunk)
    q_decayed = gamma * q
    to_end = decay[..., -1, :, None]  # gamma_C / gamma_j
    last = gamma[..., -1:, :]  # gamma_C: (B, H, n, 1, 1)
    s = state.astype(f32)
    ys = []
    for i in range(n):
        s_t = s.swapaxes(-1, -2)  # (B, H, Dk, Dv)
        w = w_v[:, :, i] - w_k[:, :, i] @ s_t
        ys.append(q_decayed[:, :, i] @ s_t + scores[:, :, i] @ w)
        s = last[:, :, i] * s + (w * to_end[:, :, i]).swapaxes(-1, -2) @ k[:, :, i]
    y = mx.stack(ys, axis=2).reshape(B, Hv, n * chunk, Dv)[:, :, :T]
    return y.transpose(0, 2, 1, 3).astype(out_dtype), s


def _segment_sums(x: mx.array) -> mx.array:
    """(..., C) -> (..., C, C): at [t, j] the sum of x over (j, t] for j <= t, -inf above the
    diagonal; each a sum of its own terms (no difference of two running sums, which a -inf or a
    large term would turn into NaN or cancel)."""
    C = x.shape[-1]
    strictly = mx.tril(mx.ones((C, C), dtype=mx.bool_), -1)
    terms = mx.where(strictly, mx.broadcast_to(x[..., :, None], (*x.shape, C)), 0.0)
    sums = mx.cumsum(terms, axis=-2)
    return mx.where(mx.tril(mx.ones((C, C), dtype=mx.bool_)), sums, -mx.inf)


def wanted() -> bool:
    """Whether to route the rule here: prompts by chunks, or decode steps by the CUDA kernel
    (gated_delta_step.py); Metal keeps mlx-lm's kernel."""
    return (ENABLED or gated_delta_step.ENABLED) and not mx.metal.is_available()


def install(model: Any) -> bool:
    """Route the gated-delta rule of `model`'s recurrent layers through `chunked` (inside the
    engine's forwards, for prompts of more than one chunk); whether the model has such layers
    whose module calls mlx-lm's `gated_delta_update`."""

    layers = getattr(model, "layers", None) or getattr(getattr(model, "model", None),
                                                         "layers", None) or ()
    names = {type(layer.linear_attn).__module__ for layer in layers
             if getattr(layer, "linear_attn", None) is not None}
    found = False
    for name in names:
        module = sys.modules.get(name)
        original = getattr(module, "gated_delta_update", None)
        if original is None:
            continue
        found = True
        if name in _installed:
            continue
        _installed[name] = original

        def routed(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True,
                   lower_bound=None, allow_neg_eigval=False, _original=original):
            if q.shape[1] == 1 and host_attention.in_forwards() and gated_delta_step.ENABLED:
                taken = _step(q, k, v, a, b, A_log, dt_bias, state, mask, lower_bound,
                              allow_neg_eigval)
                if taken is not None:
                    return taken
            if not (ENABLED and host_attention.in_forwards() and q.shape[1] > CHUNK):
                return _original(q, k, v, a, b, A_log, dt_bias, state, mask,
                                 use_kernel=use_kernel, lower_bound=lower_bound,
                                 allow_neg_eigval=allow_neg_eigval)
            beta = mx.sigmoid(b) * (2.0 if allow_neg_eigval else 1.0)
            log_g = _log_decay(A_log, a, dt_bias, lower_bound)
            if log_g.ndim != 3:  # a per-key decay: mlx-lm's rule
                return _original(q, k, v, a, b, A_log, dt_bias, state, mask,
                                 use_kernel=use_kernel, lower_bound=lower_bound,
                                 allow_neg_eigval=allow_neg_eigval)
            if state is None:
                state = mx.zeros((q.shape[0], v.shape[-2], v.shape[-1], k.shape[-1]),
                                 dtype=mx.float32)
            return chunked(q, k, v, None, beta, state, mask, log_g=log_g)

        module.gated_delta_update = routed
    return found


def _step(q, k, v, a, b, A_log, dt_bias, state, mask, lower_bound, allow_neg_eigval):
    """A decode step through gated_delta_step's kernel, with mlx-lm's own beta and decay;
    None where the kernel does not take it."""
    from mlx_lm.models.gated_delta import compute_g, compute_lower_bound_g

    # `a` has the decay's shape: where the kernel does not take the step, g is left for
    # mlx-lm's rule to make (once)
    if not gated_delta_step.takes(q, a, state):
        return None
    g = compute_g(A_log, a, dt_bias) if lower_bound is None else \
        compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
    beta = mx.sigmoid(b) * (2.0 if allow_neg_eigval else 1.0)
    return gated_delta_step.step(q, k, v, g, beta, state, mask)


def _log_decay(A_log: mx.array, a: mx.array, dt_bias: mx.array,
               lower_bound: float | None) -> mx.array:
    """The log of mlx-lm's decay g (compute_g / compute_lower_bound_g), computed as a log:
    finite where g itself underflows to 0."""
    import mlx.nn as nn

    rate = mx.exp(A_log.astype(mx.float32))
    if lower_bound is None:
        return -rate * nn.softplus(a + dt_bias)
    return lower_bound * mx.sigmoid(rate * (a.astype(mx.float32) + dt_bias))
