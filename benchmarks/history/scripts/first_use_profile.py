"""What a process's first use of each attention path costs, against its second use, on the
model's real forward (no engine, no job): prints one JSON line a stage.

    python scripts/first_use_profile.py --model PATH [--order cascade|plain|ops] [--prefix N]

Stages (each timed to the GPU's end, its first call and then the same shapes again):
- kernels: compiling batchrun's two attention kernels (as the engine does ahead);
- plain-prefill / plain-decode: two rows with no shared prefix (MLX's fused attention);
- tail-prefill / tail-decode: one row of 35 tokens under a shared prefix (cascade attention);
- wide-prefill / wide-decode: 510 rows of 45 tokens under it;
- op:NAME (--order ops, before any forward): each op of one layer's cascade attention alone;
- call:NAME (--watch): from the second path on, the first two calls of each layer, of layer
  0's parts and of the attention function, each evaluated.
--order says which path meets the process first; run it after a throwaway run of the same
command, so MLX's compiled kernels come from its disk cache as in a warm job.
"""

import argparse
import json
import time

import batchrun  # noqa: F401  (BLAS routing before MLX)

# isort: split
import mlx.core as mx

from batchrun.engine import decode_attention, nvrtc, prefix_attention, shared_prefix
from batchrun.engine.shared_prefix import SharedPrefix, SharedPrefixBatchCache


def timed(fn):
    mx.synchronize()
    start = time.perf_counter()
    out = fn()
    mx.eval(out)
    mx.synchronize()
    return time.perf_counter() - start


def report(stage: str, first: float, again: float) -> None:
    print(json.dumps({"stage": stage, "first_ms": round(first * 1e3, 2),
                      "again_ms": round(again * 1e3, 2)}), flush=True)


def forward(model, layers: int, prefix, rows: int, length: int):
    """A prefill of `rows` x `length` tokens and one decode step, on fresh caches: the two
    calls' closures, the second one using the first one's caches."""
    caches = [SharedPrefixBatchCache([prefix] * rows, i) for i in range(layers)]
    tokens = mx.array([[(7 * r + t) % 1000 + 10 for t in range(length)] for r in range(rows)])

    def prefill():
        return model(tokens, cache=caches)[:, -1]

    def decode():
        return model(tokens[:, -1:], cache=caches)[:, -1]

    return prefill, decode


class Timed:
    """Stands in for a callable of the model (a layer, a module, the attention function):
    evaluates its result at each call and prints the first two calls' times."""

    def __init__(self, name: str, real, inputs: bool = False):
        self.name, self.real, self.calls, self.inputs = name, real, 0, inputs

    def __call__(self, *args, **kwargs):
        if self.calls >= 2:
            return self.real(*args, **kwargs)
        if self.inputs:  # what the call reads, evaluated first (not counted)
            mx.eval([a for a in args if isinstance(a, mx.array)])
        mx.synchronize()
        start = time.perf_counter()
        out = self.real(*args, **kwargs)
        mx.eval([a for a in (out if isinstance(out, tuple) else (out,))
                 if isinstance(a, mx.array)])
        mx.synchronize()
        self.calls += 1
        print(json.dumps({"stage": f"call:{self.name}", "call": self.calls,
                          "ms": round((time.perf_counter() - start) * 1e3, 2)}), flush=True)
        return out

    def __getattr__(self, name):
        return getattr(self.real, name)


def watch(model) -> None:
    """Times the first two calls of each of the model's layers, and of layer 0's parts."""
    import sys

    layers = model.layers
    first = layers[0]
    attention = first.self_attn
    for part in ("q_proj", "k_proj", "v_proj", "o_proj", "rope"):
        setattr(attention, part, Timed(f"layer0.{part}", getattr(attention, part)))
    for part in ("input_layernorm", "post_attention_layernorm", "mlp"):
        setattr(first, part, Timed(f"layer0.{part}", getattr(first, part)))
    module = sys.modules[type(attention).__module__]
    module.scaled_dot_product_attention = Timed("attention",
                                                module.scaled_dot_product_attention, True)
    for name in ("serves_cascade", "_verify", "_launch_cascade", "_launch"):
        setattr(prefix_attention, name, Timed(name, getattr(prefix_attention, name), True))
    for i in range(len(layers)):
        layers[i] = Timed(f"layer{i}", layers[i])


def stage_pair(name: str, model, layers: int, prefix, rows: int, length: int) -> None:
    prefill, decode = forward(model, layers, prefix, rows, length)
    first_p, first_d = timed(prefill), timed(decode)
    prefill, decode = forward(model, layers, prefix, rows, length)
    report(f"{name}-prefill", first_p, timed(prefill))
    report(f"{name}-decode", first_d, timed(decode))


def ops(dtype, kv_heads: int, G: int, D: int, prefix_length: int) -> None:
    """One layer's cascade attention for one row of 35 queries, op by op."""
    L, own = 35, 64
    scale = D ** -0.5
    queries = mx.random.normal((1, kv_heads * G, L, D)).astype(dtype)
    keys = mx.random.normal((1, kv_heads, own, D)).astype(dtype)
    values = mx.random.normal((1, kv_heads, own, D)).astype(dtype)
    keys_p = mx.random.normal((1, kv_heads, prefix_length, D)).astype(dtype)
    values_p = mx.random.normal((1, kv_heads, prefix_length, D)).astype(dtype)
    mx.eval(queries, keys, values, keys_p, values_p)
    steps = {}
    steps["scale-queries"] = lambda: (queries.astype(mx.float32) * scale).reshape(
        1, kv_heads, G * L, D)
    q = steps["scale-queries"]()
    steps["own-scores"] = lambda: q @ keys.astype(mx.float32).swapaxes(-1, -2)
    scores = steps["own-scores"]()
    steps["own-mask"] = lambda: shared_prefix._own_mask("causal", 1, G, L, own)
    mask = steps["own-mask"]()
    steps["own-attend"] = lambda: decode_attention.attend(scores, values, mask)
    out, lse = steps["own-attend"]()
    raw = queries.reshape(1, kv_heads, G * L, D)
    steps["prefix-kernel"] = lambda: prefix_attention.prefix_attention(raw, keys_p, values_p,
                                                                       scale)
    p_out, p_lse = steps["prefix-kernel"]()

    def merge():
        merged = mx.logaddexp(lse, p_lse)
        return (out * mx.exp(lse - merged)[..., None]
                + p_out * mx.exp(p_lse - merged)[..., None]), merged

    steps["merge"] = merge
    o, _ = merge()
    steps["cast-back"] = lambda: o.reshape(1, kv_heads * G, L, D).astype(dtype)
    for name, step in steps.items():
        report(f"op:{name}", timed(step), timed(step))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--order", choices=("cascade", "plain", "ops"), default="cascade")
    ap.add_argument("--prefix", type=int, default=1728, help="shared prefix tokens")
    ap.add_argument("--watch", action="store_true",
                    help="also time the first calls of each layer and of layer 0's parts")
    args = ap.parse_args()
    from mlx_lm import load

    start = time.perf_counter()
    model, _ = load(args.model)
    mx.eval(model.parameters())
    print(json.dumps({"stage": "load", "s": round(time.perf_counter() - start, 3)}), flush=True)
    shared_prefix.install(model)
    if not decode_attention.on_cuda():  # a dry run elsewhere: the kernel's reference
        prefix_attention.EVERYWHERE = True
    dtype, D, G = shared_prefix.attention_shape(model)
    attention = model.layers[0].self_attn
    kv_heads, layers = attention.n_kv_heads, len(model.layers)

    calls = [prefix_attention.compile_call(dtype, D), decode_attention.compile_call(dtype, D, G)]
    start = time.perf_counter()
    nvrtc.compile_ahead(*(c for c in calls if c is not None))
    nvrtc.wait_ahead()
    report("kernels", time.perf_counter() - start, 0.0)

    prefix = SharedPrefix(
        [mx.random.normal((1, kv_heads, args.prefix, D)).astype(dtype) for _ in range(layers)],
        [mx.random.normal((1, kv_heads, args.prefix, D)).astype(dtype) for _ in range(layers)])
    mx.eval(prefix.keys, prefix.values)
    if args.order == "ops":
        ops(dtype, kv_heads, G, D, args.prefix)
    order = [("plain", None, 2, 15), ("tail", prefix, 1, 35), ("wide", prefix, 510, 45)]
    if args.order != "plain":  # the cascade path first
        order[0], order[1] = order[1], order[0]
    for i, (name, p, rows, length) in enumerate(order):
        if args.watch and i == 1:  # the second path, after the first one's first use
            watch(model)
        stage_pair(name, model, layers, p, rows, length)


if __name__ == "__main__":
    main()
