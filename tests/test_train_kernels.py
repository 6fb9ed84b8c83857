"""The demo trainer's packed rows and cheaper exp (tools/demo_models/train_kernels.py, train.py):
what the trainer computes is what MLX's own ops compute on the examples one by one."""

import json
import random

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from tools.demo_models import train, train_kernels

CONFIG = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
          "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-5, "vocab_size": 50, "tie_word_embeddings": False}


def test_fast_exp_is_exp_to_float_precision_and_zero_far_below():
    x = mx.concatenate([mx.linspace(-87, 87, 20001), mx.array([0.0, 1e-8, -1e-8])])
    relative = mx.abs(train_kernels.fast_exp(x) / mx.exp(x) - 1)
    assert relative.max().item() < 5e-7
    assert train_kernels.fast_exp(mx.array([train_kernels.MASKED, -1e30, -200.0])).tolist() == \
        [0.0, 0.0, 0.0]


def test_softmax_sigmoid_and_cross_entropy_match_mlx_with_their_gradients():
    mx.random.seed(1)
    scores = mx.random.normal((3, 5, 9)) * 6
    bias = mx.where(mx.random.uniform(shape=(3, 5, 9)) < 0.3, train_kernels.MASKED, 0.0)
    bias[..., 0] = 0.0  # every row keeps a score
    weights = mx.random.normal((3, 5, 9))

    def ours(s):
        return (train_kernels.softmax(s, bias) * weights).sum()

    def theirs(s):
        return (mx.softmax(s + bias, axis=-1) * weights).sum()

    assert mx.allclose(train_kernels.softmax(scores, bias), mx.softmax(scores + bias, axis=-1),
                       atol=1e-6)
    assert mx.allclose(mx.grad(ours)(scores), mx.grad(theirs)(scores), atol=1e-5)

    gate, up = mx.random.normal((4, 7)) * 8, mx.random.normal((4, 7))
    assert mx.allclose(train_kernels.swiglu(gate, up), nn.silu(gate) * up, atol=1e-5)
    ours_g = mx.grad(lambda g, u: train_kernels.swiglu(g, u).sum(), argnums=(0, 1))(gate, up)
    theirs_g = mx.grad(lambda g, u: (nn.silu(g) * u).sum(), argnums=(0, 1))(gate, up)
    assert all(mx.allclose(a, b, atol=1e-5) for a, b in zip(ours_g, theirs_g, strict=True))

    logits, targets = mx.random.normal((6, 11, 50)) * 5, mx.random.randint(0, 50, (6, 11))
    reference = nn.losses.cross_entropy(logits, targets, reduction="none")
    assert mx.allclose(train_kernels.cross_entropy(logits, targets), reference, atol=1e-5)
    ours_g = mx.grad(lambda x: (train_kernels.cross_entropy(x, targets) * weights.sum()).sum())
    theirs_g = mx.grad(lambda x: (nn.losses.cross_entropy(x, targets, reduction="none")
                                  * weights.sum()).sum())
    assert mx.allclose(ours_g(logits), theirs_g(logits), atol=1e-5)


def test_pack_places_every_example_once_within_the_width_longest_first():
    rng = random.Random(4)
    for _ in range(200):
        lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 20))]
        rows = train.pack(lengths, 64)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
        # first fit: no example would have fitted a row before its own
        for r, row in enumerate(rows):
            for i in row:
                for earlier in rows[:r]:
                    placed = [j for j in earlier if (-lengths[j], j) < (-lengths[i], i)]
                    assert sum(lengths[j] for j in placed) + lengths[i] > 64
    assert train.pack([10, 50, 30, 20], 60) == [[1, 0], [2, 3]]


def _example(rng, length, text):
    ids = [rng.randrange(3, 50) for _ in range(length)]
    mask = [1] * length if text else [0] * (length // 2) + [1] * (length - length // 2)
    return ids, mask


def test_a_packed_batch_has_the_loss_and_gradients_of_its_examples_one_by_one(monkeypatch):
    """What packing must not change: the loss over the examples' taught tokens, and its
    gradients, as MLX's own model forward computes them for each example alone (a text example
    after another in a row is not taught to predict its first token from the one before)."""
    rng = random.Random(2)
    data = [_example(rng, n, text) for n, text in ((20, True), (9, False), (31, True),
                                                  (14, True), (6, False), (25, False))]
    monkeypatch.setattr(train, "BATCH", len(data))
    monkeypatch.setattr(train, "GROUPS", (64,))
    ids, mask, segments = next(train.batches(data, 1, 0))
    assert ids.shape[1] == 64 and ids.shape[0] < len(data)  # packed: fewer rows than examples

    mx.random.seed(0)
    model = train.make_model(CONFIG)
    mx.eval(model.parameters())

    def alone(model):
        total, count = 0.0, 0
        for example_ids, example_mask in data:
            x = mx.array(example_ids)[None]
            losses = nn.losses.cross_entropy(model(x[:, :-1]), x[:, 1:], reduction="none")
            weights = mx.array(example_mask[1:], mx.float32)[None]
            total = total + (losses * weights).sum()
            count += sum(example_mask[1:])
        return total / count

    with train_kernels.installed(model):
        loss, grads = nn.value_and_grad(model, train.batch_loss)(model, ids, mask, segments)
    expected, expected_grads = nn.value_and_grad(model, alone)(model)
    assert abs(loss.item() - expected.item()) < 1e-5
    for (name, g), (_, h) in zip(tree_flatten(grads), tree_flatten(expected_grads), strict=True):
        assert mx.allclose(g, h, atol=1e-5, rtol=1e-4), name


def test_batches_hold_their_examples_whole_in_rows_of_their_groups_width(monkeypatch):
    rng = random.Random(8)
    data = [_example(rng, rng.choice([5, 12, 40, 70, 90]), rng.random() < 0.5)
            for _ in range(60)]
    monkeypatch.setattr(train, "GROUPS", (64, 96))
    by_ids = {tuple(ids): mask for ids, mask in data}
    for ids, mask, segments in train.batches(data, 20, 3):
        width = ids.shape[1]
        assert width in (64, 96)
        found = []
        for row_ids, row_mask, row_segments in zip(ids.tolist(), mask.tolist(),
                                                   segments.tolist(), strict=True):
            for n in range(1, max(row_segments) + 1):
                at = [i for i, s in enumerate(row_segments) if s == n]
                assert at == list(range(at[0], at[0] + len(at)))  # contiguous
                example = tuple(row_ids[i] for i in at)
                assert [row_mask[i] for i in at] == by_ids[example]
                found.append(example)
            padding = [i for i, s in enumerate(row_segments) if s == 0]
            assert all(row_ids[i] == 0 and row_mask[i] == 0 for i in padding)
        assert len(found) == train.BATCH
        assert all((len(e) <= 64) == (width == 64) for e in found)


def test_installed_routes_training_only_and_puts_mlx_lms_functions_back():
    import mlx_lm.models.llama as llama

    model = train.make_model(CONFIG)
    before = llama.scaled_dot_product_attention, llama.swiglu
    with pytest.raises(RuntimeError), train_kernels.installed(model):
        assert llama.swiglu is train_kernels.swiglu
        raise RuntimeError
    assert (llama.scaled_dot_product_attention, llama.swiglu) == before
    with train_kernels.installed(model), pytest.raises(ValueError, match="no cache"):
        model(mx.array([[1, 2, 3]]), cache=model.make_cache())


def test_config_of_the_committed_target_trains_through_the_packed_forward():
    """The trainer's forward is mlx-lm's model's own, layer by layer: the same logits."""
    from batchrun.models import DEMO_MODEL

    config = json.loads((DEMO_MODEL / "config.json").read_text())
    mx.random.seed(3)
    model = train.make_model(config)
    mx.eval(model.parameters())
    x = mx.random.randint(0, config["vocab_size"], (2, 17))
    with train_kernels.installed(model):
        ours = train_kernels.forward(model, x, train_kernels.segment_mask(mx.ones((2, 17),
                                                                                  mx.int32)))
    assert mx.allclose(ours, model(x), atol=1e-4)
