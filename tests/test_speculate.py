"""Speculative decoding where the batch is narrow: rows propose tokens (prompt lookup or a draft
model), one forward verifies them, and each row keeps what the model would have chosen. Greedy
and seeded output are the same tokens as plain decoding; rejected tokens leave no trace in a
row's KV cache; the report counts what speculation proposed and kept."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from helpers import choice_logprob, jsonl, run, write_rows
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from batchrun.cache import block_layout, make_prefix_cache
from batchrun.engine.config import DEFAULT_DRAFT_TOKENS, EngineConfig
from batchrun.engine.decoding import speculate
from batchrun.engine.decoding.speculate import Speculator, ngram_proposal, rollback
from batchrun.engine.engine import Engine
from batchrun.engine.kernels.shared_prefix import SharedPrefix, SharedPrefixBatchCache
from batchrun.engine.types import Constraint, SamplingParams
from batchrun.models import DEMO_DRAFT_MODEL, DEMO_MODEL, load_model
from tools.demo_models import lessons

QUESTIONS = ["Explain photosynthesis in two sentences.", "List three facts about vaccines.",
             "Write a short poem about recursion.", "Give an analogy for black holes.",
             "Summarize the water cycle for a ten year old.", "What is the weather in Oslo?",
             "List three facts about the immune system.", "Explain binary search in two sentences."]


@pytest.fixture(scope="module")
def pair():
    return load_model(str(DEMO_MODEL))


def chats(questions=QUESTIONS):
    return [[{"role": "user", "content": q}] for q in questions]


def generate(lm, prompts, params, speculate="off", concurrency=8, k=4, prefix_cache=None,
             adaptive=False, draft=DEMO_DRAFT_MODEL):
    config = EngineConfig(max_concurrency=concurrency, speculate=speculate, draft_tokens=k,
                          draft_model=str(draft) if speculate == "draft" else None)
    engine = Engine(lm.model, lm.tokenizer, config, lm.context_length, prefix_cache=prefix_cache,
                    model_fingerprint=lm.fingerprint)
    if engine.speculator is not None:
        engine.speculator.adaptive = adaptive
    outs = engine.generate(prompts, params)
    assert engine.faults == 0  # no step failed (the engine would retry its rows)
    return outs, engine


def tokens(outs):
    return [o.token_ids for o in outs]


# -- proposals and rollback ---------------------------------------------------------------------

def test_prompt_lookup_proposes_what_followed_the_latest_match_longest_first():
    context = np.array([5, 6, 7, 8, 1, 2, 6, 7, 9, 4, 3, 6, 7])
    # "6 7" occurs twice before the end: the latest one (followed by 9 4 3) wins
    assert ngram_proposal(context, 3) == [9, 4, 3]
    assert ngram_proposal(context, 10) == [9, 4, 3, 6, 7]  # up to the context's end
    # the last three tokens "3 6 7" occur nowhere earlier: "6 7" is used; "8 5" never occurs
    assert ngram_proposal(np.array([1, 2, 3, 8, 5]), 4) == []
    # one matching token guesses only when asked to
    assert ngram_proposal(np.array([4, 2, 9, 2]), 2) == []
    assert ngram_proposal(np.array([4, 2, 9, 2]), 2, shortest=1) == [9, 2]


def filled_cache(rows: int, length: int, cls=BatchKVCache, **kw) -> tuple:
    """A batch cache whose row r, position p holds the value 100 * r + p (keys and values)."""
    cache = cls(**kw) if kw else cls([0] * rows)
    data = mx.array([[100 * r + p for p in range(length)] for r in range(rows)], mx.float32)
    kv = mx.broadcast_to(data[:, None, :, None], (rows, 2, length, 4))
    cache.update_and_fetch(kv, kv)
    return cache, data


def row_values(cache, r: int) -> list[float]:
    start = cache.left_padding[r].item()
    return cache.keys[r, 0, start: cache._idx, 0].tolist()


@pytest.mark.parametrize("shared", [False, True])
def test_rollback_drops_each_rows_last_tokens_and_keeps_positions(shared):
    if shared:
        prefix = SharedPrefix([mx.zeros((1, 2, 5, 4))], [mx.zeros((1, 2, 5, 4))])
        cache, _ = filled_cache(3, 6, SharedPrefixBatchCache, prefixes=[prefix, None, prefix],
                                layer=0)
    else:
        cache, _ = filled_cache(3, 6)
    offsets = cache.offset.tolist()
    rollback([cache], [0, 2, 5])
    # Each row holds exactly its kept tokens (their order within the row is not kept: the
    # dropped slots are filled with the row's first kept ones)
    assert row_values(cache, 0) == [0, 1, 2, 3, 4, 5]
    assert sorted(row_values(cache, 1)) == [100, 101, 102, 103]
    assert row_values(cache, 2) == [200]
    # RoPE positions of the next token follow each row's kept tokens
    assert cache.offset.tolist() == [offsets[0], offsets[1] - 2, offsets[2] - 5]
    # and the next token lands after them, every row's at the same slot
    new = mx.full((3, 2, 1, 4), 7.0)
    cache.update_and_fetch(new, new)
    assert row_values(cache, 0)[-1] == row_values(cache, 1)[-1] == 7
    assert sorted(row_values(cache, 1)[:-1]) == [100, 101, 102, 103]
    assert row_values(cache, 2) == [200, 7]


def test_attention_over_a_rolled_back_cache_sees_each_rows_kept_tokens_alone():
    """A decode step's attention (the batch's mask) over the cache after rollback equals each
    row's attention over its kept tokens in order: the moved slots change nothing it sees."""
    mx.random.seed(3)
    cache = BatchKVCache([0, 2, 1])
    keys, values = mx.random.normal((3, 2, 9, 4)), mx.random.normal((3, 2, 9, 4))
    cache.update_and_fetch(keys, values)
    rollback([cache], [1, 4, 2])
    q = mx.random.normal((3, 2, 1, 4))
    new_k, new_v = mx.random.normal((3, 2, 1, 4)), mx.random.normal((3, 2, 1, 4))
    mask = cache.make_mask(1)
    k_all, v_all = cache.update_and_fetch(new_k, new_v)
    out = mx.fast.scaled_dot_product_attention(q, k_all, v_all, scale=0.5, mask=mask)
    for row, (start, kept) in enumerate([(0, 8), (2, 3), (1, 6)]):
        k = mx.concatenate([keys[row:row + 1, :, start:start + kept], new_k[row:row + 1]], 2)
        v = mx.concatenate([values[row:row + 1, :, start:start + kept], new_v[row:row + 1]], 2)
        alone = mx.fast.scaled_dot_product_attention(q[row:row + 1], k, v, scale=0.5)
        assert mx.allclose(out[row:row + 1], alone, atol=1e-5)


# -- same tokens as plain decoding --------------------------------------------------------------

def test_the_draft_evaluates_whatever_work_it_says_it_did(monkeypatch):
    """sync's one-time work (prefilling rows, catching up on plain steps' tokens) is evaluated
    inside it, so the caller's clock charges it apart from the speculating step."""
    draft = speculate.DraftModel(load_model(str(DEMO_DRAFT_MODEL)).model)
    evaluated = []
    real_eval = mx.eval

    def spy(*args):
        evaluated.append(args)
        return real_eval(*args)

    monkeypatch.setattr(mx, "eval", spy)
    contexts = [[5, 6, 7, 8], [9, 10, 11]]
    for uids, grown in [([1, 2], 0), ([1, 2], 3), ([2], 2), ([2, 3], 1)]:
        contexts = [c + list(range(20, 20 + grown)) for c in contexts]
        if uids == [2]:
            contexts = contexts[1:]
        elif len(uids) > len(contexts):
            contexts = contexts + [[4, 4, 4]]
        evaluated.clear()
        assert draft.sync(uids, contexts) is True
        assert evaluated, uids  # evaluated before returning
        assert draft.seen == [len(c) - 1 for c in contexts]  # the last one comes with a step
    evaluated.clear()
    assert draft.sync([2, 3], contexts) is False and not evaluated  # nothing to do


def _alone(model, context: list[int], pending: int, k: int) -> list[int]:
    """The draft's k greedy guesses after `pending` for one row's context, from scratch."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([context + [pending]]), cache=cache)[:, -1]
    out = []
    for _ in range(k):
        out.append(int(mx.argmax(logits, axis=-1).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)[:, -1]
    return out


def _greedy(logprobs, j):
    return mx.argmax(logprobs, axis=-1)


@pytest.mark.parametrize("compiled", [True, False])
def test_the_drafts_guesses_are_what_it_guesses_for_each_rows_whole_context(compiled):
    """The draft's batch cache follows each row through steps that keep different numbers of
    its guesses, plain steps it missed, rows leaving and joining: every step's guesses are the
    ones the draft makes for the row's context from scratch, alone; with its forward compiled
    (the default: the demo draft's compiles) and as mlx-lm runs it."""
    draft_lm = load_model(str(DEMO_DRAFT_MODEL))
    model, k = draft_lm.model, 4
    draft = speculate.DraftModel(model, compiled=compiled)
    assert (draft.compiled is not None) == compiled
    rng = np.random.default_rng(3)
    prompts = [draft_lm.tokenizer.apply_chat_template(c, add_generation_prompt=True)
               for c in chats(QUESTIONS[:5])]
    rows = {uid: list(p) for uid, p in enumerate(prompts)}  # uid: the target cache's tokens
    pending = {uid: int(rng.integers(5, 200)) for uid in rows}
    live = [0, 1, 2]
    for step in range(8):
        if step == 3:  # a plain step the draft did not see
            for uid in live:
                rows[uid].append(pending[uid])
                pending[uid] = int(rng.integers(5, 200))
        if step == 4:
            live = [0, 2, 3, 4]  # row 1 left, rows 3 and 4 joined
        draft.sync(live, [rows[u] for u in live])
        guesses = draft.propose([rows[u][-1] for u in live],
                                mx.array([pending[u] for u in live]), k, _greedy).tolist()
        for uid, guess in zip(live, guesses, strict=True):
            assert guess == _alone(model, rows[uid], pending[uid], k), (step, uid)
        kept = [int(rng.integers(0, k + 1)) for _ in live]
        for uid, guess, n in zip(live, guesses, kept, strict=True):
            rows[uid] += [pending[uid], *guess[:n]]
            pending[uid] = int(rng.integers(5, 200))
        draft.rollback([k - n for n in kept])
        assert draft.seen == [len(rows[u]) - 1 for u in live]


def test_compiled_guesses_cross_the_cache_buffers_end_and_follow_a_cut_front():
    """The compiled forward writes into the draft cache's buffer at a slot it is given; rows
    whose contexts run past the buffer's 256 slots mid-step, and a buffer whose front a leaving
    row's padding cut (any size), still get the guesses each row's context gives alone."""
    model, k = load_model(str(DEMO_DRAFT_MODEL)).model, 6
    draft = speculate.DraftModel(model)
    assert draft.compiled is not None
    rng = np.random.default_rng(11)
    rows = {0: list(rng.integers(5, 700, 251)), 1: list(rng.integers(5, 700, 180)),
            2: list(rng.integers(5, 700, 240))}
    rows = {u: [int(t) for t in r] for u, r in rows.items()}
    live = [0, 1, 2]
    for step in range(5):
        if step == 2:
            live = [1, 2]  # the longest row leaves: the others' padding, the buffer's front, is cut
        draft.sync(live, [rows[u] for u in live])
        pending = [int(rng.integers(5, 700)) for _ in live]
        guesses = draft.propose([rows[u][-1] for u in live], mx.array(pending), k,
                                _greedy).tolist()
        capacity = draft.caches[0].keys.shape[2]
        assert capacity % speculate.CAPACITY_STEP == 0 and capacity >= draft.caches[0]._idx
        for uid, p, guess in zip(live, pending, guesses, strict=True):
            assert guess == _alone(model, rows[uid], p, k), (step, uid)
        for uid, p, guess in zip(live, pending, guesses, strict=True):
            rows[uid] += [p, *guess]  # every guess kept
        draft.rollback([0] * len(live))
    assert len(rows[2]) > 256 + k


@pytest.mark.parametrize("fault", ["fails", "differs"])
def test_a_draft_whose_forward_does_not_compile_guesses_uncompiled(fault, caplog):
    """An architecture that reads its cache in a way the compiled forward's cache does not
    serve (its trace fails, or computes other logits) is found out when the draft loads: it
    says so in the log and guesses as mlx-lm runs it, the same guesses."""
    model = load_model(str(DEMO_DRAFT_MODEL)).model

    class Peeking:  # reads its caches' state, which the compiled forward's do not have
        layers = model.layers

        def __call__(self, x, cache=None):
            if fault == "fails":
                assert all(c.state is not None for c in cache)
                return model(x, cache=cache)
            # a cache it does not know of: read as empty
            return model(x, cache=cache if isinstance(cache[0], BatchKVCache) else None)

    with caplog.at_level("INFO", logger="batchrun"):
        draft = speculate.DraftModel(Peeking())
    assert draft.compiled is None
    assert ("does not compile" if fault == "fails" else "differs from its own") in caplog.text
    assert "drafting uncompiled" in caplog.text
    contexts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    draft.sync([0, 1], contexts)
    guesses = draft.propose([c[-1] for c in contexts], mx.array([30, 40]), 3, _greedy).tolist()
    assert guesses == [_alone(model, c, p, 3) for c, p in zip(contexts, [30, 40], strict=True)]


@pytest.mark.parametrize("concurrency", [1, 8])
def test_draft_model_speculation_gives_the_same_greedy_tokens(pair, concurrency):
    prompts = chats()
    params = SamplingParams(max_tokens=48)
    plain, _ = generate(pair, prompts, params, concurrency=concurrency)
    spec, engine = generate(pair, prompts, params, "draft", concurrency=concurrency)
    assert tokens(spec) == tokens(plain)
    stats = engine.stats.speculation
    # it did speculate, kept most guesses and turned some down (rollback exercised)
    assert stats.steps > 0 and 0 < stats.accepted < stats.proposed
    assert stats.accepted > stats.proposed / 2
    assert engine.stats.completion_tokens == sum(len(o.token_ids) for o in plain)
    assert engine.stats.mean_batch_size <= concurrency  # rows a step, not tokens


def test_prompt_lookup_speculation_gives_the_same_greedy_tokens(demo):
    # the random demo model loops: its own output repeats, which prompt lookup catches
    prompts = [demo.tokenizer.encode(f"row {i}: " + "alpha beta gamma delta " * 3)
               for i in range(6)]
    params = SamplingParams(max_tokens=40)
    plain, _ = generate(demo, prompts, params, concurrency=6)
    spec, engine = generate(demo, prompts, params, "ngram", concurrency=6, k=5)
    assert tokens(spec) == tokens(plain)
    stats = engine.stats.speculation
    assert stats.steps > 0 and 0 < stats.accepted < stats.proposed


@pytest.mark.parametrize("longest", [0, 2])
def test_n_gram_steps_verify_only_as_many_positions_as_the_longest_guess(pair, monkeypatch,
                                                                          longest):
    """A step where no row finds its last tokens earlier (the start of an answer) costs one
    forward of the pending tokens, as a plain step does, not k + 1 positions a row."""
    from batchrun.engine.backends import batch

    found = batch.ngram_proposal
    monkeypatch.setattr(batch, "ngram_proposal", lambda context, k: found(context, k)[:longest])
    widths = []
    model_call = type(pair.model).__call__

    def recording(self, inputs, *args, **kwargs):
        widths.append(inputs.shape[1])
        return model_call(self, inputs, *args, **kwargs)

    prompts = [[{"role": "system", "content": lessons.reference_text(t)},
                {"role": "user", "content": f"Quote the reference about {t}."}]
               for t in lessons.TOPICS[:4]]  # answers that copy their prompt
    params = SamplingParams(max_tokens=24)
    plain, _ = generate(pair, prompts, params, concurrency=4)
    widths.clear()
    monkeypatch.setattr(type(pair.model), "__call__", recording)
    spec, engine = generate(pair, prompts, params, "ngram", concurrency=4, k=6)
    assert tokens(spec) == tokens(plain)
    decode = [w for w in widths if w <= 7]  # the prompts' prefill is wider (chat template)
    assert decode and max(decode) == longest + 1
    assert (engine.stats.speculation.proposed > 0) == (longest > 0)


@pytest.mark.parametrize("speculate", ["draft", "ngram"])
def test_seeded_sampling_gives_the_same_tokens_with_speculation(pair, speculate):
    prompts = chats()
    params = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=11)
    plain, _ = generate(pair, prompts, params)
    spec, engine = generate(pair, prompts, params, speculate)
    assert tokens(spec) == tokens(plain)
    assert engine.stats.speculation.steps > 0
    if speculate == "draft":
        assert engine.stats.speculation.accepted > 0


def run_rows(lm, prompts, params: list, speculate="off", k=DEFAULT_DRAFT_TOKENS):
    """Each chat with its own parameters, every narrow batch speculating: (the outputs in the
    chats' order, the engine)."""
    config = EngineConfig(max_concurrency=8, speculate=speculate, draft_tokens=k,
                          draft_model=str(DEMO_DRAFT_MODEL) if speculate == "draft" else None)
    engine = Engine(lm.model, lm.tokenizer, config, lm.context_length)
    if engine.speculator:
        engine.speculator.adaptive = False
    ids = [engine.add_request(messages=c, params=p) for c, p in zip(prompts, params, strict=True)]
    outs = {o.request_id: o for o in engine.run()}
    assert engine.faults == 0
    return [outs[i] for i in ids], engine


def test_stops_and_limits_inside_kept_guesses_end_the_row_there(pair):
    prompts = chats()
    plain_params = [SamplingParams(max_tokens=5 + 3 * i) for i in range(len(prompts))]
    # a stop token the answers use: a row stops at its first one, even mid-guess
    stop = pair.tokenizer.encode(" the")[-1]
    stopped = SamplingParams(max_tokens=60, stop_token_ids=(stop,))
    for params in (plain_params, [stopped] * len(prompts)):
        outs = {method: [(o.token_ids, o.finish_reason) for o in run_rows(
                    pair, prompts, params, method)[0]] for method in ("off", "draft")}
        assert outs["draft"] == outs["off"]
    assert any(reason == "stop" for _, reason in outs["draft"])


@pytest.mark.parametrize("speculate_with", ["draft", "ngram"])
def test_rows_joining_or_leaving_while_a_verification_runs_ahead_keep_their_tokens(
        pair, monkeypatch, speculate_with):
    """A speculative step starts the next one's verification before it returns; rows that
    join the batch, leave it (aborted) or are read in between undo it first, and every row's
    tokens stay plain decoding's."""
    from batchrun.engine.backends.batch import LeanGenerationBatch

    undone, finished = [], []
    cancel, finish = LeanGenerationBatch._cancel_ahead, LeanGenerationBatch._finish

    def counting_cancel(self):
        undone.append(self._ahead is not None)
        return cancel(self)

    def counting_finish(self, spec, v):
        finished.append(v is not None)
        return finish(self, spec, v)

    prompts = ([[{"role": "system", "content": lessons.reference_text(t)},
                 {"role": "user", "content": f"Quote the reference about {t}."}]
                for t in lessons.TOPICS[:3]] + chats()[:5])
    # Each row runs to its length whatever the model (min_tokens), and the row aborted first
    # is long enough to be running still at step 6 however many guesses the draft gets right.
    lengths = [10, 45, 24, 31, 38, 17, 52, 59]
    params = [SamplingParams(max_tokens=n, min_tokens=n) for n in lengths]

    def run(method, abort):
        config = EngineConfig(max_concurrency=3, speculate=method, draft_tokens=4,
                              draft_model=str(DEMO_DRAFT_MODEL) if method == "draft" else None)
        engine = Engine(pair.model, pair.tokenizer, config, pair.context_length)
        if engine.speculator is not None:
            engine.speculator.adaptive = False
        ids = [engine.add_request(messages=c, params=p) for c, p in zip(prompts, params,
                                                                          strict=True)]
        outs, last = {}, None
        for step in range(10_000):
            if step == 6 and abort:  # a row leaves; one waiting joins
                assert engine.abort(ids[1])
            if abort and last is None and engine.num_waiting == 0 and engine.num_running > 1:
                last = step + 2
            if step == last:  # a row leaves; none joins
                assert engine.abort(ids[-1])
            for o in engine.step():
                outs[o.request_id] = o.token_ids
            if not engine.has_work():
                break
        assert engine.faults == 0  # no step failed (the engine would retry its rows)
        return [outs[i] for i in ids]

    plain = run("off", abort=False)
    monkeypatch.setattr(LeanGenerationBatch, "_cancel_ahead", counting_cancel)
    monkeypatch.setattr(LeanGenerationBatch, "_finish", counting_finish)
    spec = run(speculate_with, abort=True)
    for aborted in (1, -1):
        assert spec[aborted] == plain[aborted][: len(spec[aborted])]
        assert len(spec[aborted]) < len(plain[aborted])
    assert spec[:1] + spec[2:-1] == plain[:1] + plain[2:-1]
    assert any(undone)  # verifications started ahead were undone (rows joined, one left) ...
    assert len(finished) > sum(undone)  # ... and others finished


def test_rows_reporting_logprobs_keep_them_exact_beside_speculating_rows(pair):
    prompts = chats()
    plain = [SamplingParams(max_tokens=30)] * 4 + [SamplingParams(max_tokens=30, logprobs=True,
                                                                  top_logprobs=2)] * 4
    outs = {}
    for method in ("off", "draft"):
        config = EngineConfig(max_concurrency=8, speculate=method,
                              draft_model=str(DEMO_DRAFT_MODEL) if method == "draft" else None)
        engine = Engine(pair.model, pair.tokenizer, config, pair.context_length)
        if engine.speculator:
            engine.speculator.adaptive = False
        for chat, p in zip(prompts, plain, strict=True):
            engine.add_request(messages=chat, params=p)
        outs[method] = engine.run()
    assert engine.stats.speculation.accepted > 0
    assert tokens(outs["draft"]) == tokens(outs["off"])
    for a, b in zip(outs["draft"][4:], outs["off"][4:], strict=True):
        assert len(a.logprobs) == len(a.token_ids)
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)
        assert [[t for t, _ in top] for top in a.top_logprobs] == \
            [[t for t, _ in top] for top in b.top_logprobs]


def test_choices_rows_joining_a_speculating_batch_score_their_choices_on_their_prompt(pair):
    """A choices row guesses nothing and so drops its verification slots, while the rows beside
    it keep guesses: its KV is then read in token order to score its choices (choices.py),
    which a rollback that reorders a row's slots would break."""
    choices = ["positive", "negative", "neutral"]
    config = EngineConfig(max_concurrency=8, speculate="draft",
                          draft_model=str(DEMO_DRAFT_MODEL))
    engine = Engine(pair.model, pair.tokenizer, config, pair.context_length)
    engine.speculator.adaptive = False
    for chat in chats()[:4]:
        engine.add_request(messages=chat, params=SamplingParams(max_tokens=64))
    outs = [o for _ in range(3) for o in engine.step()]  # the free rows are speculating
    prompts = [f"Review: the kettle is {w}. Label:" for w in ("great", "awful", "fine", "loud")]
    ids = [engine.add_request(p, SamplingParams(constraint=Constraint.choices(choices)))
           for p in prompts]
    outs += engine.run()
    assert engine.stats.speculation.accepted > 0
    by_id = {o.request_id: o for o in outs}
    for prompt, request_id in zip(prompts, ids, strict=True):
        for choice in choices:
            assert by_id[request_id].choice_logprobs[choice] == pytest.approx(
                choice_logprob(pair, prompt, choice), abs=1e-3)


def test_rows_sharing_a_cached_prefix_speculate_to_the_same_tokens(pair, tmp_path):
    system = "You answer questions about science in plain words. " * 12
    prompts = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
               for q in QUESTIONS]
    params = SamplingParams(max_tokens=40)
    plain, _ = generate(pair, prompts, params)
    cache = make_prefix_cache(pair.fingerprint, 1 << 30, tmp_path / "c", block_size=32,
                              layout=block_layout(pair.model))
    spec, engine = generate(pair, prompts, params, "draft", prefix_cache=cache)
    assert engine.scheduler.shares_prefix and engine.get_cache_stats()["hit_tokens"] > 0
    assert tokens(spec) == tokens(plain)
    assert engine.stats.speculation.accepted > 0


def test_rows_holding_copies_of_cached_blocks_speculate_to_the_same_tokens(pair, tmp_path,
                                                                            monkeypatch):
    """--no-shared-prefix, with decode steps taking row ranges (the CUDA path, here through its
    reference): the rolled-back guesses leave each row's copied blocks and own tokens intact."""
    from batchrun.engine.kernels import decode_attention

    system = "You answer questions about science in plain words. " * 12
    prompts = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
               for q in QUESTIONS]
    params = SamplingParams(max_tokens=40)
    plain, _ = generate(pair, prompts, params)
    monkeypatch.setattr(decode_attention, "EVERYWHERE", True)
    cache = make_prefix_cache(pair.fingerprint, 1 << 30, tmp_path / "c", block_size=32,
                              layout=block_layout(pair.model))
    config = EngineConfig(max_concurrency=8, speculate="draft", draft_tokens=4,
                          draft_model=str(DEMO_DRAFT_MODEL), shared_prefix=False)
    engine = Engine(pair.model, pair.tokenizer, config, pair.context_length,
                    prefix_cache=cache, model_fingerprint=pair.fingerprint)
    engine.speculator.adaptive = False
    spec = engine.generate(prompts, params)
    assert not engine.scheduler.shares_prefix and engine.get_cache_stats()["hit_tokens"] > 0
    assert tokens(spec) == tokens(plain) and engine.faults == 0
    assert 0 < engine.stats.speculation.accepted < engine.stats.speculation.proposed


def test_wide_batches_do_not_speculate(pair):
    # rows finishing together, more than speculate at once on this device (CPU or GPU): the
    # batch never narrows below the speculating width
    width = Speculator("ngram", k=4).max_rows + 8
    prompts = (chats() * width)[:width]
    _, engine = generate(pair, prompts, SamplingParams(max_tokens=6), "draft", concurrency=width)
    assert engine.speculator.max_rows < width
    assert engine.stats.speculation.steps == 0
    assert engine.stats.mean_batch_size == pytest.approx(width, rel=0.2)


@pytest.mark.parametrize("spec_cost, expect", [(0.5, True), (2.0, False)])
def test_a_narrow_batch_speculates_only_while_it_measures_cheaper(monkeypatch, spec_cost,
                                                                    expect):
    """Steps timed by a fake clock: a plain step costs 1 s a token, a speculating one
    `spec_cost`; the cheaper kind runs, the other is tried again every PROBE_EVERY steps."""
    clock = [0.0]
    monkeypatch.setattr(speculate.time, "perf_counter", lambda: clock[0])
    spec = Speculator("ngram", k=4, verify_tokens=40)  # up to 8 rows
    cache = [BatchKVCache([0, 0])]
    choices = []
    for _ in range(3 * speculate.PROBE_EVERY):
        speculating = spec.wants(2, cache)
        choices.append(speculating)
        clock[0] += 4 * (spec_cost if speculating else 1.0)  # 4 tokens a step
        spec.step(speculating, 2, 4)
    assert choices[0] is False  # plain steps first: the yardstick
    settled = choices[4:]
    others = sum(c != expect for c in settled)
    assert 1 <= others <= len(settled) // speculate.PROBE_EVERY + 1  # probes only
    assert not spec.wants(9, cache)  # wider than 8 rows: never
    assert not spec.wants(9, cache, allowed=lambda: 1 / 0)  # and its rows are not looked at
    # a narrower batch, not measured yet, starts from what the wider one measured
    assert spec.wants(1, cache) is expect


def test_a_probe_replaces_what_its_kind_measured_long_ago(monkeypatch):
    """Speculating turns costly (the rows' text moves where the draft guesses badly), plain
    steps take over, then it turns cheap again: the first probe that measures it cheap brings
    it back, its own measure replacing the stale one, and the draft's catching up on the plain
    steps' tokens (one-time work) is not counted against it."""
    clock = [0.0]
    monkeypatch.setattr(speculate.time, "perf_counter", lambda: clock[0])
    spec = Speculator("ngram", k=4, verify_tokens=40)
    cache = [BatchKVCache([0, 0])]

    def run(steps, spec_cost, catch_up_s=0.0):
        choices = []
        for _ in range(steps):
            speculating = spec.wants(2, cache)
            choices.append(speculating)
            one_time = catch_up_s if speculating else 0.0
            clock[0] += 4 * (spec_cost if speculating else 1.0) + one_time  # 4 tokens a step
            spec.step(speculating, 2, 4, one_time)
        return choices

    assert run(6, 0.5)[-1] is True
    assert run(4, 10.0)[-1] is False
    cheap = run(speculate.PROBE_EVERY + 2, 0.5, catch_up_s=100.0)
    probe = cheap.index(True)
    assert 0 < probe <= speculate.PROBE_EVERY  # plain steps until the probe
    assert all(cheap[probe:])  # speculating from the probe on


@pytest.mark.parametrize("decided_at_the_end", [False, True])
def test_a_step_sharing_its_time_with_a_prefill_is_not_measured(monkeypatch, decided_at_the_end):
    """Rows admitted between two steps (their caches built, their prompts prefilled) take time
    the step before did not: that step is not measured, so a speculating batch that keeps
    taking rows goes on speculating where it is cheaper, and the backend says so. When a step
    decides the next one at its end (a speculative step starting the next verification), the
    prefill falls in the next step's time, and that one is not measured."""
    clock = [0.0]
    monkeypatch.setattr(speculate.time, "perf_counter", lambda: clock[0])
    spec = Speculator("ngram", k=4, verify_tokens=40)
    cache = [BatchKVCache([0, 0])]
    choices = []
    speculating = spec.wants(2, cache)
    for i in range(3 * speculate.PROBE_EVERY):
        if i and not decided_at_the_end:
            speculating = spec.wants(2, cache)
        choices.append(speculating)
        clock[0] += 4 * (0.5 if speculating else 1.0)
        spec.step(speculating, 2, 4)
        if decided_at_the_end:
            speculating = spec.wants(2, cache)
        if i % 3 == 2:  # a prefill: 100 s that belong to no step
            clock[0] += 100.0
            spec.discard()
    settled = choices[6:]
    assert settled.count(False) <= len(settled) // speculate.PROBE_EVERY + 1  # probes only


def test_the_text_backend_keeps_admissions_out_of_the_steps_measure(pair, monkeypatch):
    discarded = []
    monkeypatch.setattr(Speculator, "discard", lambda self: discarded.append(1))
    outs, engine = generate(pair, chats(), SamplingParams(max_tokens=8), "ngram", concurrency=2,
                            adaptive=True)
    assert all(o.token_ids for o in outs)
    assert len(discarded) >= len(QUESTIONS) // 2  # an insert of two rows at least each time


def test_tries_of_speculation_that_lose_come_less_and_less_often(monkeypatch):
    """A draft that guesses badly all job long: each losing try waits twice as long as the one
    before, up to PROBE_EVERY_MOST steps; once a try wins, tries come every PROBE_EVERY again."""
    clock = [0.0]
    monkeypatch.setattr(speculate.time, "perf_counter", lambda: clock[0])
    spec = Speculator("ngram", k=4, verify_tokens=40)
    cache = [BatchKVCache([0, 0])]
    cost = [3.0]
    choices = []
    for _ in range(1200):
        speculating = spec.wants(2, cache)
        choices.append(speculating)
        clock[0] += 4 * (cost[0] if speculating else 1.0)
        spec.step(speculating, 2, 4)
    tries = [i for i, c in enumerate(choices) if c]  # the first measures it
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    assert gaps == sorted(gaps)
    assert gaps[0] <= speculate.PROBE_EVERY + 2 and gaps[1] >= 2 * speculate.PROBE_EVERY
    assert max(gaps) in (speculate.PROBE_EVERY_MOST, speculate.PROBE_EVERY_MOST + 1)
    assert len(tries) <= 8  # a try every 32 steps would be 37
    cost[0] = 0.25  # the draft now guesses well: the next try wins and speculation stays on
    after = []
    for _ in range(speculate.PROBE_EVERY_MOST + 80):
        speculating = spec.wants(2, cache)
        after.append(speculating)
        clock[0] += 4 * (cost[0] if speculating else 1.0)
        spec.step(speculating, 2, 4)
    won = after.index(True)
    assert won <= speculate.PROBE_EVERY_MOST + 1
    rest = after[won:]
    assert False in rest and rest.index(False) in (  # the win brought tries back to the start
        speculate.PROBE_EVERY, speculate.PROBE_EVERY + 1)
    assert all(a or b for a, b in zip(rest, rest[1:], strict=False))  # a plain step: a try
    assert rest.count(False) <= 3


def test_tries_that_lose_at_one_width_do_not_slow_tries_at_another(monkeypatch):
    """Two rows where the draft loses until tries come every PROBE_EVERY_MOST steps; then
    six rows (another width) where it also loses: their tries start again every PROBE_EVERY."""
    clock = [0.0]
    monkeypatch.setattr(speculate.time, "perf_counter", lambda: clock[0])
    spec = Speculator("ngram", k=4, verify_tokens=40)  # up to 8 rows

    def run(rows, steps):
        cache = [BatchKVCache([0] * rows)]
        choices = []
        for _ in range(steps):
            speculating = spec.wants(rows, cache)
            choices.append(speculating)
            clock[0] += 4 * (3.0 if speculating else 1.0)
            spec.step(speculating, rows, 4)
        return [i for i, c in enumerate(choices) if c]

    narrow = run(2, 1200)
    assert narrow[-1] - narrow[-2] in (speculate.PROBE_EVERY_MOST, speculate.PROBE_EVERY_MOST + 1)
    wider = run(6, 3 * speculate.PROBE_EVERY + 4)
    gaps = [b - a for a, b in zip(wider, wider[1:], strict=False)]
    assert gaps and gaps[0] <= speculate.PROBE_EVERY + 2  # not 256 steps: its own interval


# -- settings and errors ------------------------------------------------------------------------

def test_the_guesses_a_step_default_alike_everywhere():
    """The command line, the Python API and the engine start from one default: 6 guesses, and
    12 for prompt lookup on a GPU (its guesses free, a wider verification no dearer there); the
    help says so, and a number given wins."""
    import click

    from batchrun import api
    from batchrun.cli import cli
    from batchrun.engine.config import (
        DEFAULT_DRAFT_MODEL_TOKENS_GPU,
        DEFAULT_NGRAM_TOKENS_GPU,
        default_draft_tokens,
    )

    option = next(p for p in cli.commands["run"].params if p.name == "draft_tokens")
    assert isinstance(option, click.Option) and option.default is None
    assert (f"default: {speculate.DEFAULT_DRAFT_TOKENS}; on a GPU "
            f"{DEFAULT_DRAFT_MODEL_TOKENS_GPU} for a draft model, {DEFAULT_NGRAM_TOKENS_GPU} for "
            "--speculate ngram") in " ".join(option.help.split())
    assert api.RunOptions().speculation.draft_tokens is None  # resolved where the job is planned
    assert default_draft_tokens("ngram", gpu=True) == DEFAULT_NGRAM_TOKENS_GPU == 12
    assert default_draft_tokens("draft", gpu=True) == DEFAULT_DRAFT_MODEL_TOKENS_GPU == 8
    assert default_draft_tokens("ngram", gpu=False) == default_draft_tokens("draft", gpu=False) == 6
    gpu = mx.default_device() != mx.cpu
    assert default_draft_tokens("ngram") == (12 if gpu else 6)
    assert EngineConfig(speculate="ngram").draft_tokens == (12 if gpu else 6)
    assert EngineConfig(speculate="draft", draft_model="d").draft_tokens == (8 if gpu else 6)
    assert EngineConfig(speculate="ngram", draft_tokens=3).draft_tokens == 3


def test_bad_speculation_settings_name_the_field():
    with pytest.raises(ValueError, match="speculate"):
        EngineConfig(speculate="medusa")
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(speculate="draft")
    with pytest.raises(ValueError, match="draft_tokens"):
        EngineConfig(speculate="ngram", draft_tokens=0)


def test_a_draft_with_another_tokenizer_is_refused(pair, tmp_path):
    other = tmp_path / "other-draft"
    shutil.copytree(DEMO_DRAFT_MODEL, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = [w for w in vocab if w.isalpha() and len(w) > 3][:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="does not share the model's tokenizer"):
        Engine(pair.model, pair.tokenizer,
               EngineConfig(speculate="draft", draft_model=str(other)), pair.context_length)


def draft_with_ids(tmp_path, ids: int):
    """The demo draft with `ids` token ids: its tables cut, or padded with rows whose ids win
    its guesses (a vocabulary padded further than the model's, and hostile: each padding row
    scores twice what a real row does)."""
    folder = tmp_path / f"draft-{ids}"
    shutil.copytree(DEMO_DRAFT_MODEL, folder)
    weights = mx.load(str(folder / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        table = weights[name]
        if ids <= table.shape[0]:
            weights[name] = table[:ids]
        else:
            rows = mx.arange(ids - table.shape[0]) % table.shape[0]
            weights[name] = mx.concatenate([table, 2 * table[rows]])
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": ids}))
    return folder


def test_a_draft_with_more_token_ids_guesses_only_the_models_and_one_with_fewer_is_refused(
        pair, tmp_path):
    """Drafts sharing a tokenizer may pad their vocabularies differently: guesses past the
    model's ids were read from outside its embedding (wrong tokens, or a crash), and a draft
    whose table misses some of the tokenizer's ids would read outside its own."""
    prompts, params = chats()[:4], SamplingParams(max_tokens=24)
    plain, _ = generate(pair, prompts, params, concurrency=4)
    spec, engine = generate(pair, prompts, params, "draft", concurrency=4,
                            draft=draft_with_ids(tmp_path, 2 * 777))
    assert tokens(spec) == tokens(plain) and engine.stats.speculation.proposed > 0
    narrow = draft_with_ids(tmp_path, 700)
    with pytest.raises(ValueError, match="has 700 token ids, fewer than the 777 its tokenizer"):
        Engine(pair.model, pair.tokenizer,
               EngineConfig(speculate="draft", draft_model=str(narrow)), pair.context_length)



# -- the command line ---------------------------------------------------------------------------

def test_batchrun_run_with_a_draft_model_writes_the_same_results_and_reports_the_gain(
        tmp_path, trained):
    rows = write_rows(tmp_path / "rows.jsonl",
                      [{"custom_id": f"q{i}", "prompt": q, "max_tokens": 48}
                       for i, q in enumerate(QUESTIONS)])
    run(rows, "--job-dir", tmp_path / "plain")
    result = run(rows, "--job-dir", tmp_path / "spec", "--draft-model", DEMO_DRAFT_MODEL,
                 "--draft-tokens", 6)
    texts = {r["custom_id"]: r["text"] for r in jsonl(tmp_path / "plain" / "results.jsonl")}
    assert {r["custom_id"]: r["text"] for r in jsonl(tmp_path / "spec" / "results.jsonl")} \
        == texts
    report = json.loads((tmp_path / "spec" / "report.json").read_text())
    assert 0 < report["speculative_accepted_tokens"] <= report["speculative_proposed_tokens"]
    assert report["speculative_acceptance"] > 0.5
    assert report["runs"][-1]["speculative_steps"] == report["speculative_steps"] > 0
    assert "tokens gained" in result.output
    # the run says what it was asked to speculate with, beside what it did
    assert report["runs"][-1]["speculation"] == {
        "method": "draft", "draft_model": str(DEMO_DRAFT_MODEL), "draft_tokens": 6}
    assert f"speculation (draft model {DEMO_DRAFT_MODEL}, 6 guesses a row):" in result.output
    page = (tmp_path / "spec" / "report.html").read_text()
    kept = report["runs"][-1]["speculative_accepted_tokens"] / report["runs"][-1][
        "speculative_proposed_tokens"]
    assert "speculative" in page and f"<td title=\"{DEMO_DRAFT_MODEL}\">draft 6, {kept:.0%} kept" \
        in page
    plain = json.loads((tmp_path / "plain" / "report.json").read_text())
    assert plain["speculative_steps"] == 0 and plain["speculative_acceptance"] is None
    assert plain["runs"][-1]["speculation"] == {"method": "off", "draft_model": None,
                                                "draft_tokens": None}
    assert "<td>off</td>" in (tmp_path / "plain" / "report.html").read_text()


def test_speculation_flags_are_checked_in_one_line(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", [{"prompt": "hello"}])
    result = run(rows, "--speculate", "draft", code=2)
    assert "--speculate draft needs --draft-model" in result.output
    result = run(rows, "--draft-model", tmp_path / "missing", code=1)
    assert "the draft model" in result.output and "could not be loaded" in result.output
    assert "Traceback" not in result.output
    result = run(rows, "--draft-model", "sample_data/demo-vision-model", code=1)
    assert "does not share the model's tokenizer" in result.output
    result = run(rows, "--draft-tokens", 0, code=2)
    assert "--draft-tokens" in result.output


def test_a_batch_where_no_row_may_guess_decodes_plainly(pair):
    """Rows reporting log-probabilities guess nothing: a batch of only them never runs a
    verification step (it would gain nothing and shift their log-probabilities' last bits)."""
    params = SamplingParams(max_tokens=20, logprobs=True, top_logprobs=2)
    plain, _ = generate(pair, chats(), params)
    spec, engine = generate(pair, chats(), params, "draft")
    assert engine.stats.speculation.steps == 0
    assert [o.logprobs for o in spec] == [o.logprobs for o in plain]


def test_an_unused_draft_model_is_said(tmp_path, caplog):
    rows = write_rows(tmp_path / "rows.jsonl", [{"prompt": "hello", "max_tokens": 2}])
    with caplog.at_level("WARNING", logger="batchrun"):
        run(rows, "--job-dir", tmp_path / "j", "--draft-model", DEMO_DRAFT_MODEL,
            "--speculate", "ngram")
    assert "--draft-model" in caplog.text and "is not used" in caplog.text


@pytest.mark.parametrize("how", ["flag", "job file", "environment"])
def test_draft_tokens_without_speculation_are_said(tmp_path, caplog, monkeypatch, how):
    rows = write_rows(tmp_path / "rows.jsonl", [{"prompt": "hello", "max_tokens": 2}])
    args = [rows, "--job-dir", tmp_path / "j"]
    if how == "flag":
        args += ["--draft-tokens", 4]
    elif how == "job file":
        (tmp_path / "job.toml").write_text('input = "rows.jsonl"\ndraft_tokens = 4\n')
        args[0] = tmp_path / "job.toml"
    else:
        monkeypatch.setenv("BATCHRUN_RUN_DRAFT_TOKENS", "4")
    with caplog.at_level("WARNING", logger="batchrun"):
        run(*args)
    assert "--draft-tokens 4 is not used: no speculation" in caplog.text
    caplog.clear()
    monkeypatch.delenv("BATCHRUN_RUN_DRAFT_TOKENS", raising=False)
    with caplog.at_level("WARNING", logger="batchrun"):  # with speculation, or by default
        run(rows, "--job-dir", tmp_path / "k", "--speculate", "ngram", "--draft-tokens", 4)
        run(rows, "--job-dir", tmp_path / "m")
    assert "--draft-tokens" not in caplog.text


def test_the_model_as_its_own_draft_is_said(tmp_path, caplog):
    rows = write_rows(tmp_path / "rows.jsonl", [{"prompt": "hello", "max_tokens": 2}])
    with caplog.at_level("WARNING", logger="batchrun"):
        run(rows, "--job-dir", tmp_path / "j", "--model", DEMO_MODEL, "--draft-model", DEMO_MODEL)
    assert "the draft model is the model itself" in caplog.text


def test_the_draft_guesses_with_the_rows_logit_bias(pair):
    """A row's logit bias changes what the model chooses; a draft guessing without it guesses
    what the model no longer chooses. Its guesses get the bias the verification gives each
    position, so rows whose bias decides their tokens keep nearly every guess."""
    favoured = pair.tokenizer.encode("Paris", add_special_tokens=False)[0]
    params = [SamplingParams(max_tokens=40, logit_bias=((favoured, 30.0),)),
              SamplingParams(max_tokens=40)] * 2
    plain, _ = run_rows(pair, chats()[:4], params)
    spec, engine = run_rows(pair, chats()[:4], params, "draft")
    assert tokens(spec) == tokens(plain)
    assert plain[0].token_ids.count(favoured) > 30  # the bias decides the row's tokens
    stats = engine.stats.speculation
    assert stats.accepted > 0.9 * stats.proposed, stats


def test_a_draft_narrower_than_the_model_adjusts_logits_as_wide_as_the_models():
    """A bias or a stop token may name an id the model has and a narrower draft lacks: the
    draft's logits are widened to the model's ids (the missing ones never guessed) before a
    row's adjustments index them."""
    draft_lm = load_model(str(DEMO_DRAFT_MODEL))
    width = len(draft_lm.tokenizer._tokenizer)
    draft = speculate.DraftModel(draft_lm.model, vocab=width + 100)
    context = list(draft_lm.tokenizer.encode("Review of a tent: it is noisy."))
    draft.sync([0], [context])
    seen = []

    def adjust(logits, offset):
        seen.append(logits.shape[-1])
        return logits.at[..., width + 50].add(5.0)  # an id past the draft's own

    guesses = draft.propose([context[-1]], mx.array([context[-1]]), 3,
                            lambda logprobs, j: mx.argmax(logprobs, axis=-1), adjust)
    assert seen == [width + 100] * 3
    assert all(0 <= t < width for t in guesses.tolist()[0])

@pytest.mark.parametrize("every", [False, True], ids=["some rows", "every row"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_a_verifications_adjustments_are_each_positions_plain_call_bit_for_bit(dtype, every):
    """A speculative step adjusts all rows and guessed positions at once; each position's
    logits must be exactly what plain decoding's call of the row's processor there gives
    (bias added, end and stop ids barred before min_tokens), whatever the row's count so far,
    the offset, rows without adjustments among them (or none: then no rows are picked out and
    put back), or a token named twice in a bias."""
    from batchrun.engine.backends.batch import LeanGenerationBatch
    from batchrun.engine.decoding.sampling import LogitAdjustments

    vocab, positions, eos = 50, 5, 3
    rows = [SamplingParams(max_tokens=40, min_tokens=6),
            SamplingParams(max_tokens=40, min_tokens=2) if every else None,
            SamplingParams(max_tokens=40, min_tokens=3, stop_token_ids=(7,),
                           logit_bias=((11, 2.5), (3, 1.0), (11, 0.1))),  # "11" and "011"
            SamplingParams(max_tokens=40, logit_bias=((4, -7.25),)),
            SamplingParams(max_tokens=40, min_tokens=1)]
    processors = [[LogitAdjustments(p, (eos,))] if p else [] for p in rows]
    for p, done in zip(processors, (1, 0, 2, 5, 0), strict=True):
        if p:
            p[0].advance(done)
    batch = LeanGenerationBatch.__new__(LeanGenerationBatch)
    batch.logits_processors = processors
    adjust = batch._adjuster([i for i, p in enumerate(processors) if p])
    logits = mx.random.normal((len(rows), positions, vocab), key=mx.random.key(3)).astype(dtype)
    for offset in (0, 2):
        got = adjust(mx.array(logits), offset)
        for i, p in enumerate(processors):
            for j in range(positions):
                want = logits[i, j][None]
                if p:  # the call plain decoding makes there: `offset + j` tokens later
                    call = LogitAdjustments(p[0].params, (eos,))
                    call.advance(p[0].generated + offset + j)
                    want = call(mx.array([], mx.int32), want.astype(dtype)).astype(dtype)
                assert np.array_equal(np.array(got[i, j].astype(mx.float32)),
                                      np.array(want[0].astype(mx.float32))), (i, j, offset)
    barred = mx.isinf(adjust(mx.array(logits), 0)[:, :, eos]).tolist()
    assert barred[0] == [True] * 5  # 1 of its 6 made: all 5 positions barred
    assert barred[4] == [True, False, False, False, False]  # 0 of 1 made
    assert barred[2] == [True, False, False, False, False]  # 2 of 3
    assert barred[1] == ([True, True, False, False, False] if every else [False] * 5)
    assert not any(barred[3])


@pytest.mark.parametrize("speculate", ["draft", "ngram"])
def test_rows_with_min_tokens_or_logit_bias_speculate_to_the_same_tokens(pair, speculate):
    """min_tokens and logit_bias depend on a token's position only: each guessed position
    gets what plain decoding's call there would give (end tokens barred until min_tokens,
    the bias added), and the rows speculate. A penalty (which depends on the tokens) keeps
    the batch plain."""
    eos = pair.tokenizer.eos_token_id
    prompts = chats()
    mixed = [SamplingParams(max_tokens=70, min_tokens=60),
             SamplingParams(max_tokens=40, logit_bias=((eos, -3.0),)),
             SamplingParams(max_tokens=50, min_tokens=8, logit_bias=((eos, 2.0),))]
    params = [mixed[i % 3] for i in range(len(prompts))]
    plain, _ = run_rows(pair, prompts, params)
    spec, engine = run_rows(pair, prompts, params, speculate)
    assert tokens(spec) == tokens(plain)
    assert all(len(o.token_ids) >= 60 for o in plain[::3])  # past the model's own answer
    stats = engine.stats.speculation
    assert stats.steps > 0 and stats.accepted > 0
    # a row with a penalty, running longest: the batch holds it at every step
    penalized = [SamplingParams(max_tokens=80, min_tokens=80, repetition_penalty=1.2)] + \
        params[1:]
    plain, _ = run_rows(pair, prompts, penalized)
    spec, engine = run_rows(pair, prompts, penalized, speculate)
    assert tokens(spec) == tokens(plain) and engine.stats.speculation.steps == 0


def test_the_trained_pair_keeps_most_guesses_on_essays_and_n_grams_on_references(pair):
    """The workloads speculation is for (README: what it gains): the draft guesses the trained
    demo's essays, and prompt lookup its quotes of a reference in the prompt; most guesses are
    kept and the tokens are plain decoding's."""
    topics = lessons.TOPICS[:4]
    params = SamplingParams(max_tokens=64)
    essays = chats([lessons.ESSAY_TASKS[0].format(t=t) for t in topics])
    quotes = [[{"role": "system", "content": lessons.reference_text(t)},
               {"role": "user", "content": lessons.REFERENCE_TASKS[2].format(t=t)}]
              for t in topics]
    for prompts, kind in ((essays, "draft"), (quotes, "ngram")):
        plain, _ = generate(pair, prompts, params, concurrency=4)
        spec, engine = generate(pair, prompts, params, kind, concurrency=4, k=6)
        assert tokens(spec) == tokens(plain)
        stats = engine.stats.speculation
        assert stats.proposed > 0 and stats.accepted > 0.8 * stats.proposed, (kind, stats)


def test_the_draft_caches_one_token_mask_is_mlx_lms():
    """A guess's forward takes the draft cache's own mask (one comparison): it must let each
    row see exactly the keys mlx-lm's mask lets it see, as the rows' starts differ and the cache
    grows, and other calls keep mlx-lm's."""
    from mlx_lm.models.base import create_causal_mask

    cache = speculate.DraftCache([3, 0, 5])
    for step in range(4):
        width = 2 if step == 0 else 1
        cache.update_and_fetch(mx.zeros((3, 1, width, 4)), mx.zeros((3, 1, width, 4)))
        for n in (1, 2):
            got = cache.make_mask(n)
            want = create_causal_mask(n, offset=cache._idx, left_padding=cache.left_padding)
            assert np.array_equal(np.broadcast_to(np.array(got), want.shape), np.array(want))
        assert np.array(cache.make_mask(1))[1, 0, 0].all()  # a row without padding sees all
        assert not np.array(cache.make_mask(1))[2, 0, 0, :5].any()  # padding is never seen


@pytest.mark.parametrize("made", [0, 30], ids=["all before min_tokens", "all past it"])
def test_adjustments_barring_every_position_or_none_are_each_positions_plain_call(made):
    """Where every row's guessed positions all come before its min_tokens (or all after), the
    adjustments take a shortcut; each position's logits must still be exactly what the row's
    own call there gives."""
    from batchrun.engine.decoding.sampling import LogitAdjustments, RowAdjustments

    vocab, positions, eos = 40, 4, 2
    rows = [SamplingParams(max_tokens=60, min_tokens=20, logit_bias=((5, 1.5),)),
            SamplingParams(max_tokens=60, min_tokens=25, stop_token_ids=(9,))]
    processors = [LogitAdjustments(p, (eos,)) for p in rows]
    for p in processors:
        p.advance(made)
    adjust = RowAdjustments(processors)
    logits = mx.random.normal((len(rows), positions, vocab), key=mx.random.key(5))
    for offset in (0, 3):
        got = adjust(logits, offset)
        for i, p in enumerate(processors):
            for j in range(positions):
                call = LogitAdjustments(p.params, (eos,))
                call.advance(p.generated + offset + j)
                want = call(mx.array([], mx.int32), logits[i, j][None])
                assert np.array_equal(np.array(got[i, j]), np.array(want[0])), (i, j, offset)
    assert mx.isinf(adjust(logits, 0)[:, :, eos]).all().item() == (made == 0)
