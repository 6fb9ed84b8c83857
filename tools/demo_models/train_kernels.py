"""The demo trainer's forward on the CPU: packed rows and a cheaper exp (train.py).

MLX's CPU `exp`, `sigmoid` and softmax are scalar calls, about 12-16 ns an element on this
machine where a multiply is under 0.3 ns: at the trainer's lengths they took a third of a step
(attention's softmax and the MLP's SiLU). Here `exp` is built from multiplies and adds (a
power of two from the exponent's bits times a degree-6 polynomial, within 3e-7 of `mx.exp`),
and the softmax and sigmoid built on it carry their own gradients (the integer steps inside
have none that autograd could see).

A training batch packs several examples into one row (train.batches); `segment_mask` keeps each
token's attention inside its own example, so a packed row computes what the examples would
alone (RoPE depends only on the distance between two positions).
"""

from __future__ import annotations

import contextlib
import sys

import mlx.core as mx

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Below this, fast_exp is exactly 0 (the exponent's bits are all zero); masked scores land here.
MASKED = -1e9


def fast_exp(x: mx.array) -> mx.array:
    """exp(x) to within 3e-7 relative for |x| < 87; 0 below about -88 (no subnormals)."""
    y = mx.clip(x * LOG2E, -127.0, 127.0)
    n = (y + 127.5).astype(mx.int32) - 127  # round(y): y + 127.5 is positive, cast truncates
    t = (y - n.astype(mx.float32)) * LN2  # |t| <= ln2 / 2
    p = 1 + t * (1 + t * (1 / 2 + t * (1 / 6 + t * (1 / 24 + t * (1 / 120 + t / 720)))))
    return p * ((n + 127) << 23).view(mx.float32)  # 2**n from its exponent bits


@mx.custom_function
def softmax(scores: mx.array, bias: mx.array) -> mx.array:
    """softmax(scores + bias) over the last axis; `bias` is 0 or MASKED (broadcast)."""
    s = scores + bias
    e = fast_exp(s - s.max(axis=-1, keepdims=True))  # the vjp below is the gradient
    return e / e.sum(axis=-1, keepdims=True)


@softmax.vjp
def _softmax_vjp(primals, cotangent, output):
    p = output
    return p * (cotangent - (cotangent * p).sum(axis=-1, keepdims=True)), \
        mx.zeros_like(primals[1])


@mx.custom_function
def sigmoid(x: mx.array) -> mx.array:
    return 1 / (1 + fast_exp(-x))


@sigmoid.vjp
def _sigmoid_vjp(primals, cotangent, output):
    return cotangent * output * (1 - output)


@mx.custom_function
def logsumexp(x: mx.array) -> mx.array:
    """log(sum(exp(x))) over the last axis."""
    top = x.max(axis=-1)
    return top + mx.log(fast_exp(x - top[..., None]).sum(axis=-1))


@logsumexp.vjp
def _logsumexp_vjp(primals, cotangent, output):
    return cotangent[..., None] * fast_exp(primals - output[..., None])  # one primal: bare


def cross_entropy(logits: mx.array, targets: mx.array) -> mx.array:
    """Per-token cross-entropy (mlx.nn.losses.cross_entropy's, reduction "none")."""
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return logsumexp(logits) - picked


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return gate * sigmoid(gate) * x


def attention(queries, keys, values, cache, scale: float, mask, sinks=None) -> mx.array:
    """mlx-lm's attention signature, for training only: no cache, `mask` an additive array
    (segment_mask's), keys and values with fewer heads (grouped queries)."""
    if cache is not None or sinks is not None or not isinstance(mask, mx.array):
        raise ValueError("the trainer's attention takes no cache or sinks, and a mask array")
    b, heads, length, dim = queries.shape
    kv = keys.shape[1]
    q = (queries * scale).reshape(b, kv, heads // kv, length, dim)
    scores = q @ keys[:, :, None].swapaxes(-1, -2)
    weights = softmax(scores, mask[:, :, None])
    return (weights @ values[:, :, None]).reshape(b, heads, length, dim)


def segment_mask(segments: mx.array) -> mx.array:
    """(rows, 1, L, L) additive mask from (rows, L) segment ids: a token attends to the tokens
    at or before it with its own id (padding, id 0, attends to padding)."""
    length = segments.shape[1]
    same = segments[:, :, None] == segments[:, None, :]
    causal = mx.tril(mx.ones((length, length), dtype=mx.bool_))
    return mx.where(same & causal, 0.0, MASKED)[:, None]


def forward(model, ids: mx.array, mask: mx.array) -> mx.array:
    """An mlx-lm Llama model's logits with `mask` for every layer (its own forward builds a
    causal mask and takes none)."""
    inner = model.model
    h = inner.embed_tokens(ids)
    for layer in inner.layers:
        h = layer(h, mask)
    h = inner.norm(h)
    if model.args.tie_word_embeddings:
        return inner.embed_tokens.as_linear(h)
    return model.lm_head(h)


@contextlib.contextmanager
def installed(model):
    """Route the model module's attention and SwiGLU through this file's while training."""
    module = sys.modules[type(model).__module__]
    saved = module.scaled_dot_product_attention, module.swiglu
    module.scaled_dot_product_attention, module.swiglu = attention, swiglu
    try:
        yield
    finally:
        module.scaled_dot_product_attention, module.swiglu = saved

