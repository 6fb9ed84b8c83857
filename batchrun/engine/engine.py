"""The continuous-batching engine: one core over a model backend (text.py, vision.py).

Invariants:
- every request added ends as exactly one Output (stop / length / abort / error);
- admission keeps the running batch within the memory budget and `max_concurrency`, and an
  exception while stepping loses no row (scheduler.py);
- sampling randomness belongs to the request (sampling.py), so a row's text does not depend on
  which other rows share its batch;
- with a prefix cache, a prompt prefix shared by queued or running rows is computed once, into
  the cache, before the first of them starts; all of them then start from the cache
  (prefix_plan.py), attending one shared copy of it where the backend can (shared_prefix.py).

Each `step()` admits what fits, runs one backend step (a decode step for the running rows, and a
prefill chunk for rows joining) and returns the requests that finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from batchrun.cache.prefix import Block, PrefixCache
from batchrun.engine.backends.base import Backend
from batchrun.engine.cache_control import PrefixCacheControl
from batchrun.engine.config import EngineConfig, device_defaults
from batchrun.engine.decoding.choices import set_answer
from batchrun.engine.decoding.constrain import Grammars, choice_token_ids
from batchrun.engine.decoding.reasoning import Markup, ThinkingBudget, ThinkingGate
from batchrun.engine.generate import is_chat, prompt_ids, sampling_params
from batchrun.engine.kernels import host_attention
from batchrun.engine.memory import MemoryBudget, device_memory_bytes, kv_budget, measure_kv
from batchrun.engine.postprocess import (
    NOT_FINITE,
    Step,
    StopScanner,
    make_output,
    record_logprobs,
)
from batchrun.engine.prefix_plan import PrefixNeeded
from batchrun.engine.scheduler import Scheduler
from batchrun.engine.sequence import Sequence, Status
from batchrun.engine.serving import EngineStopped, Serving, Stream
from batchrun.engine.stats import EngineStats
from batchrun.engine.types import ConstraintError, FinishReason, Output, SamplingParams
from batchrun.models.weights import WeightPlan

log = logging.getLogger("batchrun")

FAULTS_SAID = 5  # failed steps an engine warns of, a line each

TIMELINE_INTERVAL_S = 0.5
# warm_up's rows (first token id, length): unequal lengths, so the prefill is padded as a
# job's are, and no common start.
WARM_UP_PROMPTS = ((1, 16), (40, 9))
# Rows keep their computed prompts' blocks in the prefix cache (_keep_prompts); "0" turns it
# off, for the side-by-side benchmark (BENCHMARKS.md, "Prefix cache").
KEEP_PROMPTS = os.environ.get("BATCHRUN_KEEP_PROMPTS", "1") != "0"
# ... and only while the device's memory in use stays under this share of MLX's memory limit:
# a batch's KV caches are allocated past what the admission budget counts (rows padded to the
# longest and grown in steps), and kept blocks that take that slack put decode steps at the
# limit, where each allocation waits (BENCHMARKS.md, "Choices at speed": 1,024 decoding rows
# ran at half speed with their prompts kept). Kept blocks not yet reused are dropped when
# memory in use passes it.
KEEP_BELOW_LIMIT = 0.8
# ... and only while keeping pays: once KEEP_PROBE_ROWS rows have kept their prompts and no
# later row has started from a kept block, the next KEEP_PAUSE_ROWS rows keep none, then
# keeping is tried again. A decode job's rows are unique: with all 1,024 rows' prompts kept its
# decode ran at 0.64x the speed without (BENCHMARKS.md, "Choices at speed").
KEEP_PROBE_ROWS = 256
KEEP_PAUSE_ROWS = 4096


class Engine:
    """Add requests, call `step()` until `has_work()` is false; each step returns finished ones.

    `Engine(model, tokenizer, ...)` serves a text model (mlx-lm); pass `backend` for another
    (vision_engine.py's VisionEngine does). Its parts: the backend, the scheduler (with the
    memory budget), the prefix cache's control (cache_control.py) and the speculator."""

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | None = None,
                 context_length: int | None = None, model_path: str = "",
                 prefix_cache: PrefixCache | None = None, model_fingerprint: str = "",
                 backend: Backend | None = None, weight_plan: WeightPlan | None = None):
        if backend is None:
            from batchrun.engine.backends.text import TextBackend

            backend = TextBackend(model, tokenizer)
        self.backend = backend
        self.model = model
        self.serving = Serving(self)  # start(): steps on a thread of their own
        self._caller_ids: dict[Any, int] = {}  # running or waiting requests' chosen ids
        self._stopped = False
        self.tokenizer = backend.tokenizer
        self.prompts = backend.prompts
        cap, prefill_tokens = device_defaults(backend.kv_model)
        config = config or EngineConfig()
        self.config = dataclasses.replace(config, prefill_tokens=config.prefill_tokens
                                          or prefill_tokens)
        self.context_length = context_length
        self.model_path = model_path
        self.model_fingerprint = model_fingerprint
        # How load() held the weights (None: as given); the prefix cache's key includes it.
        self.weight_plan = weight_plan
        cache_key = weight_plan.cache_key(model_fingerprint) if weight_plan and \
            model_fingerprint else model_fingerprint
        budget = self.config.kv_budget_bytes
        if budget is None:
            budget = kv_budget(model, self.config.memory_utilization)
        self.memory = MemoryBudget(measure_kv(backend.kv_model), budget)
        # MLX's memory limit on a GPU (kv_budget), the share of RAM that stands for it on a CPU
        self.memory_limit = int(device_memory_bytes() * self.config.memory_utilization)
        self.scheduler = Scheduler(self.memory, self.config.max_concurrency or cap,
                                   self.config.prefill_batch_size)
        self.cache_control = PrefixCacheControl(self.scheduler, backend, self.memory,
                                                self.config, cache_key, prefix_cache)
        self._grammars: Grammars | None = None
        self._markup: Markup | None = None
        self._ids = itertools.count()
        self._finished: list[Output] = []
        # _keep_prompts' record: rows kept since a kept block was last reused, the reuse count
        # then, rows still to skip, and whether unreused kept blocks may be in memory
        self._kept_rows = self._kept_reused = self._keep_paused = 0
        self._holding_kept = False
        self.speculator = self._speculator(backend)
        self._start_figures()
        backend.start(self.max_concurrency, self.config)

    def _speculator(self, backend: Backend):
        """The config's speculative decoding (speculate.py) for a backend that takes it, with
        its draft model loaded; None when off. ValueError for a draft whose tokenizer is not
        this model's."""
        method = self.config.speculate
        if method == "off":
            return None
        if not hasattr(backend, "speculate"):
            log.warning("speculative decoding serves text models; this one decodes without it")
            return None
        from batchrun.engine.backends.text import vocab_size
        from batchrun.engine.decoding.speculate import DraftModel, Speculator

        draft = None
        if method == "draft":
            from batchrun.models import DraftModelError, load_model

            name = self.config.draft_model
            try:
                loaded = load_model(name)
                from batchrun.models.weights import plan_and_apply

                plan_and_apply(loaded.model, self.config.weights,  # held as the model is
                               self.config.memory_utilization)
            except Exception as e:
                raise DraftModelError(f"the draft model {name} could not be loaded: {e}") \
                    from e
            if not same_vocabulary(loaded.tokenizer, self.tokenizer):
                raise DraftModelError(f"the draft model {name} does not share the model's "
                                      "tokenizer (its vocabulary differs)")
            if self.model_path and Path(loaded.path).resolve() == Path(self.model_path).resolve():
                log.warning("the draft model is the model itself: its guesses cost as much as "
                            "the steps they would save")
            ids, width = len(self.tokenizer._tokenizer), vocab_size(loaded.model, loaded.tokenizer)
            if width < ids:  # a token past its table would be read from outside it
                raise DraftModelError(f"the draft model {name} has {width} token ids, fewer "
                                      f"than the {ids} its tokenizer writes")
            # a wider draft (a vocabulary padded further) guesses within the model's ids only
            draft = DraftModel(loaded.model, self.config.prefill_step_size,
                               vocab=backend.vocab_size)
            if not draft.usable:
                raise DraftModelError(f"the draft model {name}: its KV cache cannot drop "
                                      "tokens (a sliding window or recurrent state)")
        speculator = Speculator(method, self.config.draft_tokens, draft)
        backend.speculate(speculator)
        return speculator

    def _start_figures(self) -> None:
        """The engine's figures (stats, timeline) from zero, timed from now."""
        self.stats = EngineStats()
        if self.speculator is not None:
            self.speculator.stats = self.stats.speculation
        self._started = time.perf_counter()
        self._last_sample = -TIMELINE_INTERVAL_S

    @classmethod
    def load(cls, model: str | None = None, config: EngineConfig | None = None,
             **engine_options) -> Engine:
        """Load a model (None: the demo model); options as EngineConfig's fields."""
        from batchrun.models.weights import plan_and_apply

        config = config or EngineConfig(**engine_options)
        loaded = cls._load_model(model)
        plan = plan_and_apply(loaded.model, config.weights, config.memory_utilization)
        engine = cls(loaded.model, loaded.tokenizer, config, loaded.context_length, loaded.path,
                     model_fingerprint=loaded.fingerprint, weight_plan=plan)
        engine.enable_prefix_cache()
        return engine

    @staticmethod
    def _load_model(model: str | None):
        from batchrun.models import load_model

        return load_model(model)

    @property
    def max_concurrency(self) -> int:
        return self.scheduler.max_concurrency

    @property
    def faults(self) -> int:
        return self.scheduler.faults

    # -- adding work ---------------------------------------------------------------------------

    @property
    def grammars(self) -> Grammars:
        """The grammar compiler for this model's tokenizer (built on first use)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.backend.vocab_size,
                                      list(self.backend.eos))
        return self._grammars

    def check_constraint(self, constraint) -> None:
        """Raise ConstraintError unless the constraint compiles for this model."""
        self.grammars.check(constraint)

    def warm_up(self, cpu_too: bool = False) -> None:
        """On a GPU: two short rows through the whole path (a padded prefill, decode steps,
        batchrun's decode kernel compiled and checked), so that the process's first use of each
        kernel overlaps the job's reading and tokenizing of rows instead of delaying its first
        prefill. Nothing reaches the prefix cache, and the engine's figures start afresh after
        it. Nothing to do on the CPU (unless `cpu_too`), or once rows are queued."""
        import mlx.core as mx

        if (mx.default_device() == mx.cpu and not cpu_too) or self.has_work():
            return
        with self.cache_control.set_aside():
            for start, length in WARM_UP_PROMPTS:
                self.add_tokens([i % self.backend.vocab_size for i in range(start, start + length)],
                                SamplingParams(max_tokens=3))
            self.run()
        self._start_figures()

    def read_ahead(self, prompt: list[int]) -> None:
        """Start reading from disk the cached prefix blocks of a text prompt about to be added
        (from any thread: a job's feeder does while the engine warms up, whose rows the
        prefix cache does not see)."""
        self.cache_control.read_ahead(prompt)

    def add_request(self, prompt: str | list[int] | None = None,
                    params: SamplingParams | None = None, *, messages: list[dict] | None = None,
                    tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                    enable_thinking: bool | None = None, continue_final_message: bool = False,
                    request_id: Any = None) -> Any:
        """Queue a request (token ids, a raw prompt, or chat messages); returns its id: the
        caller's `request_id` if given (its Output carries it; one still running or waiting
        is a ValueError), else a number of the engine's."""
        ids = prompt_ids(self.prompts, prompt, messages=messages, tools=tools,
                         chat_template_kwargs=chat_template_kwargs,
                         enable_thinking=enable_thinking,
                         continue_final_message=continue_final_message)
        return self.add_tokens(ids, params or SamplingParams(), request_id=request_id)

    def add_tokens(self, prompt: list[int], params: SamplingParams, inputs: Any = None,
                   request_id: Any = None) -> Any:
        """Queue a request from token ids (and what the backend needs besides); its id (the
        caller's `request_id`, as add_request)."""
        if self._stopped:
            raise EngineStopped("the engine is stopped (stop() or close() let go of its model "
                                "and caches): load one again with Engine.load")
        if request_id is not None and request_id in self._caller_ids:
            raise ValueError(f"request id {request_id!r} is already in use by a request that "
                             "has not finished")
        seq = Sequence(next(self._ids), list(prompt), params, params.max_tokens, inputs,
                       media=inputs.media if inputs is not None else (), caller_id=request_id)
        seq.thinking_opened = params.thinking is not False and \
            self.markup.opens_thinking(seq.prompt)
        constraint = params.constraint
        if constraint is not None and constraint.kind == "choices" and \
                self.backend.scores_choices and not self._reasons_first(seq):
            # Picked from the choices' probabilities right after the prompt (choices.py); a
            # second step keeps the row in the batch until its prompt cache is read.
            seq.max_tokens = 2
            lead = self._trailing_space(seq.prompt)
            if lead:  # "Sentiment: " + "positive" is scored as "Sentiment:" + " positive"
                seq.prompt = seq.prompt[:-1]
            seq.choice_tokens = choice_token_ids(self.tokenizer,
                                                 tuple(lead + c for c in constraint.value))
            longest = max(map(len, seq.choice_tokens))
            if self.context_length and len(prompt) + longest > self.context_length:
                seq.start_output(None)
                self._emit(seq, FinishReason.ERROR,
                           f"the prompt ({len(prompt)} tokens) and its longest choice "
                           f"({longest} tokens) exceed the model's context of "
                           f"{self.context_length} tokens")
                return seq.id if request_id is None else request_id
        if self.context_length:
            seq.max_tokens = min(seq.max_tokens, self.context_length - len(prompt))
        seq.start_output(self._stop_scanner(params))
        error = self._reject_reason(seq)
        if error:
            self._emit(seq, FinishReason.ERROR, error)
        else:
            self.scheduler.add(seq)
            if request_id is not None:
                self._caller_ids[request_id] = seq.id
        return seq.id if request_id is None else request_id

    def encode_text(self, text: str) -> list[int]:
        """A text's token ids, no special tokens added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @property
    def markup(self) -> Markup:
        """The tokenizer's reasoning and tool-call markup."""
        if self._markup is None:
            self._markup = Markup.of(self.tokenizer)
        return self._markup

    def _trailing_space(self, prompt: list[int]) -> str:
        """The prompt's last token when it is spaces or tabs only (an answer begun as
        "Sentiment: "), else "". A tokenizer writes a word's leading space into the word's own
        token, so a choice is scored with that space and the prompt without it, as the model
        would have written them (token healing); the label stays the choice as given."""
        if len(prompt) < 2:
            return ""
        text = self.tokenizer.decode([prompt[-1]])
        return text if text and text.strip(" \t") == "" else ""

    def _reasons_first(self, seq: Sequence) -> bool:
        """A constrained row that reasons before its answer (the constraint starts after)."""
        m = self.markup
        return m.think_start_id is not None and m.think_end_id is not None and \
            (seq.params.thinking is True or seq.thinking_opened)

    def _thinking_gate(self, seq: Sequence) -> ThinkingGate | None:
        """The gate of a row whose reasoning block is watched: a constrained row that reasons
        first, or any row with a thinking budget (single-token markers only)."""
        m, p = self.markup, seq.params
        if m.think_start_id is None or m.think_end_id is None:
            return None
        if p.thinking is False:  # a raw prompt: no reasoning block is watched
            return None
        if (p.constraint is not None and self._reasons_first(seq)) or \
                (p.constraint is None and p.max_thinking_tokens is not None):
            return ThinkingGate(m, p.max_thinking_tokens, seq.thinking_opened)
        return None

    def _stop_scanner(self, params: SamplingParams) -> StopScanner | None:
        return StopScanner(self.backend.detokenizer(), params.stop) if params.stop else None

    def _reject_reason(self, seq: Sequence) -> str | None:
        if not seq.prompt:
            return "the prompt is empty"
        if self.context_length and len(seq.prompt) >= self.context_length:
            return (f"the prompt has {len(seq.prompt)} tokens; the model's context is "
                    f"{self.context_length}: shorten the prompt")
        if not self.memory.fits_alone(seq.length):
            return (f"prompt + max_tokens = {seq.length} tokens need "
                    f"{self.memory.cost([seq.length]):,} bytes of KV cache; the budget is "
                    f"{self.memory.budget:,}: lower max_tokens or raise the memory limit")
        vocab = self.backend.vocab_size
        if any(t >= vocab for t, _ in seq.params.logit_bias):
            return f"logit_bias names token ids past the vocabulary (size {vocab})"
        if any(t >= vocab for t in seq.params.stop_token_ids):
            return f"stop_token_ids names token ids past the vocabulary (size {vocab})"
        error = self.backend.reject(seq.params)
        if error is None and seq.params.constraint is not None:
            try:
                self.grammars.check(seq.params.constraint)
            except ConstraintError as e:
                error = str(e)
        return error

    def abort(self, request_id: Any) -> bool:
        """Stop a queued or running request; it finishes with reason `abort`."""
        seq = self.scheduler.find(self._caller_ids.get(request_id, request_id))
        if seq is None:
            return False
        self._finish(seq, FinishReason.ABORT, in_batch=True)
        return True

    # -- running -------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._finished) or self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def generated_tokens(self) -> int:
        """Tokens generated so far, by finished and running requests."""
        live = sum(len(seq.tokens) for seq in self.scheduler.running.values())
        return self.stats.completion_tokens + live

    def run(self) -> list[Output]:
        """Step until every queued request has finished; outputs ordered by request id."""
        outputs = []
        while self.has_work():
            outputs.extend(self.step())
        return sorted(outputs, key=lambda o: o.request_id)

    def generate(self, prompts: Any = None, params: SamplingParams | None = None, *,
                 prompt: Any = None, **sampling) -> Any:
        """Run prompts to the end: each a text, token ids, or a chat (a list of messages).
        One prompt (`prompt=`, or a text, token ids or chat as the first argument) gives its
        Output; a list of them one Output each, in order. Sampling comes from `params` or
        keyword arguments (max_tokens=8, temperature=0.7...). Inside a running event loop it
        returns an awaitable (`await engine.generate(...)`), the requests run by the engine's
        thread (start()) beside other callers'."""
        single = prompt is not None or _one_prompt(prompts)
        given = [prompt if prompt is not None else prompts] if single else list(prompts)
        params = sampling_params(params, sampling)
        return self._complete([functools.partial(self._add_prompt, p, params) for p in given],
                              single)

    def chat(self, messages: list[dict], tools: list[dict] | None = None,
             params: SamplingParams | None = None, *, chat_template_kwargs: dict | None = None,
             enable_thinking: bool | None = None, **sampling) -> Any:
        """One chat to the end: its Output (an awaitable inside a running event loop)."""
        params = sampling_params(params, sampling)
        return self._complete([functools.partial(
            self.add_request, None, params, messages=messages, tools=tools,
            chat_template_kwargs=chat_template_kwargs, enable_thinking=enable_thinking)], True)

    def stream_generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                        **sampling) -> Stream:
        """One prompt's StreamOutputs as its tokens arrive: `for` or `async for` over it. The
        engine's thread runs it (started if it is not), beside other callers' requests."""
        self.start()
        return self.serving.stream(functools.partial(
            self._add_prompt, prompt, sampling_params(params, sampling)))

    def stream_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    params: SamplingParams | None = None, **sampling) -> Stream:
        """stream_generate for a chat (with its tools)."""
        self.start()
        return self.serving.stream(functools.partial(
            self.add_request, None, sampling_params(params, sampling), messages=messages,
            tools=tools))

    def _add_prompt(self, prompt: Any, params: SamplingParams) -> int:
        if is_chat(prompt):
            return self.add_request(messages=prompt, params=params)
        return self.add_request(prompt, params)

    def _complete(self, adds: list, single: bool) -> Any:
        """Run the requests `adds` queue to the end: their Outputs (the first alone if
        `single`); awaitable inside an event loop, waited for on the engine's thread where it
        runs, else stepped here."""
        if _in_event_loop():
            return self._await_all(adds, single)
        if self.serving.running:
            outs = [self.serving.wait(add) for add in adds]
        else:
            ids = [add() for add in adds]
            done = {o.request_id: o for o in self.run()}
            outs = [done[i] for i in ids]
        return outs[0] if single else outs

    async def _await_all(self, adds: list, single: bool) -> Any:
        self.start()
        outs = await asyncio.gather(*(self.serving.wait_async(add) for add in adds))
        return outs[0] if single else list(outs)

    def start(self) -> Any:
        """Run the engine's steps on a thread of its own, so that callers on other threads or
        in an event loop share one batch (generate, chat and streams wait for their own).
        Inside an event loop it may be awaited too, as vllm-mlx's is."""
        if self._stopped:
            raise EngineStopped("the engine is stopped: load one again with Engine.load")
        self.serving.start()
        return _maybe_awaited(None)

    def stop(self) -> Any:
        """Stop the engine's thread (requests still running end with `abort`), write the
        prefix cache's pending blocks as close() does, and let go of the model and MLX's
        buffer cache; a call after it raises EngineStopped."""
        self.serving.stop()
        self.close()
        # The weights go when the last reference does: the engine's and its backend's.
        self.model = None
        for name in ("model", "kv_model"):
            if hasattr(self.backend, name):
                setattr(self.backend, name, None)
        mx.clear_cache()  # the buffers MLX kept for reuse go back to the device
        return _maybe_awaited(None)

    def abort_request(self, request_id: Any) -> Any:
        """abort() under the name vllm-mlx's engine gives it (awaitable in an event loop)."""
        with self.serving.lock:
            return _maybe_awaited(self.abort(request_id))

    def get_stats(self) -> dict:
        """What the engine did, as a dict: requests, tokens, rates, batch sizes, memory."""
        s = self.stats
        return {"requests_finished": s.requests_finished, "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens, "completion_tokens": s.completion_tokens,
                "prefill_tokens_per_s": s.prefill_tokens_per_s,
                "decode_tokens_per_s": s.decode_tokens_per_s,
                "mean_batch_size": s.mean_batch_size, "peak_memory_bytes": s.peak_memory_bytes,
                "running": self.num_running, "waiting": self.num_waiting,
                "ttft_p50_s": s.ttft_quantile(0.5)}

    @property
    def model_name(self) -> str:
        return Path(self.model_path).name if self.model_path else "model"

    @property
    def is_mllm(self) -> bool:
        """Whether the model takes images (a vision-language model's backend)."""
        return bool(self.backend.accepts_images)

    def clear_runtime_caches(self) -> None:
        """Give MLX's buffer cache back to the device (the prefix cache is kept:
        clear_prefix_cache drops it)."""
        mx.clear_cache()

    def step(self) -> list[Output]:
        """Admit what fits, run one backend step; return the requests that finished."""
        with host_attention.forwards():  # the CPU's prefills, verifications, choices' scoring
            return self._step()

    def _step(self) -> list[Output]:
        self._admit()
        if self.scheduler.running:
            start = time.perf_counter()
            try:
                prompt_work, steps = self.backend.next()
            except Exception as e:  # a fault in the model or in mlx: rerun, never lose rows
                self._recover(e)
            else:
                self._collect(steps)
                self._account(prompt_work, len(steps), time.perf_counter() - start,
                              len({s.uid for s in steps}))
                if self._holding_kept:
                    self._release_kept()
        finished, self._finished = self._finished, []
        self.stats.requests_finished += len(finished)
        if not self.has_work():
            self.cache_control.flush()  # idle: the blocks saved on the writer thread are on disk
        return finished

    def _admit(self) -> None:
        """Start what fits, computing shared prefixes into the cache first where needed."""
        while True:
            batch, prefix = self.scheduler.schedule(self.config.prefill_tokens)
            self._insert(batch)
            if prefix is None:
                return
            self._compute_prefix(prefix)

    def _compute_prefix(self, need: PrefixNeeded) -> None:
        """Prefill a prefix that rows share, once, into the prefix cache."""
        need.seq.prefix_computed = True  # tried once: a failure or an eviction is not retried
        start = time.perf_counter()
        try:
            layer_kv = self.backend.compute_prefix(need.seq, need.upto, need.blocks)
        except Exception:  # the rows then compute it themselves; their own errors say why
            return
        self.prefix_cache.store(need.seq.prompt, layer_kv, need.upto, need.seq.media,
                                getattr(layer_kv, "snapshots", None))
        self.stats.prefill_time += time.perf_counter() - start

    def _insert(self, batch: list[tuple[Sequence, list[Block]]]) -> None:
        # A prefill pads its rows to the longest: inserting by length wastes less on padding.
        batch.sort(key=lambda item: len(item[0].prompt) - item[0].cached)
        ready = []
        for seq, blocks in batch:
            error = self.backend.prepare(seq)
            if error is not None:  # e.g. a model that rejects this row's images
                self._finish(seq, FinishReason.ERROR, error=error)
                continue
            constraint = seq.params.constraint
            gate = self._thinking_gate(seq)  # fresh, also on a rerun
            if constraint is not None and seq.choice_tokens is None:
                seq.processor = self.grammars.processor(constraint, gate)
            elif gate is not None:
                seq.thinking_budget = ThinkingBudget(gate)
            ready.append((seq, blocks))
        if not ready:
            return
        start = time.perf_counter()
        uids = self.backend.insert([s for s, _ in ready], [b for _, b in ready],
                                   self.scheduler.waiting)
        now = time.perf_counter()
        self.stats.prefill_time += now - start  # a shared tail is prompt work (text.py)
        for uid, (seq, _) in zip(uids, ready, strict=True):
            self.scheduler.started(seq, uid)
            seq.admitted_at = now
            self.stats.prompt_tokens += len(seq.prompt)
            self.stats.cached_tokens += seq.cached
            self.stats.cached_disk_tokens += seq.cached_disk

    def _collect(self, steps: list[Step]) -> None:
        now = time.perf_counter()
        choosing: list[tuple[Sequence, Step]] = []
        started = [s for step in steps
                   if (s := self.scheduler.running.get(step.uid)) is not None
                   and s.ttft is None and step.finish_reason is None]
        if started:
            self._keep_prompts(started)
        for step in steps:
            seq = self.scheduler.running.get(step.uid)
            if seq is None:
                continue
            in_batch = step.finish_reason is None
            if seq.ttft is None:
                seq.ttft = now - seq.admitted_at
                if seq.choice_tokens is not None:
                    choosing.append((seq, step))
                    continue
            if step.finish_reason == NOT_FINITE:
                self._finish(seq, FinishReason.ERROR, in_batch=False, error=NOT_FINITE_ERROR)
                continue
            if step.token in self.backend.eos or step.token in seq.params.stop_token_ids:
                self._finish(seq, FinishReason.STOP, in_batch)
                continue
            seq.tokens.append(step.token)
            record_logprobs(seq, step)
            if seq.stops is not None and seq.stops.add(step.token):
                self._finish(seq, FinishReason.STOP, in_batch)
            elif not in_batch:
                reason = FinishReason.STOP if step.finish_reason == "stop" else \
                    FinishReason.LENGTH
                self._finish(seq, reason, in_batch=False)
        if choosing:
            self._answer_choices(choosing)

    def _keep_prompts(self, rows: list[Sequence]) -> None:
        """Rows that just computed their prompts keep its full blocks in the prefix cache (in
        memory, least recently used first; on disk once a later row reuses one), so a later
        row with the same start (a conversation's next turn, a repeated instruction far down
        the file) reads them instead of computing them again. Only where the backend hands out
        a row's prompt KV from the batch."""
        cache = self.prefix_cache
        if cache is None or not KEEP_PROMPTS or not getattr(self.backend, "keeps_prompts", False):
            return
        missing = [(s, sum(k not in cache.blocks for k in s.block_keys)) for s in rows
                   if not s.media and s.block_keys]
        missing = [(s, n) for s, n in missing if n]
        if cache.stats.kept_reused != self._kept_reused:  # keeping paid: probe afresh
            self._kept_reused, self._kept_rows, self._keep_paused = cache.stats.kept_reused, 0, 0
        if self._keep_paused > 0:
            self._keep_paused = max(0, self._keep_paused - len(missing))
            return
        missing = missing[: KEEP_PROBE_ROWS - self._kept_rows]
        if not missing:
            return
        rows = [s for s, _ in missing]
        new_blocks = sum(n for _, n in missing)
        if mx.get_active_memory() + new_blocks * self._block_bytes \
                > KEEP_BELOW_LIMIT * self.memory_limit:
            self._release_kept()  # past the line already: the unreused ones go too
            return
        self._kept_rows += len(rows)
        if self._kept_rows >= KEEP_PROBE_ROWS:  # the next rows skip, unless these pay
            self._keep_paused = KEEP_PAUSE_ROWS
            self._kept_rows = 0
        self._holding_kept = True
        upto = [len(s.block_keys) * cache.block_size for s in rows]
        kept = []
        for seq, n, layer_kv in zip(rows, upto,
                                    self.backend.prompt_kv([s.uid for s in rows], upto),
                                    strict=True):
            for block in cache.store(seq.prompt, layer_kv, n, persist=False, evaluate=False):
                kept.extend((*block.keys, *block.values))
        # Copied on the device behind the running step, not waited for: the host goes on.
        mx.async_eval(kept)

    def _release_kept(self) -> None:
        """Kept blocks no row has reused are let go once a step finds the device's memory in
        use past KEEP_BELOW_LIMIT: the running batch's caches grow as it decodes, and a step
        at the memory limit waits on each allocation."""
        cache = self.prefix_cache
        if cache is not None and mx.get_active_memory() > KEEP_BELOW_LIMIT * self.memory_limit:
            cache.drop_kept()
            self._holding_kept = False

    @property
    def _block_bytes(self) -> int:
        return self.memory.footprint.per_token * self.prefix_cache.block_size

    def _answer_choices(self, rows: list[tuple[Sequence, Step]]) -> None:
        """Right after choices rows' prompts: score every row's choices (together, where the
        backend can), answer one each, finish them."""
        scores = self.backend.score_choices(rows)
        # They leave the batch together: one filter of its caches instead of one a row.
        self.backend.leave([seq.uid for seq, step in rows
                            if step.finish_reason is None and seq.status is Status.RUNNING])
        for (seq, _), per_token in zip(rows, scores, strict=True):
            set_answer(seq, per_token)
            if not all(math.isfinite(v) for v in seq.choice_logprobs.values()):
                seq.answer, seq.choice_logprobs, seq.tokens = None, None, []
                self._finish(seq, FinishReason.ERROR, in_batch=False, error=NOT_FINITE_ERROR)
                continue
            self._finish(seq, FinishReason.STOP, in_batch=False)

    def _finish(self, seq: Sequence, reason: FinishReason, in_batch: bool,
                error: str | None = None) -> None:
        """The sequence is done, wherever it is: out of the batch and the queues, one Output."""
        if seq.processor is not None and len(seq.tokens) > seq.processor.consumed:
            seq.processor.advance(seq.tokens[-1])  # the last token: no step consumed it yet
        if seq.status is Status.RUNNING:
            self.backend.remove(seq.uid, in_batch)
        self.scheduler.finish(seq)
        self._emit(seq, reason, error)

    def _emit(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        seq.status = Status.FINISHED
        if seq.caller_id is not None:
            self._caller_ids.pop(seq.caller_id, None)
        if seq.ttft is not None:
            self.stats.ttfts.append(seq.ttft)
        self.stats.completion_tokens += len(seq.tokens)
        self._finished.append(make_output(seq, reason, self.tokenizer.decode, error))

    def _recover(self, error: Exception) -> None:
        """Restart the running rows on a fresh batch: in halves, or at lower concurrency. The
        first few faults are said (a line each), the rest counted (`faults`)."""
        rows, oom = len(self.scheduler.running), _out_of_memory(error)
        if self.scheduler.faults < FAULTS_SAID:
            first_line = (str(error).strip().splitlines() or [""])[0][:160]
            then = ("its row fails alone" if rows == 1 else
                    f"its {rows} rows run again, {'fewer' if oom else 'half'} at a time")
            last = self.scheduler.faults == FAULTS_SAID - 1
            log.warning("a batch step failed (%s: %s): %s%s", type(error).__name__, first_line,
                        then, "; further failed steps are not said" if last else "")
        failed = self.scheduler.recover(
            oom, lambda seq: seq.start_output(self._stop_scanner(seq.params)))
        self.backend.start(self.max_concurrency, self.config)  # sized by the new concurrency
        if failed is not None:
            self._finish(failed, FinishReason.ERROR, in_batch=False, error=(
                f"the engine failed on this row alone: {type(error).__name__}: {error}"))

    def _account(self, prompt_work: bool, decoded: int, seconds: float, rows: int) -> None:
        self.stats.record_step(prompt_work, decoded, seconds, mx.get_peak_memory(), rows)
        self.sample_timeline()

    def sample_timeline(self, force: bool = False) -> None:
        """Record (time, prompt tokens, generated tokens, running) every interval, or now."""
        t = time.perf_counter() - self._started
        if force or t - self._last_sample >= TIMELINE_INTERVAL_S:
            self._last_sample = t
            self.stats.timeline.append((round(t, 3), self.stats.prompt_tokens,
                                        self.generated_tokens, self.num_running))

    # -- the prefix cache (cache_control.py) ----------------------------------------------------

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache rows start from (None: none, or set aside by the warm-up)."""
        return self.cache_control.cache

    def enable_prefix_cache(self) -> None:
        """Turn on the config's prefix cache, where the model's KV cache can be cut into blocks."""
        self.cache_control.enable()

    def get_cache_stats(self) -> dict | None:
        """Prefix-cache figures: hits, misses, tokens served, blocks and bytes in memory."""
        return self.cache_control.stats()

    def clear_prefix_cache(self) -> None:
        """Drop the in-memory prefix cache (the disk copy stays)."""
        self.cache_control.clear()

    def save_cache_to_disk(self, cache_dir: str | Path) -> int:
        """Write every in-memory block to `cache_dir`; returns how many were written."""
        return self.cache_control.save(cache_dir)

    def load_cache_from_disk(self, cache_dir: str | Path) -> int:
        """Load this model's blocks from `cache_dir` into memory; returns how many loaded."""
        return self.cache_control.load(cache_dir)

    def close(self) -> None:
        """The engine is done: what its prefix cache has for the disk is written, and a cache
        it made itself (Engine.load's) lets go of its threads and folder. A request added
        after it raises EngineStopped."""
        if self.serving.running:
            self.serving.stop()
        self._stopped = True
        self.cache_control.close()
        self.backend.close()


def _one_prompt(prompts: Any) -> bool:
    """A text, token ids or a chat: one prompt (a list of those is several)."""
    if isinstance(prompts, str) or is_chat(prompts):
        return True
    return isinstance(prompts, list) and bool(prompts) and all(
        type(t) is int for t in prompts)


class _Done:
    """A value that may also be awaited: what start(), stop() and abort_request() return
    inside an event loop, so that vllm-mlx's `await engine.stop()` and a plain call both work
    (the work is done at the call either way)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __await__(self):
        return self.value
        yield  # a generator: awaiting it gives the value at once

    def __bool__(self) -> bool:
        return bool(self.value)

    def __eq__(self, other: object) -> bool:
        return self.value == (other.value if isinstance(other, _Done) else other)

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


def _maybe_awaited(value: Any) -> Any:
    return _Done(value) if _in_event_loop() else value


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


NOT_FINITE_ERROR = ("the model's log-probabilities for this row are not numbers (NaN or "
                    "infinite): an overflow in half precision, or damaged weights")


def _out_of_memory(error: Exception) -> bool:
    return isinstance(error, MemoryError) or "out of memory" in str(error).lower() \
        or "bad_alloc" in str(error)


def same_vocabulary(a: Any, b: Any) -> bool:
    """Whether two mlx-lm tokenizers map the same strings to the same ids."""
    vocab = [getattr(getattr(t, "_tokenizer", t), "get_vocab", None) for t in (a, b)]
    if None in vocab:
        return False
    return vocab[0]() == vocab[1]()
