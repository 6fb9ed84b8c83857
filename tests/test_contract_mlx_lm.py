"""mlx-lm's own tests of batch generation (tests/test_generate.py: `batch_generate`,
`BatchGenerator`), as behaviours of batchrun's Engine, which is built on BatchGenerator and
promises that greedy outputs equal mlx-lm's own generation, alone or batched.

The reference is `mlx_lm.generate.generate_step` on one prompt at a time (outside the engine's
steps, so MLX's own attention), stopped at an end-of-sequence token as batch_generate stops:
without it in the output. Each test's docstring names the mlx-lm test it ports. The demo model
is float32 with random weights, so its rows run to their max_tokens unless a test makes them
stop; every row asks for at most 8 tokens."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache
from mlx_lm.sample_utils import make_logits_processors

from batchrun.cache import block_layout, make_prefix_cache
from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.types import FinishReason, SamplingParams

FP = "cd" * 32
TOL = 1e-4  # mlx-lm's own tolerance for batched against single log-probabilities
TEXTS = ["Write a story about Einstein", "Hi", "What time is it?", "How tall is Mt Everest?"]


def _engine(demo, **config) -> Engine:
    config = {"max_concurrency": 8, "prefix_cache": False, **config}
    return Engine(demo.model, demo.tokenizer, EngineConfig(**config))


@pytest.fixture
def engine(demo):
    e = _engine(demo)
    yield e
    e.serving.stop()


@pytest.fixture
def prompts(demo):
    """mlx-lm's four prompts as token ids: 13, 2, 7 and 15 tokens."""
    return [list(demo.tokenizer.encode(t)) for t in TEXTS]


def alone(demo, prompt, max_tokens, processors=None):
    """mlx-lm's generation of one prompt: (tokens, each token's whole log-probability vector),
    ending before an end-of-sequence token."""
    tokens, logprobs = [], []
    for token, lp in generate_step(mx.array(prompt), demo.model, max_tokens=max_tokens,
                                   logits_processors=processors):
        token = int(token.item() if hasattr(token, "item") else token)
        if token in demo.tokenizer.eos_token_ids:
            break
        tokens.append(token)
        logprobs.append(lp)
    return tokens, logprobs


def bias(token: int, value: float = 2000.0):
    """A logits processor, mlx-lm's form f(tokens, logits): `value` added to one token."""
    return make_logits_processors(logit_bias={token: value})[0]


def outputs_by_id(outs):
    return {o.request_id: o for o in outs}


def assert_logprobs_match(out, reference):
    """The sampled tokens' log-probabilities equal mlx-lm's within its tolerance."""
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    want = [lp[t].item() for t, lp in zip(out.token_ids, reference, strict=True)]
    assert out.logprobs == pytest.approx(want, abs=TOL, rel=TOL)


# -- batched against single -----------------------------------------------------------------------

def test_batch_matches_single(demo, engine, prompts):
    """mlx-lm test_batch_matches_single: a batch of prompts gives each prompt's single tokens."""
    outs = engine.generate(prompts, max_tokens=8)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == alone(demo, prompt, 8)[0]
        assert out.prompt_tokens == len(prompt)


def test_batch_of_different_lengths_matches_single_logprobs(demo, engine, prompts):
    """mlx-lm test_batch_matches_single / test_batch_sliding_window: batched log-probabilities
    (prompts of 2 to 15 tokens, padded together) equal single generation's within 1e-4."""
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, logprobs=True))
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, reference = alone(demo, prompt, 6)
        assert out.token_ids == tokens
        assert_logprobs_match(out, reference)


def test_many_batches(demo, prompts):
    """mlx-lm test_many_batches: with a completion batch too small for all prompts, every prompt
    gives exactly one response, over several iterations, equal to its single generation."""
    e = _engine(demo, max_concurrency=2, prefill_batch_size=1)
    ids = [e.add_request(p, SamplingParams(max_tokens=3, logprobs=True)) for p in prompts]
    seen, iterations = [], 0
    while e.has_work():
        seen.extend(e.step())
        iterations += 1
    assert sorted(o.request_id for o in seen) == sorted(ids)  # one Output each
    assert iterations > 1
    done = outputs_by_id(seen)
    for request_id, prompt in zip(ids, prompts, strict=True):
        tokens, reference = alone(demo, prompt, 3)
        assert done[request_id].token_ids == tokens
        assert_logprobs_match(done[request_id], reference)


def test_batch_unique_max_toks(demo, engine, prompts):
    """mlx-lm test_batch_unique_max_toks: each request's own max_tokens (2, 3, 4, 5) in one batch
    gives its single generation with that max_tokens."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=n))
           for p, n in zip(prompts, [2, 3, 4, 5], strict=True)]
    done = outputs_by_id(engine.run())
    for request_id, prompt, n in zip(ids, prompts, [2, 3, 4, 5], strict=True):
        assert done[request_id].token_ids == alone(demo, prompt, n)[0]
        assert done[request_id].finish_reason is FinishReason.LENGTH


def test_stream_generate_max_tokens(engine, prompts):
    """mlx-lm test_stream_generate_max_tokens: a stream asked for 4 tokens gives exactly 4."""
    parts = list(engine.stream_generate(prompts[0], max_tokens=4))
    assert parts[-1].finished and len(parts[-1].output.token_ids) == 4
    assert parts[-1].output.finish_reason is FinishReason.LENGTH


def test_batch_sliding_window(demo, prompts, monkeypatch):
    """mlx-lm test_batch_sliding_window: a model whose caches rotate (a window of 4 tokens)
    gives, batched, single generation's tokens and log-probabilities within 1e-4."""
    monkeypatch.setattr(demo.model, "make_cache",
                        lambda: [RotatingKVCache(max_size=4) for _ in demo.model.layers],
                        raising=False)
    e = _engine(demo, max_concurrency=2, prefill_batch_size=1)
    outs = e.generate(prompts, SamplingParams(max_tokens=8, logprobs=True))
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, reference = alone(demo, prompt, 8)
        assert out.token_ids == tokens
        assert_logprobs_match(out, reference)


# -- logits processors ----------------------------------------------------------------------------

def test_generate_with_logit_bias(demo, engine, prompts):
    """mlx-lm test_generate_with_logit_bias: a large bias on one token makes every token it; a
    small one changes the tokens exactly as mlx-lm's logit-bias processor does."""
    out = engine.generate(prompts[0], max_tokens=5, logit_bias=((33, 100.0), (1, -20.0)))
    assert out.token_ids == [33] * 5
    small = ((33, 4.0), (261, 3.0))
    got = engine.generate(prompts, max_tokens=6, logit_bias=small)
    for prompt, o in zip(prompts, got, strict=True):
        assert o.token_ids == alone(demo, prompt, 6, make_logits_processors(dict(small)))[0]


def test_batch_generate_with_logits_processors(demo, engine, prompts):
    """mlx-lm test_batch_generate_with_logits_processors: each request's own processors in one
    batch pick its token, whose log-probability is then 0."""
    ids = [engine.add_request(prompts[0], SamplingParams(max_tokens=1, logprobs=True,
                                                         logits_processors=[bias(t)]))
           for t in (3, 4, 5)]
    plain = engine.add_request(prompts[0], SamplingParams(max_tokens=1))
    done = outputs_by_id(engine.run())
    for request_id, t in zip(ids, (3, 4, 5), strict=True):
        assert done[request_id].token_ids == [t]
        assert done[request_id].logprobs == [0.0]
    assert done[plain].token_ids == alone(demo, prompts[0], 1)[0]  # its neighbours' left alone


def test_batch_generate_function_with_logits_processors(demo, engine, prompts):
    """mlx-lm test_batch_generate_function_with_logits_processors: processors given to the
    one-call generate shape its tokens as they shape mlx-lm's."""
    processors = make_logits_processors(logit_bias={0: -2000.0, 5: 3.0})
    outs = engine.generate(prompts, max_tokens=5, logits_processors=processors)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == alone(demo, prompt, 5, processors)[0]


def test_batch_generate_processor_tokens_match_prompt_on_first_step(engine, prompts):
    """mlx-lm test_batch_generate_processor_tokens_match_prompt_on_first_step: a processor's
    first call sees the prompt, as an array."""
    seen = []

    def processor(tokens, logits):
        seen.append(tokens)
        return logits

    engine.generate(prompts[3], max_tokens=1, logits_processors=[processor])
    assert hasattr(seen[0], "shape")
    assert seen[0].tolist() == prompts[3]


def test_generate_with_processor(engine, prompts):
    """mlx-lm test_generate_with_processor: a processor's calls see the row's tokens so far,
    the prompt then the generated ones; with max_tokens 5 its last call sees prompt + 5."""
    seen = []

    def processor(tokens, logits):
        seen.append(tokens.tolist())
        return logits

    out = engine.generate(prompts[2], max_tokens=5, logits_processors=[processor])
    full = prompts[2] + out.token_ids
    assert all(s == full[: len(s)] for s in seen)
    assert len(seen[-1]) == len(prompts[2]) + 5


# -- samplers -------------------------------------------------------------------------------------

def test_batch_generate_with_samplers(demo, engine, prompts):
    """mlx-lm test_batch_generate_with_samplers: each request's own sampler in one batch governs
    its row only: greedy rows beside sampled ones keep single greedy tokens, and a seeded row
    samples the same tokens batched, alone, and again."""
    params = [SamplingParams(max_tokens=6),
              SamplingParams(max_tokens=6, temperature=1.0, seed=1),
              SamplingParams(max_tokens=6, temperature=0.7, top_k=20, seed=2),
              SamplingParams(max_tokens=6)]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = outputs_by_id(engine.run())
    for i in (0, 3):
        assert done[ids[i]].token_ids == alone(demo, prompts[i], 6)[0]
    for i in (1, 2):
        again = engine.generate(prompts[i], params[i])
        assert done[ids[i]].token_ids == again.token_ids
        assert len(again.token_ids) == 6


def test_seeded_sampling_is_reproducible_and_seeds_differ(engine, prompts):
    """mlx-lm test_batch_generate_with_samplers: rows of the same prompt with different samplers
    give their own tokens; the same seed gives the same tokens."""
    outs = engine.generate([prompts[1]] * 3, max_tokens=8, temperature=1.0, seed=7)
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    other = engine.generate(prompts[1], max_tokens=8, temperature=1.0, seed=8)
    assert other.token_ids != outs[0].token_ids


# -- stopping -------------------------------------------------------------------------------------

def test_batch_generate_with_stop_matchers(engine, prompts):
    """mlx-lm test_batch_generate_with_stop_matchers: per-request stop tokens in one batch stop
    each row on its own token, finish reason stop, the stop token left out as batch_generate
    leaves it out."""
    ids = [engine.add_request(prompts[0], SamplingParams(
        max_tokens=8, logits_processors=[bias(t)], stop_token_ids=[t])) for t in (3, 4, 5)]
    free = engine.add_request(prompts[0], SamplingParams(max_tokens=8,
                                                         logits_processors=[bias(4)]))
    done = outputs_by_id(engine.run())
    for request_id in ids:
        assert done[request_id].token_ids == []
        assert done[request_id].finish_reason is FinishReason.STOP
    assert done[free].token_ids == [4] * 8  # 4 stops only the row that named it
    assert done[free].finish_reason is FinishReason.LENGTH


def test_stop_token_cuts_a_row_where_it_comes(demo, engine, prompts):
    """mlx-lm test_batch_generate_with_stop_matchers: a stop token the row generates of itself
    ends it there; the other rows run on to their single tokens."""
    tokens = alone(demo, prompts[2], 8)[0]
    cut = next(i for i in range(1, 8) if tokens[i] not in tokens[:i])
    stopped = engine.add_request(prompts[2], SamplingParams(max_tokens=8,
                                                            stop_token_ids=[tokens[cut]]))
    others = [engine.add_request(p, SamplingParams(max_tokens=8)) for p in prompts[:2]]
    done = outputs_by_id(engine.run())
    assert done[stopped].token_ids == tokens[:cut]
    assert done[stopped].finish_reason is FinishReason.STOP
    for request_id, prompt in zip(others, prompts[:2], strict=True):
        assert done[request_id].token_ids == alone(demo, prompt, 8)[0]


def test_eos_ends_a_row_with_stop(demo, engine, prompts):
    """mlx-lm BatchGenerator(stop_tokens=eos_token_ids): a row reaching end-of-sequence ends with
    reason stop and without it, as single generation ends, the batch's other rows unchanged."""
    eos = sorted(demo.tokenizer.eos_token_ids)[-1]
    prompt = prompts[0]

    def eos_after_two(tokens, logits):
        return bias(eos)(tokens, logits) if tokens.size >= len(prompt) + 2 else logits

    row = engine.add_request(prompt, SamplingParams(max_tokens=8,
                                                    logits_processors=[eos_after_two]))
    other = engine.add_request(prompts[1], SamplingParams(max_tokens=8))
    done = outputs_by_id(engine.run())
    want = alone(demo, prompt, 8, [eos_after_two])[0]
    assert len(want) == 2 and done[row].token_ids == want
    assert done[row].finish_reason is FinishReason.STOP
    assert done[other].token_ids == alone(demo, prompts[1], 8)[0]


# -- prompt caches, removal, insertion ------------------------------------------------------------

def test_batch_continued_generation(demo):
    """mlx-lm test_batch_continued_generation: a second turn that starts from what the first
    computed (batchrun's prefix cache) gives single generation's tokens and log-probabilities."""
    head = list(demo.tokenizer.encode("You answer questions in one short sentence. "))
    first = [head + list(demo.tokenizer.encode(t)) for t in TEXTS[:3]]
    cache = make_prefix_cache(FP, 1 << 30, None, block_size=16, layout=block_layout(demo.model))
    e = Engine(demo.model, demo.tokenizer, EngineConfig(max_concurrency=8, prefix_cache=True),
               demo.context_length, prefix_cache=cache, model_fingerprint=FP)
    turn_one = e.generate(first, max_tokens=4)
    for prompt, out in zip(first, turn_one, strict=True):
        assert out.token_ids == alone(demo, prompt, 4)[0]
    second = [p + o.token_ids + list(demo.tokenizer.encode(" And then?"))
              for p, o in zip(first, turn_one, strict=True)]
    turn_two = e.generate(second, SamplingParams(max_tokens=6, logprobs=True))
    for prompt, out in zip(second, turn_two, strict=True):
        tokens, reference = alone(demo, prompt, 6)
        assert out.cached_tokens >= 16  # started from the cache
        assert out.token_ids == tokens
        assert_logprobs_match(out, reference)


def test_remove_request_mid_batch(demo, engine, prompts):
    """mlx-lm BatchGenerator.remove: a request removed mid-generation ends at once (abort) and
    the batch's other rows give their single tokens."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=8)) for p in prompts]
    finished = []
    for _ in range(3):
        finished.extend(engine.step())
    assert engine.abort(ids[1])
    finished.extend(engine.run())
    done = outputs_by_id(finished)
    assert done[ids[1]].finish_reason is FinishReason.ABORT
    assert len(done[ids[1]].token_ids) < 8
    assert done[ids[1]].token_ids == alone(demo, prompts[1], 8)[0][: len(done[ids[1]].token_ids)]
    for i in (0, 2, 3):
        assert done[ids[i]].token_ids == alone(demo, prompts[i], 8)[0]


def test_remove_prompt_batch_updates_currently_processing(demo, prompts):
    """mlx-lm test_remove_prompt_batch_updates_currently_processing: removing a request whose
    prompt is still waiting to be processed leaves the others to finish with their tokens."""
    e = _engine(demo, max_concurrency=1)
    ids = [e.add_request(p, SamplingParams(max_tokens=5)) for p in prompts[:3]]
    finished = e.step()  # the first row runs; the others wait
    assert e.num_waiting == 2
    assert e.abort(ids[1])
    finished.extend(e.run())
    done = outputs_by_id(finished)
    assert sorted(done) == sorted(ids)
    assert done[ids[1]].finish_reason is FinishReason.ABORT and done[ids[1]].token_ids == []
    for i in (0, 2):
        assert done[ids[i]].token_ids == alone(demo, prompts[i], 5)[0]


def test_insert_into_a_running_batch(demo, engine, prompts):
    """mlx-lm BatchGenerator.insert between next() calls: requests joining a running batch give
    the same tokens as run alone, and so do the rows already running."""
    ids = {0: engine.add_request(prompts[0], SamplingParams(max_tokens=8))}
    finished = []
    for i in (1, 2, 3):
        finished.extend(engine.step())
        finished.extend(engine.step())
        ids[i] = engine.add_request(prompts[i], SamplingParams(max_tokens=8))
    finished.extend(engine.run())
    done = outputs_by_id(finished)
    for i, request_id in ids.items():
        assert done[request_id].token_ids == alone(demo, prompts[i], 8)[0]


# -- log-probabilities ----------------------------------------------------------------------------

def test_batch_generate_return_logprobs(demo, engine, prompts):
    """mlx-lm test_batch_generate_return_logprobs: asked for, each token has its logprob (<= 0),
    as many as tokens, equal to mlx-lm's within 1e-4; top alternatives are mlx-lm's best."""
    outs = engine.generate(prompts[:2], SamplingParams(max_tokens=5, logprobs=True,
                                                       top_logprobs=3))
    for prompt, out in zip(prompts[:2], outs, strict=True):
        tokens, reference = alone(demo, prompt, 5)
        assert out.token_ids == tokens and all(lp <= 0.0 for lp in out.logprobs)
        assert_logprobs_match(out, reference)
        assert len(out.top_logprobs) == len(tokens)
        for top, lp in zip(out.top_logprobs, reference, strict=True):
            best = sorted(range(lp.shape[-1]), key=lambda t: -lp[t].item())[:3]
            assert [t for t, _ in top] == best
            assert [v for _, v in top] == pytest.approx([lp[t].item() for t in best], abs=TOL)


def test_batch_generate_no_logprobs_by_default(engine, prompts):
    """mlx-lm test_batch_generate_no_logprobs_by_default: no logprobs unless asked."""
    out = engine.generate(prompts[0], max_tokens=3)
    assert out.logprobs is None and out.top_logprobs is None
