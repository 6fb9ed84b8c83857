"""The engine core behaves the same over both model backends (text through mlx-lm, vision
through mlx-vlm): fault recovery, batch-independent outputs, stop strings and stop tokens,
abort, per-request errors, log-probabilities."""

from pathlib import Path

import mlx.core as mx
import pytest

from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.types import FinishReason, SamplingParams
from batchrun.engine.vision_engine import VisionEngine
from batchrun.models import load_vision_model

MODEL = Path(__file__).resolve().parents[1] / "sample_data" / "demo-vision-model"
PROMPTS = [f"Review {i}: the kettle is sturdy and quiet" for i in range(7)]


class Faulty:
    """A model whose forward pass raises when `fails(inputs)` says so."""

    def __init__(self, model, fails, message="simulated kernel failure"):
        self._model, self._fails, self.message = model, fails, message

    def __call__(self, inputs, *args, **kwargs):
        if self._fails(inputs):
            raise RuntimeError(self.message)
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


class WithLanguageModel:
    """A vision model whose language model is replaced (to inject faults)."""

    def __init__(self, model, language_model):
        self._model, self.language_model = model, language_model

    def __getattr__(self, name):
        return getattr(self._model, name)


@pytest.fixture(scope="module")
def vision_model():
    return load_vision_model(str(MODEL))


@pytest.fixture(params=["text", "vision"])
def make(request, demo, vision_model):
    """make(concurrency, fails=None, message=...) -> an engine of this backend."""

    def build(concurrency: int = 8, fails=None, message: str = "simulated kernel failure"):
        config = EngineConfig(max_concurrency=concurrency)
        if request.param == "text":
            model = demo.model if fails is None else Faulty(demo.model, fails, message)
            return Engine(model, demo.tokenizer, config, demo.context_length)
        m = vision_model.model
        if fails is not None:
            m = WithLanguageModel(m, Faulty(m.language_model, fails, message))
        return VisionEngine(m, vision_model.tokenizer, config, vision_model.context_length)

    return build


def tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def test_greedy_output_does_not_depend_on_the_batch(make):
    params = SamplingParams(max_tokens=10)
    alone = [make(1).generate([p], params)[0].token_ids for p in PROMPTS[:3]]
    batched = tokens(make(4).generate(PROMPTS, params))
    assert batched[:3] == alone


def test_seeded_sampling_does_not_depend_on_the_batch(make):
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=7)
    alone = make(1).generate(PROMPTS[:1], params)[0].token_ids
    batched = make(4).generate(PROMPTS, params)
    assert batched[0].token_ids == alone


def test_a_poisoned_row_fails_alone_and_the_others_finish_unchanged(make):
    engine = make()
    poison = engine.prompts.encode("zebra")[-1]
    prompts = PROMPTS[:3] + ["Review: a zebra breaks the model"] + PROMPTS[3:]
    params = SamplingParams(max_tokens=8)
    expected = tokens(make().generate(PROMPTS, params))
    faulty = make(fails=lambda x: isinstance(x, mx.array) and bool(mx.any(x == poison).item()))
    outs = faulty.generate(prompts, params)
    assert len(outs) == len(prompts)
    assert outs[3].finish_reason is FinishReason.ERROR and "alone" in outs[3].error
    assert "simulated kernel failure" in outs[3].error
    assert tokens(outs[:3] + outs[4:]) == expected
    assert faulty.faults >= 3  # the batch, the halves, the row alone


def test_out_of_memory_lowers_the_concurrency_and_completes_everything(make):
    params = SamplingParams(max_tokens=8)
    expected = tokens(make().generate(PROMPTS, params))
    engine = make(8, fails=lambda x: isinstance(x, mx.array) and x.ndim and x.shape[0] > 2,
                  message="[malloc] Out of memory: could not allocate")
    outs = engine.generate(PROMPTS, params)
    assert engine.max_concurrency <= 2
    assert all(o.finish_reason is FinishReason.LENGTH for o in outs)
    assert tokens(outs) == expected


def test_stop_strings_and_stop_tokens_end_a_row(make):
    free = make().generate(PROMPTS[:1], SamplingParams(max_tokens=12))[0]
    assert len(free.token_ids) >= 6
    engine = make()
    cut = engine.tokenizer.decode(free.token_ids[3:5])
    by_string = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=12, stop=(cut,)))[0]
    assert by_string.finish_reason is FinishReason.STOP
    assert cut not in by_string.text and free.text.startswith(by_string.text)
    assert len(by_string.token_ids) < len(free.token_ids)
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    by_token = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=12,
                                                           stop_token_ids=(stop_id,)))[0]
    assert by_token.finish_reason is FinishReason.STOP
    assert by_token.token_ids == free.token_ids[:first]


def test_abort_ends_a_waiting_and_a_running_request_once(make):
    engine = make(1)
    running = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=50))
    waiting = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=5))
    engine.step()
    engine.step()
    assert engine.abort(running) and engine.abort(waiting)
    assert not engine.abort(waiting)  # already finished
    outs = engine.run()
    assert [(o.request_id, o.finish_reason) for o in outs] == [
        (running, FinishReason.ABORT), (waiting, FinishReason.ABORT)]
    assert not engine.has_work()


def test_bad_requests_are_their_own_errors(make):
    engine = make()
    long = list(range(5, 5 + engine.context_length))
    ok = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4))
    empty = engine.add_tokens([], SamplingParams(max_tokens=4))
    too_long = engine.add_tokens(long, SamplingParams(max_tokens=4))
    outs = {o.request_id: o for o in engine.run()}
    assert outs[ok].finish_reason is FinishReason.LENGTH
    assert outs[empty].finish_reason is FinishReason.ERROR and "empty" in outs[empty].error
    assert outs[too_long].finish_reason is FinishReason.ERROR
    assert "context" in outs[too_long].error


def test_greedy_logprobs_belong_to_the_tokens(make):
    out = make().generate(PROMPTS[:2], SamplingParams(max_tokens=6, logprobs=True,
                                                      top_logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids) == len(out.top_logprobs)
    for token, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert lp <= 0 and len(top) == 3
        assert top[0][0] == token  # greedy: the sampled token is the most likely
        assert abs(top[0][1] - lp) < 1e-4


def test_engine_stats_count_what_ran(make):
    engine = make(4)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=5))
    s = engine.stats
    assert s.requests_finished == len(PROMPTS)
    assert s.completion_tokens == sum(len(o.token_ids) for o in outs)
    assert s.prompt_tokens == sum(o.prompt_tokens for o in outs)
    assert s.prefill_time > 0 and s.decode_time > 0 and 0 < s.decode_tokens <= s.completion_tokens
    assert 1 <= s.mean_batch_size <= 4


def test_sampled_rows_report_the_models_logprobs(make):
    """A sampled row's log-probabilities are the model's distribution (not the sampling noise):
    its first token's top alternatives are the greedy row's, whatever it then drew."""
    greedy = make().generate(PROMPTS[:1], SamplingParams(max_tokens=5, logprobs=True,
                                                         top_logprobs=3))[0]
    sampled = make().generate(PROMPTS[:1], SamplingParams(max_tokens=5, logprobs=True,
                                                          top_logprobs=3, temperature=1.5,
                                                          seed=9))[0]
    assert sampled.finish_reason is not FinishReason.ERROR
    assert len(sampled.logprobs) == len(sampled.token_ids) == len(sampled.top_logprobs)
    assert [t for t, _ in sampled.top_logprobs[0]] == [t for t, _ in greedy.top_logprobs[0]]
    for (_, a), (_, b) in zip(sampled.top_logprobs[0], greedy.top_logprobs[0], strict=True):
        assert abs(a - b) < 1e-3
    for token, lp, top in zip(sampled.token_ids, sampled.logprobs, sampled.top_logprobs,
                              strict=True):
        assert lp <= top[0][1] + 1e-5
        if token in dict(top):
            assert abs(dict(top)[token] - lp) < 1e-4


def test_choices_rows_get_choice_probs_and_leave_other_rows_unchanged(make):
    from batchrun.engine.types import Constraint

    choices = Constraint.choices(["positive", "negative", "neutral"])
    plain = make().generate(PROMPTS, SamplingParams(max_tokens=6))
    engine = make(4)
    ids = [engine.add_request(p, SamplingParams(max_tokens=6)) for p in PROMPTS]
    asked = [engine.add_request(p, SamplingParams(max_tokens=4, constraint=choices))
             for p in PROMPTS[:3]]
    outs = {o.request_id: o for o in engine.run()}
    assert [outs[i].token_ids for i in ids] == tokens(plain)
    alone = make(1).generate(PROMPTS[:1], SamplingParams(max_tokens=4, constraint=choices))[0]
    for i in asked:
        out = outs[i]
        assert out.text in ("positive", "negative", "neutral")
        assert set(out.choice_logprobs) == {"positive", "negative", "neutral"}
        assert out.text == max(out.choice_logprobs, key=out.choice_logprobs.get)  # greedy
    first = outs[asked[0]].choice_logprobs
    assert all(abs(first[c] - alone.choice_logprobs[c]) < 1e-3 for c in first)


def test_a_shared_prefix_served_from_the_cache_gives_the_same_tokens(make):
    instruction = "Label the sentiment of the review. " + " ".join(
        f"Guideline {i}: weigh the wording of part {i} carefully." for i in range(20))
    prompts = [f"{instruction}\n{p}" for p in PROMPTS]
    params = SamplingParams(max_tokens=8)
    expected = tokens(make(3).generate(prompts, params))
    engine = make(3)
    engine.enable_prefix_cache()
    outs = engine.generate(prompts, params)
    assert tokens(outs) == expected
    assert all(o.cached_tokens >= 128 for o in outs)  # every row, the first one included
