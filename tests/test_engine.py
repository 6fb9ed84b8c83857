"""The engine on the real demo model: batching must not change what a row generates."""

import mlx.core as mx
import pytest
from mlx_lm.generate import batch_generate, generate_step

from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.types import FinishReason, SamplingParams

PROMPTS = [
    "Explain recursion",
    "I bought this kettle last month and it is sturdy and quiet. I would recommend it.",
    "hi",
    "Write a short poem about plate tectonics.",
    "List three facts about the immune system. " * 6,
    "The quick brown fox",
    "What is the most common misconception about vaccines?",
    "Give an analogy for binary search.",
    "My new tent",
    "Summarize supply and demand for a ten year old. " * 3,
]


def make_engine(demo, **config) -> Engine:
    return Engine(demo.model, demo.tokenizer, EngineConfig(**config), demo.context_length)


def reference_tokens(demo, prompt: str, max_tokens: int) -> list[int]:
    """mlx-lm's own single-prompt greedy generation, stopped at EOS like the engine."""
    ids = mx.array(demo.tokenizer.encode(prompt))
    out = []
    for token, _ in generate_step(ids, demo.model, max_tokens=max_tokens):
        token = int(token)
        if token in demo.tokenizer.eos_token_ids:
            break
        out.append(token)
    return out


@pytest.mark.parametrize("concurrency", [1, 4, 32])
def test_greedy_matches_mlx_lm_generate_at_any_concurrency(demo, concurrency):
    engine = make_engine(demo, max_concurrency=concurrency)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=24))
    assert [o.request_id for o in outs] == list(range(len(PROMPTS)))
    texts = batch_generate(demo.model, demo.tokenizer,
                           [demo.tokenizer.encode(p) for p in PROMPTS], max_tokens=24).texts
    for prompt, out, text in zip(PROMPTS, outs, texts, strict=True):
        assert out.token_ids == reference_tokens(demo, prompt, 24), prompt
        assert out.text == text  # the text mlx-lm's batch_generate gives
        ended = FinishReason.LENGTH if len(out.token_ids) == 24 else FinishReason.STOP
        assert out.finish_reason is ended


def test_seeded_sampling_does_not_depend_on_batch_composition(demo):
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234)
    alone = make_engine(demo, max_concurrency=1).generate([PROMPTS[0]], params)[0]

    engine = make_engine(demo, max_concurrency=8)
    for i, p in enumerate(PROMPTS[1:6]):
        engine.add_request(p, SamplingParams(max_tokens=10 + i, temperature=0.7, seed=i))
    target = engine.add_request(PROMPTS[0], params)
    for p in PROMPTS[6:]:
        engine.add_request(p, SamplingParams(max_tokens=30, temperature=1.2, top_k=5, seed=99))
    crowded = {o.request_id: o for o in engine.run()}[target]
    assert crowded.token_ids == alone.token_ids

    other_seed = make_engine(demo, max_concurrency=1).generate(
        [PROMPTS[0]], SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=4321))[0]
    assert other_seed.token_ids != alone.token_ids  # the seed does matter


def test_stop_string_spanning_tokens_cuts_the_text_before_it(demo):
    engine = make_engine(demo)
    free = engine.generate([PROMPTS[3]], SamplingParams(max_tokens=40))[0]
    # A stop string made of the end of token 5 and the start of token 6.
    t5 = demo.tokenizer.decode(free.token_ids[:6])
    t6 = demo.tokenizer.decode(free.token_ids[:7])
    cut = len(demo.tokenizer.decode(free.token_ids[:5])) + 1
    stop = t6[cut: len(t5) + 2]
    assert len(stop) >= 2 and stop not in t5 and len(t5) < len(t6)
    expected = free.text[: free.text.find(stop)]

    out = make_engine(demo).generate([PROMPTS[3]], SamplingParams(max_tokens=40, stop=(stop,)))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.text == expected
    assert len(out.token_ids) < 40  # it stopped generating, too


def test_stop_token_ids_end_a_row_without_their_token(demo):
    free = make_engine(demo).generate([PROMPTS[0]], SamplingParams(max_tokens=30))[0]
    stop_id = free.token_ids[7]
    first = free.token_ids.index(stop_id)
    out = make_engine(demo).generate(
        [PROMPTS[0]], SamplingParams(max_tokens=30, stop_token_ids=(stop_id,)))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.token_ids == free.token_ids[:first]


def test_abort_mid_generation(demo):
    engine = make_engine(demo, max_concurrency=4)
    ids = [engine.add_request(p, SamplingParams(max_tokens=30)) for p in PROMPTS[:3]]
    outputs = []
    for _ in range(6):
        outputs += engine.step()
    assert engine.abort(ids[1])
    assert not engine.abort(12345)
    outputs += engine.run()
    by_id = {o.request_id: o for o in outputs}
    assert len(outputs) == 3
    aborted = by_id[ids[1]]
    assert aborted.finish_reason is FinishReason.ABORT
    assert 0 < len(aborted.token_ids) < 30
    assert aborted.token_ids == reference_tokens(demo, PROMPTS[1], 30)[: len(aborted.token_ids)]
    for i in (0, 2):
        assert by_id[ids[i]].token_ids == reference_tokens(demo, PROMPTS[i], 30)


def test_abort_of_a_queued_request(demo):
    engine = make_engine(demo, max_concurrency=1)
    first = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=5))
    queued = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=5))
    engine.step()
    assert engine.abort(queued)
    by_id = {o.request_id: o for o in engine.run()}
    assert by_id[queued].finish_reason is FinishReason.ABORT and by_id[queued].token_ids == []
    assert by_id[first].finish_reason is FinishReason.LENGTH


def test_memory_limit_admits_only_what_fits(demo):
    probe = make_engine(demo)
    per_token = probe.memory.footprint.per_token
    prompt_len = len(demo.tokenizer.encode(PROMPTS[0]))
    length = prompt_len + 16
    # Room for exactly two such sequences in the padded batch layout.
    engine = make_engine(demo, kv_budget_bytes=2 * length * per_token + per_token // 2)
    for _ in range(6):
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=16))
    too_big = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=200))
    outputs, peak = [], 0
    while engine.has_work():
        outputs += engine.step()
        peak = max(peak, engine.num_running)
    assert peak == 2
    by_id = {o.request_id: o for o in outputs}
    assert by_id[too_big].finish_reason is FinishReason.ERROR
    assert "KV cache" in by_id[too_big].error
    done = [o for o in outputs if o.request_id != too_big]
    assert len(done) == 6 and all(o.finish_reason is FinishReason.LENGTH for o in done)
    assert len({tuple(o.token_ids) for o in done}) == 1


def test_prompt_longer_than_the_context_is_an_error(demo):
    engine = make_engine(demo)
    rid = engine.add_request(list(range(10)) * (demo.context_length // 10 + 1))
    (out,) = engine.run()
    assert out.request_id == rid and out.finish_reason is FinishReason.ERROR
    assert "context" in out.error


def test_logprobs_are_those_of_the_sampled_tokens(demo):
    engine = make_engine(demo)
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, logprobs=True,
                                                       top_logprobs=3))[0]
    assert len(out.logprobs) == len(out.top_logprobs) == 6
    for lp, top, token in zip(out.logprobs, out.top_logprobs, out.token_ids, strict=True):
        assert lp <= 0
        assert top[0][0] == token  # greedy: the sampled token is the most likely one
        assert top[0][1] == pytest.approx(lp, abs=1e-5)
        assert [p for _, p in top] == sorted((p for _, p in top), reverse=True)


def test_stats_count_tokens_and_batches(demo):
    engine = make_engine(demo, max_concurrency=4)
    outs = engine.generate(PROMPTS[:8], SamplingParams(max_tokens=10))
    s = engine.stats
    assert s.requests_finished == 8
    assert s.completion_tokens == sum(o.completion_tokens for o in outs) == 80
    assert s.prompt_tokens == sum(o.prompt_tokens for o in outs)
    assert 1 < s.mean_batch_size <= 4
    assert s.decode_tokens_per_s > 0 and s.prefill_tokens_per_s > 0
    assert len(s.ttfts) == 8 and s.ttft_quantile(0.5) > 0
    assert s.peak_memory_bytes > 0


def test_a_warm_up_leaves_no_trace_in_outputs_figures_or_the_prefix_cache(demo, tmp_path):
    """The job warms a GPU engine up before its first rows (here forced on the CPU)."""
    prompts = PROMPTS[:6]
    expected = [o.token_ids for o in make_engine(demo, max_concurrency=4).generate(
        prompts, SamplingParams(max_tokens=8))]
    engine = make_engine(demo, max_concurrency=4, cache_dir=str(tmp_path / "cache"),
                         prefix_block_size=8)
    engine.enable_prefix_cache()
    engine.warm_up(cpu_too=True)
    s = engine.stats
    assert (s.requests_finished, s.prompt_tokens, s.completion_tokens, s.ttfts,
            s.decode_steps, s.timeline) == (0, 0, 0, [], 0, [])
    stats = engine.get_cache_stats()
    assert (stats["hits"], stats["misses"], stats["blocks"]) == (0, 0, 0)
    assert not engine.has_work()
    outs = engine.generate(prompts, SamplingParams(max_tokens=8))
    assert [o.token_ids for o in outs] == expected
    assert engine.stats.requests_finished == len(prompts)
    assert engine.stats.prompt_tokens == sum(o.prompt_tokens for o in outs)


def test_a_warm_up_is_skipped_on_the_cpu_and_once_rows_are_queued(demo):
    engine = make_engine(demo, max_concurrency=4)
    engine.warm_up()
    assert engine.stats.requests_finished == 0 and next(engine._ids) == 0  # nothing ran
    engine.add_request("hi", SamplingParams(max_tokens=2))
    engine.warm_up(cpu_too=True)
    assert engine.num_waiting == 1 and next(engine._ids) == 2  # only the queued row


def test_a_gpus_prefill_budget_follows_its_memory_and_the_models_widths(demo, monkeypatch):
    from batchrun.engine import memory

    monkeypatch.setattr(memory, "device_memory_bytes", lambda: 140 << 30)
    model = demo.model
    width = 2 * 4 * (3 * model.args.intermediate_size + 4 * model.args.hidden_size)  # float32
    assert memory.activation_bytes(model) == width
    low, high = memory.GPU_PREFILL_TOKENS
    assert memory.prefill_token_budget(model) == high  # a tiny model on a big GPU
    model.set_dtype(mx.bfloat16)
    try:
        assert memory.activation_bytes(model) == width // 2
        monkeypatch.setattr(memory, "device_memory_bytes", lambda: 1 << 30)
        expected = int((1 << 30) * memory.PREFILL_MEMORY_SHARE / (width // 2))
        assert low < expected < high  # a small GPU: its memory decides
        assert memory.prefill_token_budget(model) == expected
    finally:
        model.set_dtype(mx.float32)

    class Unknown:  # a model that does not say its widths: the low end
        args = None
    assert memory.activation_bytes(Unknown()) is None
    assert memory.prefill_token_budget(Unknown()) == low

    class Nested:  # Qwen3.5's and Gemma 3's checkpoints say them in a text_config
        parameters = model.parameters
        args = type("Args", (), {"text_config": {
            "hidden_size": model.args.hidden_size,
            "intermediate_size": model.args.intermediate_size}})()
    assert memory.activation_bytes(Nested()) == width


def test_invalid_sampling_values_name_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_lean_decode_step_gives_what_mlx_lm_step_gives(demo, monkeypatch):
    """batchrun's own decode step (batch.py) against mlx-lm's GenerationBatch: a mixed batch of
    greedy, seeded, logprob and penalized rows (whose penalties read the row's tokens so far)
    yields the same tokens and logprobs."""
    import batchrun.engine.backends.text as text_module
    import batchrun.engine.decoding.sampling as sampling

    seen = []  # the token context each penalized row's processor is called with
    real_call = sampling.LogitAdjustments.__call__

    def call(self, context, logits):
        seen.append(context.tolist())
        return real_call(self, context, logits)

    monkeypatch.setattr(sampling.LogitAdjustments, "__call__", call)

    def run(lean: bool):
        seen.clear()
        monkeypatch.setattr(text_module, "LEAN_STEP", lean)
        engine = make_engine(demo, max_concurrency=4)  # rows join as others finish
        for i, p in enumerate(PROMPTS):
            params = [SamplingParams(max_tokens=10, repetition_penalty=1.5,
                                     frequency_penalty=0.5),  # the prompt's repeats: rows 0, 4
                      SamplingParams(max_tokens=8 + i),
                      SamplingParams(max_tokens=12, temperature=0.9, seed=i),
                      SamplingParams(max_tokens=10, logprobs=True, top_logprobs=2)][i % 4]
            engine.add_request(p, params)
        return engine.run(), sorted(seen)

    (lean, lean_seen), (stock, stock_seen) = run(True), run(False)
    assert [o.token_ids for o in lean] == [o.token_ids for o in stock]
    assert lean_seen == stock_seen and len(lean_seen) >= 20
    assert any(o.logprobs for o in lean)
    for a, b in zip(lean, stock, strict=True):
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs:
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
            assert [[t for t, _ in step] for step in a.top_logprobs] == \
                [[t for t, _ in step] for step in b.top_logprobs]
