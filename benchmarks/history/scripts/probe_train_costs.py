"""Where the demo trainer's time went before session 23's packing and composed exp, and what a
softmax on that exp costs at decode shapes (BENCHMARKS.md, session 23):

    python scripts/probe_train_costs.py tokens      # padded against real tokens a step
    python scripts/probe_train_costs.py step        # one compiled step, 16 rows x 256 tokens
    python scripts/probe_train_costs.py softmax     # MLX's softmax against the composed one
    python scripts/probe_train_costs.py ops         # ns an element: exp, sigmoid, a multiply

`tokens`: the recipe's lessons (--long-answers, seed 6), 2,000 batches, each example padded to
its batch's longest (the earlier trainer) against its own length. `step`: the target's
forward and backward through mlx-lm's own model (MLX's attention and SiLU), then with SiLU
replaced by a ReLU and the softmax dropped (wrong outputs: a probe of cost). `softmax`: scores
of 256 rows x 6 heads x 1 query at 100, 400 and 1,000 keys.
"""

import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import batchrun  # noqa: E402, F401  (BLAS routing before MLX)

# isort: split
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402

from batchrun.models import DEMO_MODEL, lessons, train, train_kernels  # noqa: E402


def ms(f, n: int) -> float:
    mx.eval(f())
    start = time.perf_counter()
    for _ in range(n):
        mx.eval(f())
    return (time.perf_counter() - start) / n * 1000


def tokens() -> None:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(DEMO_MODEL))
    data = train.encode_examples(tokenizer, lessons.examples(6, 20000, True))
    padded = real = 0
    for _, _, segments in train.batches(data, 2000, 6):
        lengths = [(segments[r] == s).sum().item() for r in range(segments.shape[0])
                   for s in range(1, int(segments[r].max().item()) + 1)]
        padded += len(lengths) * math.ceil(max(lengths) / train.LENGTH_STEP) * train.LENGTH_STEP
        real += sum(lengths)
    print(f"tokens a step: padded to the batch's longest {padded / 2000:.0f}, "
          f"real {real / 2000:.0f} (mean example {statistics.mean(len(i) for i, _ in data):.1f})")


def step() -> None:
    import json

    import mlx_lm.models.llama as llama

    config = json.loads((DEMO_MODEL / "config.json").read_text())

    def one_step_ms() -> float:
        mx.random.seed(0)
        model = train.make_model(config)
        optimizer = optim.AdamW(learning_rate=1e-3)

        def loss_fn(model, ids):
            logits = model(ids[:, :-1])
            return nn.losses.cross_entropy(logits, ids[:, 1:], reduction="mean")

        grad = nn.value_and_grad(model, loss_fn)
        state = [model.state, optimizer.state]

        def update(ids):
            loss, grads = grad(model, ids)
            optimizer.update(model, grads)
            return loss

        update = mx.compile(update, inputs=state, outputs=state)
        ids = mx.random.randint(0, config["vocab_size"], (16, 256))
        for _ in range(2):
            mx.eval(update(ids), state)
        return ms(lambda: [update(ids), state], 4)

    print(f"mlx-lm's model: {one_step_ms():.0f} ms a step")
    saved = llama.swiglu, llama.scaled_dot_product_attention

    def no_softmax(queries, keys, values, cache, scale, mask, sinks=None):
        b, heads, length, dim = queries.shape
        kv = keys.shape[1]
        scores = (queries * scale).reshape(b, kv, heads // kv, length, dim) @ \
            keys[:, :, None].swapaxes(-1, -2)
        scores = scores * mx.tril(mx.ones((length, length))) * 0.01
        return (scores @ values[:, :, None]).reshape(b, heads, length, dim)

    llama.swiglu = lambda gate, x: mx.maximum(gate, 0) * x
    llama.scaled_dot_product_attention = no_softmax
    try:
        print(f"SiLU and softmax replaced: {one_step_ms():.0f} ms a step")
    finally:
        llama.swiglu, llama.scaled_dot_product_attention = saved


def softmax() -> None:
    def composed(a):
        e = train_kernels.fast_exp(a - a.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    compiled = mx.compile(composed)
    for keys in (100, 400, 1000):
        x = mx.random.normal((256, 2, 3, 1, keys))
        mx.eval(x)
        theirs = ms(lambda x=x: mx.softmax(x, axis=-1, precise=True), 50)
        ours = ms(lambda x=x: composed(x), 50)
        fused = ms(lambda x=x: compiled(x), 50)
        print(f"{keys} keys: MLX's softmax {theirs:.2f} ms, composed {ours:.2f} ms, "
              f"compiled {fused:.2f} ms")

def ops() -> None:
    x = mx.random.normal((96, 256, 256))
    mx.eval(x)
    for name, f in (("exp", mx.exp), ("sigmoid", mx.sigmoid), ("multiply", lambda a: a * 0.5),
                    ("fast_exp", train_kernels.fast_exp)):
        print(f"{name}: {ms(lambda f=f: f(x), 5) * 1e6 / x.size:.2f} ns an element")


if __name__ == "__main__":
    {"tokens": tokens, "step": step, "softmax": softmax, "ops": ops}[sys.argv[1]]()
