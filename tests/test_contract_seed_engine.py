"""vllm-mlx's BatchedEngine, as its own tests check it, on batchrun's Engine: a user who
changes the import keeps these behaviours. Each test names the seed behaviour it ports; where
batchrun differs from the seed on purpose (greedy when a call names no temperature, stop()
being final) the test asserts batchrun's documented behaviour and says so.

Rows that must still be running when a test acts on them ask for 10,000 tokens and are
aborted or stopped; every other row asks for at most 8."""

import asyncio
import contextlib
import copy
import threading
import time

import mlx.core as mx
import pytest

from batchrun.engine import engine as engine_module
from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.serving import EngineStopped
from batchrun.engine.types import SamplingParams
from batchrun.models import RANDOM_DEMO_MODEL

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Say hello"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
LONG = 10_000  # a row still running whenever the test looks


def _engine(demo, prefix_cache: bool = False, **kwargs) -> Engine:
    return Engine(demo.model, demo.tokenizer,
                  EngineConfig(max_concurrency=8, prefix_cache=prefix_cache), **kwargs)


@pytest.fixture
def engine(demo):
    e = _engine(demo)
    yield e
    # A test that finds stop() failing asserts it itself; here it only lets go.
    with contextlib.suppress(RuntimeError):
        e.stop()


def _live(engine: Engine) -> int:
    stats = engine.get_stats()
    return stats["running"] + stats["waiting"]


def _wait_until(condition, timeout: float = 3.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


async def _await_until(condition, timeout: float = 3.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        await asyncio.sleep(0.02)
    return condition()


def _force(token: int):
    """A logits processor (mlx-lm's form) that leaves only `token` possible."""
    def processor(tokens, logits):
        keep = mx.arange(logits.shape[-1]) == token
        return mx.where(keep, mx.zeros_like(logits), mx.full(logits.shape, -1e9, logits.dtype))
    return processor


# -- generate: one prompt, lists, fields ----------------------------------------------------------

def test_generate_fills_text_tokens_and_counts(engine):
    """Seed: generate() returns text, prompt_tokens, completion_tokens and finish_reason."""
    out = engine.generate(prompt=PROMPT, max_tokens=5)
    assert isinstance(out.text, str) and out.text
    assert out.prompt_tokens == len(engine.tokenizer.encode(PROMPT))
    assert out.completion_tokens == len(out.token_ids) == 5
    assert out.finish_reason == "length"  # compares as the seed's plain string
    assert out.text == engine.tokenizer.decode(out.token_ids)


def test_generate_output_has_the_seeds_tokens_field(engine):
    """Seed: GenerationOutput.tokens holds the generated token ids."""
    out = engine.generate(PROMPT, max_tokens=3)
    # the seed's name for them, beside batchrun's token_ids
    assert out.tokens == out.token_ids


def test_a_list_of_prompts_gives_one_output_each_in_order(engine):
    """Seed (generate_batch_sync): outputs come back in the order of the prompts."""
    prompts = ["The sea", PROMPT, "A cat"]
    outs = engine.generate(prompts, max_tokens=4)
    alone = [engine.generate(p, max_tokens=4).token_ids for p in prompts]
    assert [o.token_ids for o in outs] == alone
    assert [o.prompt_tokens for o in outs] == \
        [len(engine.tokenizer.encode(p)) for p in prompts]


def test_a_prompt_of_token_ids_is_the_same_as_its_text(engine):
    """Seed: a request's prompt may be text or token ids."""
    ids = list(engine.tokenizer.encode(PROMPT))
    assert engine.generate(ids, max_tokens=4).token_ids == \
        engine.generate(PROMPT, max_tokens=4).token_ids


def test_max_tokens_one_gives_exactly_one_token(engine):
    """Seed: max_tokens=1 generates exactly one token, streamed or not."""
    assert len(engine.generate(PROMPT, max_tokens=1).token_ids) == 1
    parts = list(engine.stream_generate(PROMPT, max_tokens=1))
    assert parts[-1].finished and len(parts[-1].token_ids) == 1


def test_an_empty_prompt_still_finishes(engine):
    """Seed: an empty prompt completes; batchrun (documented: every request ends as one
    Output) ends it at once with finish_reason error and says why."""
    out = engine.generate("", max_tokens=3)
    assert out.finish_reason == "error" and "empty" in out.error and out.token_ids == []
    parts = list(engine.stream_generate("", max_tokens=3))
    assert parts[-1].finished and parts[-1].finish_reason == "error"


def test_usage_adds_prompt_and_completion_tokens(engine):
    """Seed: RequestOutput.usage gives prompt, completion and total tokens."""
    out = engine.generate(PROMPT, max_tokens=4)
    usage = out.usage
    assert usage["prompt_tokens"] == out.prompt_tokens
    assert usage["completion_tokens"] == 4
    assert usage["total_tokens"] == out.prompt_tokens + 4


# -- sampling -------------------------------------------------------------------------------------

def test_no_temperature_named_is_greedy(engine):
    """Seed: temperature 0 is deterministic. The seed samples at 0.7/0.9 when a call names
    none; batchrun stays greedy (documented), so the default equals temperature=0."""
    default = engine.generate(PROMPT, max_tokens=6).token_ids
    assert default == engine.generate(PROMPT, max_tokens=6, temperature=0.0).token_ids
    assert SamplingParams().temperature == 0.0 and SamplingParams().max_tokens == 256


def test_the_same_prompt_gives_the_same_output_in_new_engines(demo):
    """Seed: with temperature 0 the same prompt gives the same output on every run."""
    texts = []
    for _ in range(2):
        e = _engine(demo)
        try:
            texts.append(e.generate(PROMPT, max_tokens=6, temperature=0.0).text)
        finally:
            e.stop()
    assert texts[0] == texts[1]


def test_the_seeds_sampling_keywords_are_taken(engine):
    """Seed: generate takes temperature, top_p, top_k, min_p, presence_penalty and
    repetition_penalty as keywords."""
    out = engine.generate(PROMPT, max_tokens=4, temperature=0.7, top_p=0.9, top_k=0,
                          min_p=0.0, presence_penalty=0.0, repetition_penalty=1.0, seed=3)
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    # top_k=1 leaves one choice: sampling at any temperature is then greedy
    assert engine.generate(PROMPT, max_tokens=4, temperature=1.0, top_k=1,
                           seed=5).token_ids == engine.generate(PROMPT, max_tokens=4).token_ids


def test_a_seed_makes_sampling_reproducible_alone_or_batched(engine):
    """Seed: sampled output with a fixed seed is reproducible (batchrun: per request, so the
    row's companions in the batch change nothing)."""
    first = engine.generate(PROMPT, max_tokens=8, temperature=1.0, seed=7).token_ids
    assert engine.generate(PROMPT, max_tokens=8, temperature=1.0, seed=7).token_ids == first
    batched = engine.generate([PROMPT, "The sea", "A cat"], max_tokens=8, temperature=1.0,
                              seed=7)
    assert batched[0].token_ids == first
    assert engine.generate(PROMPT, max_tokens=8, temperature=1.0, seed=8).token_ids != first


def test_a_stop_string_cuts_the_text_before_it(engine):
    """Seed: stop sequences end the request (finish_reason stop), across tokens too."""
    want = engine.generate(PROMPT, max_tokens=8)
    boundary = len(engine.tokenizer.decode(want.token_ids[:1]))
    stop = want.text[boundary - 1: boundary + 2]  # spans the first two tokens
    out = engine.generate(PROMPT, max_tokens=8, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == want.text[:want.text.index(stop)]


def test_stop_token_ids_end_the_row(engine):
    """Seed: SamplingParams.stop_token_ids end generation at that token."""
    want = engine.generate(PROMPT, max_tokens=8).token_ids
    stop_at = want.index(want[3])  # its first place
    out = engine.generate(PROMPT, max_tokens=8, stop_token_ids=[want[3]])
    assert out.finish_reason == "stop" and out.token_ids == want[:stop_at]


def test_none_for_stop_means_no_stops(engine):
    """Seed: SamplingParams(stop=None, stop_token_ids=None) means no stops (generate's
    default is stop=None)."""
    want = engine.generate(PROMPT, max_tokens=4).token_ids
    # None is "no stops", as the seed reads it
    assert engine.generate(PROMPT, max_tokens=4, stop=None).token_ids == want
    assert engine.generate(PROMPT, max_tokens=4, stop_token_ids=None).token_ids == want


def test_logits_processors_steer_each_row_and_see_its_tokens(engine):
    """Seed: generate passes logits_processors (mlx-lm's processor(tokens, logits)) on."""
    seen = []

    def record(tokens, logits):
        seen.append(tokens.tolist())
        return logits

    out = engine.generate(PROMPT, max_tokens=3, logits_processors=[record, _force(42)])
    assert out.token_ids == [42, 42, 42]
    prompt = list(engine.tokenizer.encode(PROMPT))
    # one call a step, each with the row's tokens so far
    assert len(seen) >= 3 and all(t == prompt + [42] * k for k, t in enumerate(seen))
    outs = engine.generate([PROMPT, "The sea"], max_tokens=3, logits_processors=[_force(7)])
    assert [o.token_ids for o in outs] == [[7, 7, 7]] * 2


# -- chat -----------------------------------------------------------------------------------------

def test_chat_renders_the_whole_conversation_with_the_template(engine):
    """Seed: chat applies the tokenizer's chat template (with the generation prompt) to
    every message and generates from it."""
    conversation = [{"role": "system", "content": "Be brief."}, *CHAT]
    out = engine.chat(conversation, max_tokens=4)
    rendered = engine.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    assert out.prompt_tokens == len(rendered)
    assert out.token_ids == engine.generate(list(rendered), max_tokens=4).token_ids


def test_chat_with_tools_puts_them_in_the_template(engine):
    """Seed: chat(tools=...) hands the tools to the chat template."""
    out = engine.chat(CHAT, tools=TOOLS, max_tokens=4)
    rendered = engine.tokenizer.apply_chat_template(CHAT, tools=TOOLS,
                                                    add_generation_prompt=True)
    assert out.prompt_tokens == len(rendered) > engine.chat(CHAT, max_tokens=1).prompt_tokens
    assert out.token_ids == engine.generate(list(rendered), max_tokens=4).token_ids


def test_chat_template_kwargs_and_enable_thinking_reach_the_template(engine):
    """Seed: chat_template_kwargs and a per-request enable_thinking go to the template."""
    rendered = engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                    enable_thinking=False)
    by_kwargs = engine.chat(CHAT, max_tokens=2,
                            chat_template_kwargs={"enable_thinking": False})
    by_flag = engine.chat(CHAT, max_tokens=2, enable_thinking=False)
    assert by_kwargs.prompt_tokens == by_flag.prompt_tokens == len(rendered)


def test_a_replayed_tool_call_with_string_arguments_renders_as_a_mapping(engine):
    """Seed: OpenAI tool-call replay (arguments as a JSON string) is normalized for the
    template, and the caller's messages are left as they were."""
    def conversation(arguments):
        return [{"role": "user", "content": "Weather in Tokyo?"},
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]

    as_text = conversation('{"city": "Tokyo"}')
    kept = copy.deepcopy(as_text)
    a = engine.chat(as_text, tools=TOOLS, max_tokens=4)
    b = engine.chat(conversation({"city": "Tokyo"}), tools=TOOLS, max_tokens=4)
    assert (a.prompt_tokens, a.token_ids) == (b.prompt_tokens, b.token_ids)
    assert as_text == kept


# -- streams --------------------------------------------------------------------------------------

def test_stream_generate_yields_growing_text_and_ends_finished(engine):
    """Seed: stream_generate yields outputs with new_text as tokens arrive; only the last
    one is finished and carries the finish reason."""
    want = engine.generate(PROMPT, max_tokens=6)
    parts = list(engine.stream_generate(PROMPT, max_tokens=6))
    assert [p.finished for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].finish_reason == "length" and parts[-1].text == want.text
    assert "".join(p.new_text for p in parts) == want.text
    for before, after in zip(parts[:-1], parts[1:], strict=True):  # token order is kept
        assert after.token_ids[:len(before.token_ids)] == before.token_ids
    assert parts[-1].token_ids == want.token_ids


def test_stream_parts_carry_the_seeds_token_counts(engine):
    """Seed: each streamed output carries prompt_tokens and completion_tokens."""
    parts = list(engine.stream_generate(PROMPT, max_tokens=4))
    # the counts the seed's streaming consumers read
    assert [p.completion_tokens for p in parts] == [len(p.token_ids) for p in parts]
    assert parts[-1].prompt_tokens == len(engine.tokenizer.encode(PROMPT))


def test_async_stream_generate_gives_the_generated_output(engine):
    """Seed: stream_generate is an async iterator; its last output is the whole answer."""
    want = engine.generate(PROMPT, max_tokens=5)

    async def main():
        return [p async for p in engine.stream_generate(PROMPT, max_tokens=5)]

    parts = asyncio.run(main())
    assert parts[-1].finished and parts[-1].output.token_ids == want.token_ids
    assert "".join(p.new_text for p in parts) == want.text


def test_stream_chat_with_tools_sync_and_async_match_chat(engine):
    """Seed: stream_chat streams what chat answers, tools included."""
    want = engine.chat(CHAT, tools=TOOLS, max_tokens=5)
    parts = list(engine.stream_chat(CHAT, tools=TOOLS, max_tokens=5))

    async def main():
        return [p async for p in engine.stream_chat(CHAT, tools=TOOLS, max_tokens=5)]

    for got in (parts, asyncio.run(main())):
        assert got[-1].finished and got[-1].output.token_ids == want.token_ids
        assert got[-1].output.prompt_tokens == want.prompt_tokens
        assert "".join(p.new_text for p in got) == want.text


# -- awaitable calls, concurrent callers ----------------------------------------------------------

def test_generate_and_chat_are_awaitable_in_an_event_loop(engine):
    """Seed: generate and chat are awaited inside an event loop."""
    want = engine.generate(PROMPT, max_tokens=4)
    want_chat = engine.chat(CHAT, max_tokens=4)

    async def main():
        one = await engine.generate(prompt=PROMPT, max_tokens=4)
        many = await engine.generate([PROMPT, "The sea"], max_tokens=4)
        chat = await engine.chat(CHAT, max_tokens=4)
        return one, many, chat

    one, many, chat = asyncio.run(main())
    assert one.token_ids == many[0].token_ids == want.token_ids
    assert chat.token_ids == want_chat.token_ids


def test_concurrent_identical_requests_get_identical_outputs(engine):
    """Seed: concurrent requests with the same prompt at temperature 0 all get the same
    output, batched together."""
    async def main():
        return await asyncio.gather(*(engine.generate(PROMPT, max_tokens=6, temperature=0.0)
                                      for _ in range(4)))

    outs = asyncio.run(main())
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert all(o.completion_tokens == 6 for o in outs)
    assert engine.stats.mean_batch_size > 1


def test_concurrent_different_prompts_are_deterministic_across_runs(demo):
    """Seed: concurrent different prompts give the same results on a second run."""
    prompts = ["Capital of France:", "Capital of Spain:", "Capital of Italy:"]
    runs = []
    for _ in range(2):
        e = _engine(demo)
        e.start()
        got = [None] * len(prompts)

        def call(i, e=e, got=got):
            got[i] = e.generate(prompts[i], max_tokens=5, temperature=0.0).text

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        e.stop()
        runs.append(got)
    assert None not in runs[0] and runs[0] == runs[1]


# -- lifecycle: start, stop -----------------------------------------------------------------------

def test_start_twice_is_harmless(engine):
    """Seed: start() on a started engine returns at once."""
    engine.start()
    engine.start()
    assert engine.generate(PROMPT, max_tokens=3).completion_tokens == 3


def test_start_stop_and_abort_request_can_be_awaited(engine):
    """Seed: start(), abort_request() and stop() are coroutines: `await engine.start()`."""
    async def main():
        # inside a loop they may be awaited, as the seed's are (and called plainly too)
        await engine.start()
        assert await engine.abort_request("no-such-request") is False
        await engine.stop()

    asyncio.run(main())


def test_stop_ends_a_running_async_stream_with_abort(engine):
    """Seed: stop() ends the requests still running; their consumers hear of it."""
    async def main():
        parts = []
        async for part in engine.stream_generate(PROMPT, max_tokens=LONG):
            parts.append(part)
            if len(parts) == 1:
                # a thread, as another caller would: stop() waits for the engine's thread
                threading.Thread(target=engine.stop).start()
        return parts

    parts = asyncio.run(main())
    assert parts[-1].finished and parts[-1].finish_reason == "abort"
    assert len(parts[-1].token_ids) < LONG


def test_stop_releases_the_model_and_mlx_buffer_cache(engine, monkeypatch):
    """Seed: stop() lets go of the model and calls mx.clear_cache()."""
    engine.generate(PROMPT, max_tokens=2)
    calls = []
    monkeypatch.setattr(engine_module.mx, "clear_cache", lambda: calls.append(1))
    engine.stop()
    assert calls and engine.model is None


def test_stop_twice_is_harmless(engine):
    """Seed: stop() on a stopped engine does nothing more."""
    engine.stop()
    engine.stop()


def test_calls_after_stop_raise_engine_stopped(engine):
    """Seed: work submitted after stop() raises EngineStopped (a RuntimeError). The seed's
    start() loads the model again; batchrun's stop() is final (documented)."""
    engine.stop()
    assert issubclass(EngineStopped, RuntimeError)
    calls = [lambda: engine.generate(PROMPT, max_tokens=2),
             lambda: engine.chat(CHAT, max_tokens=2),
             lambda: list(engine.stream_generate(PROMPT, max_tokens=2)),
             lambda: list(engine.stream_chat(CHAT, max_tokens=2)),
             lambda: engine.add_request(PROMPT, SamplingParams(max_tokens=2)),
             engine.start]
    for call in calls:
        with pytest.raises(EngineStopped):
            call()

    async def main():
        with pytest.raises(EngineStopped):
            await engine.generate(PROMPT, max_tokens=2)
        with pytest.raises(EngineStopped):
            async for _ in engine.stream_chat(CHAT, max_tokens=2):
                pass

    asyncio.run(main())


# -- request ids and aborts -----------------------------------------------------------------------

def test_a_caller_chosen_request_id_is_kept_and_a_duplicate_refused(engine):
    """Seed: add_request(request_id=...) uses the caller's id; adding a request whose id is
    in use is a ValueError."""
    assert engine.add_request(PROMPT, SamplingParams(max_tokens=3),
                              request_id="req-1") == "req-1"
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("The sea", SamplingParams(max_tokens=3), request_id="req-1")
    (out,) = engine.run()
    assert out.request_id == "req-1" and out.completion_tokens == 3
    assert out.token_ids == engine.generate(PROMPT, max_tokens=3).token_ids


def test_abort_request_of_a_waiting_request(engine):
    """Seed: aborting a queued request by its id removes it; it finishes aborted."""
    engine.add_request(PROMPT, SamplingParams(max_tokens=LONG), request_id="test-1")
    assert engine.get_stats()["waiting"] == 1
    assert engine.abort_request("test-1") is True
    assert _live(engine) == 0
    (out,) = engine.run()
    assert out.request_id == "test-1" and out.finish_reason == "abort"


def test_abort_request_of_an_unknown_id_is_false(engine):
    """Seed: BatchedEngine.abort_request answers a bool. The seed's scheduler defers aborts
    and answers True for any id; batchrun answers False for an id it does not hold."""
    assert engine.abort_request("nonexistent") is False
    assert engine.abort_request(12345) is False


def test_abort_request_mid_stream_ends_it_and_frees_the_engine(engine):
    """Seed: aborting a request after a few streamed tokens ends it; no request stays
    active."""
    stream = iter(engine.stream_generate(PROMPT, max_tokens=LONG))
    first = next(stream)
    assert engine.abort_request(first.request_id) is True
    last = list(stream)[-1]
    assert last.finished and last.finish_reason == "abort"
    assert _wait_until(lambda: _live(engine) == 0)


def test_leaving_a_stream_early_aborts_its_request(engine):
    """Seed: a stream whose consumer goes away before the end aborts its request."""
    stream = iter(engine.stream_generate(PROMPT, max_tokens=LONG))
    first = next(stream)
    stream.close()
    try:
        # a stream its reader left stops its request
        assert _wait_until(lambda: _live(engine) == 0), "the left request still runs"
    finally:
        engine.abort_request(first.request_id)


def test_leaving_an_async_stream_early_aborts_its_request(engine):
    """Seed: an async stream closed before its end aborts its request."""
    async def main():
        stream = engine.stream_generate(PROMPT, max_tokens=LONG).__aiter__()
        await stream.__anext__()
        await stream.aclose()
        gone = await _await_until(lambda: _live(engine) == 0)
        engine.stop()  # before the loop closes (see the test below)
        return gone

    # an async stream closed early stops its request
    assert asyncio.run(main()), "the left request still runs"


def test_cancelling_an_awaited_generate_aborts_its_request(engine):
    """Seed: a generate() whose awaiting caller is cancelled aborts its request."""
    async def main():
        task = asyncio.ensure_future(engine.generate(PROMPT, max_tokens=LONG))
        assert await _await_until(lambda: _live(engine) == 1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        gone = await _await_until(lambda: _live(engine) == 0)
        engine.stop()  # before the loop closes (see the tests below)
        return gone

    # a cancelled caller's request stops
    assert asyncio.run(main()), "the cancelled request still runs"


def test_a_stream_left_in_a_closed_loop_does_not_break_later_callers(engine):
    """Seed: a consumer that went away (its stream aborted on exit) leaves the engine
    serving other callers."""
    want = engine.generate("The sea", max_tokens=3).token_ids

    async def leave():
        async for _ in engine.stream_generate(PROMPT, max_tokens=300):
            break  # the loop then closes with the stream unfinished

    async def later():
        return await engine.generate("The sea", max_tokens=3)

    asyncio.run(leave())
    time.sleep(0.2)  # the engine's thread steps the left row
    # a caller whose event loop closed never stops the engine's thread for the others
    assert asyncio.run(later()).token_ids == want


def test_stop_after_a_cancelled_callers_loop_closed_returns(engine):
    """Seed: stop() ends cleanly whatever callers went away (it aborts what still runs)."""
    async def cancel():
        task = asyncio.ensure_future(engine.generate(PROMPT, max_tokens=LONG))
        assert await _await_until(lambda: _live(engine) == 1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(cancel())
    # stop() with a departed caller's loop closed still stops cleanly
    engine.stop()
    with pytest.raises(EngineStopped):
        engine.generate(PROMPT, max_tokens=2)


# -- stats, caches, names -------------------------------------------------------------------------

def test_get_stats_counts_finished_requests_and_nothing_active(engine):
    """Seed: get_stats starts with nothing running or waiting and, after a request,
    counts it and its completion tokens (batchrun's documented key names)."""
    stats = engine.get_stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    engine.generate(PROMPT, max_tokens=4)
    stats = engine.get_stats()
    assert stats["requests_finished"] >= 1 and stats["completion_tokens"] >= 4
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert {"prompt_tokens", "mean_batch_size", "peak_memory_bytes"} <= set(stats)


def test_get_cache_stats_is_none_without_a_cache_and_a_dict_with_one(demo, engine):
    """Seed: get_cache_stats() is None without a prefix cache, else its figures."""
    assert engine.get_cache_stats() is None
    cached = _engine(demo, prefix_cache=True)
    try:
        cached.enable_prefix_cache()
        prompt = "word " * 150  # more than two 64-token blocks
        first = cached.generate(prompt, max_tokens=2)
        again = cached.generate(prompt, max_tokens=2)
        stats = cached.get_cache_stats()
        assert isinstance(stats, dict) and stats["blocks"] >= 1
        assert again.cached_tokens > 0 and again.token_ids == first.token_ids
        cached.clear_prefix_cache()
        assert cached.get_cache_stats()["blocks"] == 0
    finally:
        cached.stop()


def test_clear_runtime_caches_leaves_outputs_alone(engine):
    """Seed: clear_runtime_caches() may be called between requests."""
    want = engine.generate(PROMPT, max_tokens=4).token_ids
    engine.clear_runtime_caches()
    assert engine.generate(PROMPT, max_tokens=4).token_ids == want


def test_model_name_tokenizer_and_is_mllm(demo, engine):
    """Seed: model_name, tokenizer and is_mllm properties (a text model is not an MLLM)."""
    named = _engine(demo, model_path=str(RANDOM_DEMO_MODEL))
    try:
        assert named.model_name == RANDOM_DEMO_MODEL.name
    finally:
        named.stop()
    assert isinstance(engine.model_name, str) and engine.model_name
    assert engine.is_mllm is False
    ids = engine.tokenizer.encode(PROMPT)
    assert engine.tokenizer.decode(ids).strip() == PROMPT
