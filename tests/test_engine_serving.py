"""The engine as vllm-mlx's BatchedEngine offers it: one prompt or a list, chat, streams of
text as tokens arrive, awaitable calls in an event loop, many callers sharing the engine's
thread (start/stop), and clear errors after stop."""

import asyncio
import threading

import pytest

from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.serving import EngineStopped
from batchrun.engine.types import FinishReason, SamplingParams

CHAT = [{"role": "user", "content": "Say hello"}]


@pytest.fixture
def engine(demo):
    e = Engine(demo.model, demo.tokenizer, EngineConfig(max_concurrency=8, prefix_cache=False))
    yield e
    e.serving.stop()


def test_one_prompt_gives_its_output_and_a_list_one_each(engine):
    many = engine.generate(["Once upon a time", [1, 2, 3], CHAT], max_tokens=4)
    assert [type(o).__name__ for o in many] == ["Output"] * 3
    assert engine.generate("Once upon a time", max_tokens=4).token_ids == many[0].token_ids
    assert engine.generate(prompt="Once upon a time", max_tokens=4).token_ids == \
        many[0].token_ids
    assert engine.generate([1, 2, 3], max_tokens=4).token_ids == many[1].token_ids
    assert engine.chat(CHAT, max_tokens=4).token_ids == many[2].token_ids


def test_a_stream_gives_the_text_as_it_grows_and_ends_with_the_output(engine):
    want = engine.generate("Once upon a time", max_tokens=6)
    parts = list(engine.stream_generate("Once upon a time", max_tokens=6))
    assert parts[-1].finished and parts[-1].output.token_ids == want.token_ids
    assert not any(p.finished for p in parts[:-1]) and len(parts) > 1
    assert "".join(p.new_text for p in parts) == want.text == parts[-1].text
    assert all(len(a.token_ids) <= len(b.token_ids) for a, b in zip(parts[:-1], parts[1:],
                                                                     strict=True))


def test_awaited_calls_share_the_engines_batch_and_give_the_same_tokens(engine):
    prompts = [f"Row {i} says" for i in range(6)]
    want = engine.generate(prompts, max_tokens=5)
    chat = engine.chat(CHAT, max_tokens=5)

    async def main():
        outs = await asyncio.gather(*(engine.generate(p, max_tokens=5) for p in prompts),
                                    engine.chat(CHAT, max_tokens=5))
        streamed = [s async for s in engine.stream_chat(CHAT, max_tokens=5)]
        return outs, streamed

    outs, streamed = asyncio.run(main())
    assert [o.token_ids for o in outs] == [o.token_ids for o in want] + [chat.token_ids]
    assert streamed[-1].finished and streamed[-1].output.token_ids == chat.token_ids
    assert engine.stats.mean_batch_size > 1  # the callers' rows ran together


def test_callers_on_many_threads_share_the_started_engine(engine):
    prompts = [f"Thread {i} writes" for i in range(8)]
    want = [o.token_ids for o in engine.generate(prompts, max_tokens=4)]
    engine.start()
    got = [None] * len(prompts)

    def call(i):
        got[i] = engine.generate(prompts[i], max_tokens=4).token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want


def test_stop_ends_running_requests_and_a_later_call_is_a_clear_error(engine):
    engine.start()
    # min_tokens bars EOS, so only stop() can end the row however slowly this thread reads
    stream = iter(engine.stream_generate("Once upon a time", max_tokens=10_000,
                                         min_tokens=10_000))
    first = next(stream)
    assert not first.finished
    request_id = first.request_id
    assert engine.get_stats()["running"] + engine.get_stats()["waiting"] >= 1
    engine.stop()
    last = list(stream)[-1]
    assert last.finished and last.finish_reason is FinishReason.ABORT
    assert last.request_id == request_id
    for call in (lambda: engine.generate("hi"), lambda: engine.chat(CHAT), engine.start):
        with pytest.raises(EngineStopped, match="stopped"):
            call()
    assert engine.model is None  # the weights are let go


def test_the_seed_engines_names(engine):
    request_id = engine.add_request("Once upon a time", SamplingParams(max_tokens=50))
    assert engine.abort_request(request_id) and not engine.abort_request(10_000)
    (out,) = engine.run()
    assert out.finish_reason is FinishReason.ABORT
    stats = engine.get_stats()
    assert stats["requests_finished"] >= 1 and {"prompt_tokens", "completion_tokens",
                                                "peak_memory_bytes"} <= set(stats)
    assert engine.is_mllm is False and isinstance(engine.model_name, str)
    done = engine.generate("Once upon a time", max_tokens=3)
    assert done.usage == {"prompt_tokens": done.prompt_tokens, "completion_tokens": 3,
                          "total_tokens": done.prompt_tokens + 3, "cached_tokens": 0}
    engine.clear_runtime_caches()


def test_a_caller_may_choose_request_ids_and_a_duplicate_is_refused(engine):
    assert engine.add_request("Once upon a time", SamplingParams(max_tokens=3),
                              request_id="mine-1") == "mine-1"
    with pytest.raises(ValueError, match="'mine-1' is already in use"):
        engine.add_request("Again", SamplingParams(max_tokens=3), request_id="mine-1")
    engine.add_request("The sea", SamplingParams(max_tokens=50), request_id="mine-2")
    assert engine.abort_request("mine-2")
    outs = {o.request_id: o for o in engine.run()}
    assert set(outs) == {"mine-1", "mine-2"}
    assert outs["mine-2"].finish_reason is FinishReason.ABORT
    # once finished, the id is free again
    assert engine.add_request("Once upon a time", SamplingParams(max_tokens=3),
                              request_id="mine-1") == "mine-1"
    (again,) = engine.run()
    assert again.request_id == "mine-1" and again.token_ids == outs["mine-1"].token_ids
