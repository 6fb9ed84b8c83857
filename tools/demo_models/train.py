"""Train the demo model pair on this CPU: a small Llama-shaped target and a smaller draft that
shares its tokenizer, both from lessons.py (labeling the sample reviews, answering the sample
questions, calling the sample weather tool, plain text; with --long-answers also essays and
answers from a reference). Deterministic from the seed on one machine (the same data order,
initialization and fp32 arithmetic). Each step packs its examples into rows and computes exp
with multiplies and adds (train_kernels.py): about twice as fast on this CPU as padding each
example and MLX's scalar exp, with the same losses to three decimals.

    python -m tools.demo_models.train sample_data/demo-trained sample_data/demo-draft
        [--steps N] [--draft-steps N] [--seed S] [--long-answers]
        [--more-steps N [--more-lr LR]] [--target-shape H,L,I,A,KV]

Each folder is a complete mlx-lm model (the demo tokenizer and chat template of
batchrun/models/random_model.py). The labeling accuracy on held-out reviews is printed and
written to the target's config.json (`batchrun_training`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import batchrun  # noqa: F401  (BLAS routing before MLX)

# isort: split
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from batchrun.models import random_model
from tools.demo_models import lessons, train_kernels

SHAPES = {
    "target": random_model.Shape(192, 4, 512, 6, 2),
    # one layer: a draft forward is mostly per-op cost
    "draft": random_model.Shape(96, 1, 256, 3, 1),
}
BATCH = 16
LENGTH_STEP = 32  # rows are as wide as their group's bound, rounded up to a multiple of this
MAX_LENGTH = 480  # the essays' 300-440 tokens and their question
GROUPS = (256, MAX_LENGTH)  # batches' length groups (upper bounds)
PEAK_LR = 3e-3
WARMUP = 50


def encode_examples(tokenizer, examples) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) per example: chats learn their last (assistant) turn, text all of
    it. An example whose prompt does not tokenize as a prefix of the whole is dropped."""
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    out = []
    for content, tools in examples:
        if isinstance(content, str):
            ids = tokenizer.encode(content, add_special_tokens=False) + [eos]
            mask = [1] * len(ids)
        else:
            prompt = tokenizer.apply_chat_template(content[:-1], tools=tools, tokenize=False,
                                                   add_generation_prompt=True)
            whole = tokenizer.apply_chat_template(content, tools=tools, tokenize=False)
            if content[-1].get("enable_thinking") is False and whole.startswith(prompt):
                # the same answer after the prompt as `enable_thinking: false` renders it
                answer = whole[len(prompt):]
                prompt = tokenizer.apply_chat_template(content[:-1], tools=tools,
                                                       tokenize=False, add_generation_prompt=True,
                                                       enable_thinking=False)
                whole = prompt + answer
            head = tokenizer.encode(prompt, add_special_tokens=False)
            ids = tokenizer.encode(whole.rstrip("\n"), add_special_tokens=False)
            if ids[:len(head)] != head:
                continue
            mask = [0] * len(head) + [1] * (len(ids) - len(head))
        if len(ids) <= MAX_LENGTH:
            out.append((ids, mask))
    return out


def batches(data: list, steps: int, seed: int):
    """`steps` batches of BATCH examples: (ids, loss mask, segment ids), each of (rows, width).
    Examples are grouped by length (GROUPS: a long essay does not pad 15 short chats), each
    batch's group drawn in proportion to the examples it holds. The short lessons of every kind
    mix in one group, as every lesson did before the essays: the two tries with finer groups
    (with other lessons too, so not the groups' doing alone; benchmarks/history/) labeled
    82-88% of held-out reviews. A batch's examples are packed into rows as wide as their group's
    bound (first fit, longest first; segment ids 1, 2, ... a row, 0 for padding), where padding
    each to the longest had doubled the tokens computed."""
    rng = random.Random(seed)
    groups = []  # (examples, row width)
    for low, high in zip((0, *GROUPS[:-1]), GROUPS, strict=True):
        members = [ex for ex in data if low < len(ex[0]) <= high]
        if members:
            groups.append((members, _padded(high)))
    sizes = [len(g) for g, _ in groups]
    for _ in range(steps):
        # one group (the lessons without long answers): batches drawn as before groups were
        group, width = groups[0] if len(groups) == 1 else rng.choices(groups, weights=sizes)[0]
        chosen = rng.sample(group, min(BATCH, len(group)))
        rows = pack([len(ids) for ids, _ in chosen], width)
        ids, mask, segments = [], [], []
        for row in rows:
            ids.append([t for i in row for t in chosen[i][0]])
            mask.append([m for i in row for m in chosen[i][1]])
            segments.append([n for n, i in enumerate(row, 1) for _ in chosen[i][0]])
            for column in (ids[-1], mask[-1], segments[-1]):
                column.extend([0] * (width - len(column)))
        yield mx.array(ids), mx.array(mask, mx.float32), mx.array(segments)


def pack(lengths: list[int], width: int) -> list[list[int]]:
    """Indices of `lengths` in rows of at most `width` tokens: first fit, longest first (ties in
    order), each row's indices in the order they were placed."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            rows.append([])
            room.append(width)
            slot = len(rows) - 1
        rows[slot].append(i)
        room[slot] -= lengths[i]
    return rows


def _padded(length: int) -> int:
    return math.ceil(length / LENGTH_STEP) * LENGTH_STEP


def make_model(config: dict):
    from mlx_lm.models import llama

    return llama.Model(llama.ModelArgs.from_dict(config))


def batch_loss(model, ids: mx.array, mask: mx.array, segments: mx.array) -> mx.array:
    """Mean next-token cross-entropy over a batch's taught tokens (batches' arrays; the model's
    attention and SwiGLU train_kernels.installed)."""
    logits = train_kernels.forward(model, ids[:, :-1],
                                   train_kernels.segment_mask(segments[:, :-1]))
    losses = train_kernels.cross_entropy(logits, ids[:, 1:])
    # a packed row's next example is not a target of the one before it
    weights = mask[:, 1:] * (segments[:, 1:] == segments[:, :-1])
    return (losses * weights).sum() / mx.maximum(weights.sum(), 1)


def train(model, data: list, steps: int, seed: int, log_every: int = 50,
          peak_lr: float = PEAK_LR) -> float:
    """Next-token cross-entropy on the masked tokens, AdamW with warm-up and cosine decay;
    the last logged loss."""
    schedule = optim.join_schedules(
        [optim.linear_schedule(peak_lr / 10, peak_lr, WARMUP),
         optim.cosine_decay(peak_lr, max(1, steps - WARMUP), peak_lr / 20)], [WARMUP])
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.01)

    grad = nn.value_and_grad(model, batch_loss)
    state = [model.state, optimizer.state]

    def step(ids, mask, segments):
        loss, grads = grad(model, ids, mask, segments)
        optimizer.update(model, grads)
        return loss

    step = mx.compile(step, inputs=state, outputs=state)
    start, recent = time.perf_counter(), []
    with train_kernels.installed(model):
        for i, batch in enumerate(batches(data, steps, seed), 1):
            loss = step(*batch)
            mx.eval(state, loss)
            recent.append(loss.item())
            if i % log_every == 0 or i == steps:
                print(f"step {i:5d}  loss {sum(recent) / len(recent):.3f}  "
                      f"{time.perf_counter() - start:.0f}s", flush=True)
                last, recent = sum(recent) / len(recent), []
    return last


def labeling_accuracy(folder: Path, rows: int = 200, seed: int = 12345) -> float:
    """Greedy answers of the model in `folder` to the sample labeling prompt for held-out
    reviews (their own seed), against the reviews' sentiment."""
    from batchrun.engine.engine import Engine
    from batchrun.engine.types import SamplingParams

    engine = Engine.load(str(folder), prefix_cache=False)
    rng = random.Random(seed)
    chats, expected = [], []
    for _ in range(rows):
        product, text, rating = random_model.review(rng)
        chats.append(lessons.label_request(product, text))
        expected.append(lessons.sentiment(rating))
    outs = engine.generate(chats, SamplingParams(max_tokens=4))
    return sum(o.text.strip() == want for o, want in zip(outs, expected, strict=True)) / rows


def long_answers_known(engine) -> tuple[int, int, int, int]:
    """What a pair trained with `long_answers` learned, greedily through `engine`: (essays
    written right to 256 tokens, essays asked, reference answers quoted word for word,
    reference questions asked). The demo's test and scripts/probe_pair.py both count so."""
    from batchrun.engine.types import SamplingParams

    topics = [(task, t) for task in lessons.ESSAY_TASKS for t in random_model.TOPICS]
    outs = engine.generate([[{"role": "user", "content": task.format(t=t)}]
                            for task, t in topics], SamplingParams(max_tokens=256))
    essays = sum(len(o.token_ids) == 256 and lessons.essay(t).startswith(o.text)
                 for (_, t), o in zip(topics, outs, strict=True))
    asked = [(task, t) for t in random_model.TOPICS for task in lessons.REFERENCE_TASKS]
    outs = engine.generate([[{"role": "system", "content": lessons.reference_text(t)},
                             {"role": "user", "content": task.format(t=t)}] for task, t in asked],
                           SamplingParams(max_tokens=128))
    quoted = sum(o.text.strip() == lessons.reference_answer(task, t)
                 for (task, t), o in zip(asked, outs, strict=True))
    return essays, len(topics), quoted, len(asked)


def weather_calls_known(engine) -> list[str]:
    """The lesson cities whose weather question, asked through `engine` with the sample tool,
    gets exactly one well-formed get_weather call naming that city (the demo's test asks
    Oslo)."""
    import json

    from batchrun.engine.decoding.reasoning import parse_tool_calls
    from batchrun.engine.types import SamplingParams

    tools = [lessons.WEATHER_TOOL]
    ids = [engine.add_request(messages=[{"role": "user",
                                         "content": f"What is the weather in {city}?"}],
                              tools=tools, params=SamplingParams(max_tokens=32))
           for city in lessons.CITIES]
    outs = {o.request_id: o for o in engine.run()}
    right = []
    for request, city in zip(ids, lessons.CITIES, strict=True):
        _, calls = parse_tool_calls(outs[request].text, engine.markup, tools)
        if [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                   {"city": city})]:
            right.append(city)
    return right


def write_model(out: Path, model, config: dict) -> None:
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    random_model.write_json(out / "config.json", config)


def continue_training(model, data: list, steps: int, seed: int, peak_lr: float,
                      config: dict) -> float:
    """The target's second round (train_pair's `more_steps`); its config records it."""
    loss = train(model, data, steps, seed + 1, peak_lr=peak_lr)
    config["batchrun_training"].update(more_steps=steps, more_lr=peak_lr,
                                       final_loss=round(loss, 4))
    return loss


def train_pair(target_out: Path, draft_out: Path, steps: int, seed: int,
               draft_steps: int | None = None, examples: int = 20000,
               more_steps: int = 0, more_lr: float = PEAK_LR / 3,
               long_answers: bool = False, target_shape: random_model.Shape | None = None) -> dict:
    """Train and write both models; the target's held-out labeling accuracy and losses. With
    `more_steps`, the target then trains that many more (a second warm-up and decay, peaking at
    `more_lr`, batches drawn with seed + 1). `target_shape` replaces SHAPES["target"]."""
    shapes = {**SHAPES, **({"target": target_shape} if target_shape else {})}
    results = {}
    data = None
    for role, out, n in (("target", target_out, steps), ("draft", draft_out,
                                                          draft_steps or steps)):
        out.mkdir(parents=True, exist_ok=True)
        # The tokenizer stays the demo model's (seed 0) whatever the seed: the seed draws the
        # weights and lessons, and every demo model then writes the same token ids.
        config = random_model.model_folder(out, shapes[role], seed, f"demo-{role}",
                                           tokenizer_seed=0)
        if data is None:
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
            data = encode_examples(tokenizer, lessons.examples(seed, examples, long_answers))
            print(f"{len(data)} examples", flush=True)
        mx.random.seed(seed)
        model = make_model(config)
        mx.eval(model.parameters())
        loss = train(model, data, n, seed)
        config["batchrun_training"] = {"steps": n, "seed": seed, "examples": len(data),
                                       "final_loss": round(loss, 4)}
        if role == "target" and more_steps:
            loss = continue_training(model, data, more_steps, seed, more_lr, config)
        write_model(out, model, config)
        results[role] = {"loss": loss}
    accuracy = labeling_accuracy(target_out)
    results["target"]["labeling_accuracy"] = accuracy
    config = json.loads((target_out / "config.json").read_text())
    config["batchrun_training"]["labeling_accuracy"] = round(accuracy, 4)
    random_model.write_json(target_out / "config.json", config)
    print(json.dumps(results), flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path)
    parser.add_argument("draft", type=Path)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--draft-steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--more-steps", type=int, default=0,
                        help="then train the target this many steps more (a second decay)")
    parser.add_argument("--more-lr", type=float, default=PEAK_LR / 3)
    parser.add_argument("--long-answers", action="store_true",
                        help="lessons with essays and answers from a reference too")
    default = ",".join(map(str, _dims(SHAPES["target"])))
    parser.add_argument("--target-shape", type=_shape, default=None, metavar="H,L,I,A,KV",
                        help="the target's hidden size, layers, MLP size, attention heads and "
                        f"key-value heads (default {default})")
    args = parser.parse_args(argv)
    for folder in (args.target, args.draft):
        if folder.exists() and not folder.is_dir():
            parser.error(f"{folder}: exists and is not a folder")
    try:
        train_pair(args.target, args.draft, args.steps, args.seed, args.draft_steps,
                   more_steps=args.more_steps, more_lr=args.more_lr,
                   long_answers=args.long_answers, target_shape=args.target_shape)
    except OSError as e:  # a folder that cannot be written
        raise SystemExit(f"error: {e.strerror or e}: {e.filename or ''}") from None


def _dims(shape: random_model.Shape) -> tuple[int, ...]:
    return (shape.hidden_size, shape.num_hidden_layers, shape.intermediate_size,
            shape.num_attention_heads, shape.num_key_value_heads)


def _shape(text: str) -> random_model.Shape:
    try:
        dims = [int(d) for d in text.split(",")]
    except ValueError:
        dims = []
    if len(dims) != 5 or min(dims) < 1 or dims[0] % dims[3] or dims[3] % dims[4]:
        raise argparse.ArgumentTypeError(
            "five positive integers H,L,I,A,KV: H divisible by A, A by KV")
    return random_model.Shape(*dims)


if __name__ == "__main__":
    main()
