"""Engine faults lose no row: failing batches are rerun in halves, a row fails only alone,
and running out of memory lowers the concurrency."""

import mlx.core as mx

from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.types import FinishReason, SamplingParams

PROMPTS = [f"Review {i}: the kettle is sturdy and quiet" for i in range(9)]


class FaultyModel:
    """The demo model, but a forward pass fails when `fails(inputs)` says so."""

    def __init__(self, model, fails):
        self._model = model
        self._fails = fails
        self.calls = 0

    def __call__(self, inputs, *args, **kwargs):
        self.calls += 1
        if self._fails(inputs):
            raise RuntimeError(self.message)
        return self._model(inputs, *args, **kwargs)

    message = "simulated kernel failure"

    def __getattr__(self, name):
        return getattr(self._model, name)


def reference(demo, prompts):
    e = Engine(demo.model, demo.tokenizer, EngineConfig(max_concurrency=16), demo.context_length)
    return {o.request_id: o.token_ids for o in e.generate(prompts, SamplingParams(max_tokens=10))}


def test_a_poisoned_row_fails_alone_and_the_others_finish_unchanged(demo):
    poison = demo.tokenizer.convert_tokens_to_ids("<tool_response>")
    prompts = PROMPTS[:4] + ["Review: <tool_response> breaks the model"] + PROMPTS[4:]
    model = FaultyModel(demo.model, lambda x: bool(mx.any(x == poison).item()))
    engine = Engine(model, demo.tokenizer, EngineConfig(max_concurrency=16), demo.context_length)
    outs = {o.request_id: o for o in engine.generate(prompts, SamplingParams(max_tokens=10))}
    assert len(outs) == len(prompts)
    bad = outs[4]
    assert bad.finish_reason is FinishReason.ERROR and "alone" in bad.error
    assert "simulated kernel failure" in bad.error
    expected = reference(demo, [p for i, p in enumerate(prompts) if i != 4])
    good = [outs[i].token_ids for i in range(len(prompts)) if i != 4]
    assert good == [expected[i] for i in range(len(expected))]
    assert engine.faults >= 3  # the batch, then halves, then the row alone


def test_out_of_memory_lowers_concurrency_and_completes_everything(demo):
    model = FaultyModel(demo.model, lambda x: x.shape[0] > 2)
    model.message = "[malloc] Out of memory: could not allocate"
    engine = Engine(model, demo.tokenizer, EngineConfig(max_concurrency=8), demo.context_length)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=10))
    assert engine.max_concurrency <= 2
    assert all(o.finish_reason is FinishReason.LENGTH for o in outs)
    expected = reference(demo, PROMPTS)
    assert [o.token_ids for o in outs] == [expected[i] for i in range(len(PROMPTS))]


def test_seeded_rows_give_the_same_text_after_a_restart(demo):
    calls = {"n": 0}

    def fail_once(x):
        calls["n"] += 1
        return calls["n"] == 6  # mid-generation, once

    params = SamplingParams(max_tokens=12, temperature=0.9, seed=5)
    model = FaultyModel(demo.model, fail_once)
    engine = Engine(model, demo.tokenizer, EngineConfig(max_concurrency=4), demo.context_length)
    outs = engine.generate(PROMPTS[:4], params)
    plain = Engine(demo.model, demo.tokenizer, EngineConfig(), demo.context_length)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(PROMPTS[:4],
                                                                                params)]
    assert engine.faults == 1


def test_a_failed_step_is_said_in_one_line_and_the_first_few_only(demo, caplog):
    calls = {"n": 0}

    def fails(inputs):
        calls["n"] += 1
        return calls["n"] % 2 == 0  # every other forward

    model = FaultyModel(demo.model, fails)
    engine = Engine(model, demo.tokenizer, EngineConfig(max_concurrency=16), demo.context_length)
    with caplog.at_level("WARNING", logger="batchrun"):
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=10))
    assert len(outs) == len(PROMPTS)
    said = [r.getMessage() for r in caplog.records if "batch step failed" in r.getMessage()]
    assert engine.faults > len(said) == 5
    assert all("\n" not in m and "simulated kernel failure" in m for m in said)
    assert "its 9 rows run again, half at a time" in said[0]
    assert said[-1].endswith("further failed steps are not said")


def test_a_row_whose_log_probabilities_are_not_numbers_fails_with_a_clear_error(demo):
    """A model whose output is NaN (an overflow in half precision, damaged weights) fails each
    row with one clear error instead of answering it with an empty "stop"."""
    import math

    from mlx.utils import tree_flatten, tree_unflatten

    from batchrun.engine.types import Constraint

    name, weight = next((n, a) for n, a in tree_flatten(demo.model.parameters())
                        if n.endswith("mlp.down_proj.weight"))
    demo.model.update(tree_unflatten([(name, mx.full(weight.shape, math.nan, weight.dtype))]))
    try:
        engine = Engine(demo.model, demo.tokenizer, EngineConfig(max_concurrency=4,
                                                                 prefix_cache=False),
                        demo.context_length)
        outs = engine.generate(["Tell me about kettles.", "And about toasters?"],
                               SamplingParams(max_tokens=6))
        labels = engine.generate(["Is this review good?"], SamplingParams(
            max_tokens=4, constraint=Constraint.choices(["good", "bad"])))
    finally:
        demo.model.update(tree_unflatten([(name, weight)]))
    for out in outs + labels:
        assert out.finish_reason == FinishReason.ERROR and not out.token_ids
        assert "not numbers" in out.error
