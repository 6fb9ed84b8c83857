"""The continuous-batching engine for vision-language models, on mlx-vlm's BatchGenerator.

Text-only rows, one-image rows and multi-image rows of any image sizes share one running batch
and join it as others finish. Every row enters the BatchGenerator as its prompt's token ids plus
its own input embeddings (image features merged into the text embeddings by the model's
`get_input_embeddings`), as mlx-vlm's server does; mlx-vlm's `batch_generate` (one image per row,
rows split by image shape) is not used.

Per-row behaviour matches the text engine:
- sampling: mlx-vlm samples a whole batch with one sampler, so the batch samples greedily and a
  sampled row perturbs its own logits with Gumbel noise from its seed and token position
  (argmax of logits / T + Gumbel noise is a draw from softmax(logits / T)): the row's text does
  not depend on the batch;
- stop strings and stop token ids end a row (EOS is mlx-vlm's own stop criterion);
- constraints (JSON schema, regex, choices as a grammar) run as logits processors.

The prefix cache is not used for vision models: a prefix's KV depends on the images, which the
token ids do not show (every image is the same run of placeholder tokens), so no KV is reused
across rows. A repeated image is decoded once (io/media.py) and, for models whose
`get_input_embeddings` takes `cached_image_features` (the Qwen2-VL family), its vision features
are computed once per job.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from batchrun.engine.constrain import ConstraintError, GrammarProcessor, Grammars
from batchrun.engine.engine import (
    MAX_AUTO_CONCURRENCY,
    TIMELINE_INTERVAL_S,
    StepLoop,
    _find_stop,
)
from batchrun.engine.memory import MemoryBudget, kv_budget, measure_kv
from batchrun.engine.request import (
    EngineConfig,
    EngineStats,
    FinishReason,
    Output,
    SamplingParams,
)

FEATURE_CACHE_SIZE = 256  # images whose vision features are kept (an LRU)
MAX_IMAGES_PER_ROW = 32  # more is a row error (too_many_images); the context also bounds it


@dataclass(slots=True)
class VisionInputs:
    """A row's processor output: token ids with image placeholders, and pixel tensors."""

    input_ids: list[int]
    pixel_values: Any = None  # mx.array, or None for a text-only row
    extra: dict = field(default_factory=dict)  # image_grid_thw, attention_mask, ...
    digests: tuple[str, ...] = ()  # content hashes of the row's images, in order


class VisionPrompts:
    """Prompts for a vision model: its processor's chat template, and the processor's inputs
    (token ids with image placeholders expanded, pixel tensors) for a row's images."""

    def __init__(self, processor: Any, model_config: Any):
        self.processor = processor
        self.tokenizer = processor.tokenizer if hasattr(processor, "tokenizer") else processor
        self.image_token_index = getattr(model_config, "image_token_index", None) or getattr(
            model_config, "image_token_id", None)
        self.max_images = MAX_IMAGES_PER_ROW

    def render(self, messages: list[dict], tools: list | None = None,
               chat_template_kwargs: dict | None = None) -> str:
        """The chat as text; image parts become the template's image placeholders."""
        from batchrun.engine.prompt import PromptError

        parts_messages = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = [{"type": "image"} if part.get("type") in ("image_url", "image")
                           else {"type": "text", "text": part.get("text", "")}
                           for part in content if isinstance(part, dict)]
            parts_messages.append({**m, "content": content})
        template_owner = self.processor if getattr(self.processor, "chat_template", None) \
            else self.tokenizer
        try:
            return template_owner.apply_chat_template(
                parts_messages, tools=tools, add_generation_prompt=True, tokenize=False,
                **(chat_template_kwargs or {}))
        except Exception as e:  # a template error is the row's, never the job's
            raise PromptError(f"the chat template could not render the messages: {e}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def encode_chat(self, messages: list[dict], tools: list | None = None,
                    enable_thinking: bool | None = None,
                    chat_template_kwargs: dict | None = None) -> list[int]:
        kwargs = dict(chat_template_kwargs or {})
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        return self.prepare(messages, [], tools, kwargs).input_ids

    def prepare(self, messages: list[dict], images: list, tools: list | None = None,
                chat_template_kwargs: dict | None = None) -> VisionInputs:
        """Processor inputs for a chat with `images` (LoadedImage, in order of appearance)."""
        from mlx_vlm.utils import prepare_inputs

        text = self.render(messages, tools, chat_template_kwargs)
        pictures = [image.image for image in images]
        inputs = prepare_inputs(self.processor, images=pictures or None, prompts=[text],
                                image_token_index=self.image_token_index,
                                add_special_tokens=False)
        ids = inputs["input_ids"]
        input_ids = [int(t) for t in (ids.tolist()[0] if hasattr(ids, "tolist") else ids[0])]
        extra = {k: v for k, v in inputs.items()
                 if k not in ("input_ids", "pixel_values", "attention_mask") and v is not None}
        return VisionInputs(input_ids, inputs.get("pixel_values") if pictures else None, extra,
                            tuple(image.digest for image in images))


class GumbelSampler:
    """A sampled row's own randomness as a logits processor: filter, scale by 1/T, add Gumbel
    noise drawn with key `step` of the row's key sequence. The batch then takes the argmax."""

    def __init__(self, params: SamplingParams, seed: int):
        self.params = params
        self.keys = mx.random.split(mx.random.key(seed & 0xFFFF_FFFF_FFFF_FFFF),
                                    params.max_tokens)
        self.step = 0

    def __call__(self, context: Any, logits: mx.array) -> mx.array:
        p = self.params
        x = logits.astype(mx.float32)
        x = x - mx.logsumexp(x, axis=-1, keepdims=True)
        if p.top_k > 0:
            x = apply_top_k(x, p.top_k)
        if 0 < p.top_p < 1:
            x = apply_top_p(x, p.top_p)
        if p.min_p > 0:
            x = apply_min_p(x, p.min_p)
        key = self.keys[min(self.step, p.max_tokens - 1)]
        self.step += 1
        noise = mx.random.gumbel(shape=x.shape, key=key)
        return x / p.temperature + noise

    def process_last_token(self, token: int, logits: mx.array) -> mx.array:
        return self(None, logits)


@dataclass(slots=True)
class _Row:
    id: int
    inputs: VisionInputs
    params: SamplingParams
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    processor: GrammarProcessor | None = None
    stop_scan_from: int = 0  # text offset before which no stop string can start
    uid: int | None = None
    admitted_at: float = 0.0
    ttft: float | None = None


class VisionEngine(StepLoop):
    """Add requests (`add_vision`, or `add_tokens` for text-only rows), call `step()` until
    `has_work()` is false; each step returns finished outputs. Same surface as `Engine`."""

    def __init__(self, model: Any, processor: Any, config: EngineConfig | None = None,
                 context_length: int | None = None, model_path: str = "",
                 model_fingerprint: str = ""):
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer if hasattr(processor, "tokenizer") else processor
        self.config = config or EngineConfig()
        self.context_length = context_length
        self.model_path = model_path
        self.model_fingerprint = model_fingerprint
        self.prefix_cache = None
        self.prompts = VisionPrompts(processor, model.config)
        self.max_concurrency = self.config.max_concurrency or MAX_AUTO_CONCURRENCY
        budget = self.config.kv_budget_bytes
        if budget is None:
            budget = kv_budget(model, self.config.memory_utilization)
        self.memory = MemoryBudget(measure_kv(model.language_model), budget)
        self.stats = EngineStats()
        self._eos = set(_eos_ids(self.tokenizer, model))
        self._ids = itertools.count()
        self._waiting: deque[_Row] = deque()
        self._running: dict[int, _Row] = {}
        self._finished: list[Output] = []
        self._grammars: Grammars | None = None
        self._features: OrderedDict[str, mx.array] = OrderedDict()
        self.feature_hits = self.feature_misses = 0
        self._started = time.perf_counter()
        self._last_sample = -TIMELINE_INTERVAL_S
        self._gen = self._new_generator()

    @classmethod
    def load(cls, model: str | None = None, config: EngineConfig | None = None,
             **engine_options) -> VisionEngine:
        """Load a vision-language model; options as EngineConfig's fields."""
        from batchrun.models import load_vision_model

        config = config or EngineConfig(**engine_options)
        loaded = load_vision_model(model)
        return cls(loaded.model, loaded.tokenizer, config, loaded.context_length, loaded.path,
                   loaded.fingerprint)

    def _new_generator(self):
        from mlx_vlm.generate import BatchGenerator

        return BatchGenerator(
            self.model.language_model, self.processor, stop_tokens=sorted(self._eos),
            completion_batch_size=self.max_concurrency,
            prefill_batch_size=min(self.config.prefill_batch_size, self.max_concurrency),
            prefill_step_size=self.config.prefill_step_size,
            compute_logprobs=True, greedy_sampling=True)

    # -- the same surface as Engine -------------------------------------------------------------

    @property
    def grammars(self) -> Grammars:
        if self._grammars is None:
            vocab = getattr(getattr(self.model, "config", None), "vocab_size", None) or getattr(
                getattr(self.model.config, "text_config", None), "vocab_size", None)
            self._grammars = Grammars(self.tokenizer, vocab or len(self.tokenizer),
                                      sorted(self._eos))
        return self._grammars

    def check_constraint(self, constraint) -> None:
        self.grammars.check(constraint)

    def get_cache_stats(self) -> dict | None:
        return None

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._finished)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def generated_tokens(self) -> int:
        return self.stats.completion_tokens + sum(len(r.tokens) for r in self._running.values())

    def add_tokens(self, prompt: list[int], params: SamplingParams) -> int:
        """A text-only request from token ids."""
        return self.add_vision(VisionInputs(list(prompt)), params)

    def add_vision(self, inputs: VisionInputs, params: SamplingParams) -> int:
        """A request from a processor's output (see `prepare`)."""
        request_id = next(self._ids)
        max_tokens = params.max_tokens
        if self.context_length:
            max_tokens = min(max_tokens, self.context_length - len(inputs.input_ids))
        row = _Row(request_id, inputs, params, max_tokens,
                   logprobs=[] if params.logprobs else None,
                   top_logprobs=[] if params.top_logprobs else None)
        error = self._reject_reason(row)
        if error:
            self._finished.append(self._output(row, FinishReason.ERROR, error))
        else:
            self._waiting.append(row)
        return request_id

    def _reject_reason(self, row: _Row) -> str | None:
        n = len(row.inputs.input_ids)
        if n == 0:
            return "the prompt is empty"
        if not self.memory.fits_alone(n + row.max_tokens):
            return (f"prompt + max_tokens = {n + row.max_tokens} tokens need more KV cache than "
                    f"the budget of {self.memory.budget:,} bytes: lower max_tokens")
        if self.context_length and n >= self.context_length:
            return (f"the prompt has {n} tokens (images included); the model's context is "
                    f"{self.context_length}: shorten the prompt or use fewer images")
        if row.params.logprobs and not row.params.greedy:
            return "logprobs with temperature > 0 are not supported on vision models yet"
        if row.params.constraint is not None:
            try:
                self.grammars.check(row.params.constraint)
            except ConstraintError as e:
                return str(e)
        return None

    def abort(self, request_id: int) -> bool:
        for uid, row in list(self._running.items()):
            if row.id == request_id:
                self._finish(uid, FinishReason.ABORT)
                return True
        for row in self._waiting:
            if row.id == request_id:
                self._waiting.remove(row)
                self._finished.append(self._output(row, FinishReason.ABORT))
                return True
        return False

    def step(self) -> list[Output]:
        self._admit()
        if self._running:
            start = time.perf_counter()
            _, responses = self._gen.next()
            self._collect(responses)
            self.stats.prefill_time = self._gen._prompt_time_counter
            self.stats.decode_time += time.perf_counter() - start
            if responses:
                self.stats.decode_steps += 1
                self.stats.batch_size_sum += len(responses)
            self.stats.peak_memory_bytes = max(self.stats.peak_memory_bytes,
                                               mx.get_peak_memory())
            self.sample_timeline()
        finished, self._finished = self._finished, []
        self.stats.requests_finished += len(finished)
        return finished

    def close(self) -> None:
        self._gen.close()

    # -- admission and decoding -----------------------------------------------------------------

    def _admit(self) -> None:
        while (self._waiting and len(self._running) < self.max_concurrency
               and self.memory.fits(len(self._waiting[0].inputs.input_ids)
                                    + self._waiting[0].max_tokens)):
            row = self._waiting.popleft()
            try:
                kwargs = self._embed(row.inputs)
            except Exception as e:  # a model that rejects these images: this row's error
                self._finished.append(self._output(
                    row, FinishReason.ERROR,
                    f"the model could not read this row's images: {type(e).__name__}: {e}"))
                continue
            processors = []
            if row.params.constraint is not None:
                row.processor = self.grammars.processor(row.params.constraint)
                processors.append(row.processor)
            if not row.params.greedy:
                seed = row.params.seed if row.params.seed is not None else row.id
                processors.append(GumbelSampler(row.params, seed))
            (uid,) = self._gen.insert([row.inputs.input_ids], max_tokens=[row.max_tokens],
                                      prompt_kwargs=[kwargs], logits_processors=[processors])
            row.uid, row.admitted_at = uid, time.perf_counter()
            self._running[uid] = row
            self.memory.add(row.id, len(row.inputs.input_ids) + row.max_tokens)
            self.stats.prompt_tokens += len(row.inputs.input_ids)

    def _embed(self, inputs: VisionInputs) -> dict:
        """The row's input embeddings (and position data) for the language model."""
        ids = mx.array(inputs.input_ids)[None]
        extra = dict(inputs.extra)
        if inputs.pixel_values is not None:
            cached = self._cached_features(inputs)
            if cached is not None:
                extra["cached_image_features"] = cached
        features = self.model.get_input_embeddings(ids, inputs.pixel_values, **extra)
        extra.pop("cached_image_features", None)
        return {**extra, **{k: v for k, v in features.to_dict().items() if v is not None}}

    def _cached_features(self, inputs: VisionInputs) -> mx.array | None:
        """Vision features for the row's images, each image's computed once per job (Qwen2-VL
        family: one image's patches are grid_t * grid_h * grid_w rows of pixel_values)."""
        grid = inputs.extra.get("image_grid_thw")
        tower = getattr(self.model, "vision_tower", None)
        if grid is None or tower is None or len(inputs.digests) != grid.shape[0]:
            return None
        sizes = [int(t * h * w) for t, h, w in grid.tolist()]
        dtype = tower.patch_embed.proj.weight.dtype
        parts, start = [], 0
        for i, (digest, size) in enumerate(zip(inputs.digests, sizes, strict=True)):
            features = self._features.get(digest)
            if features is None:
                self.feature_misses += 1
                pixels = inputs.pixel_values[start: start + size].astype(dtype)
                features = tower(pixels, grid[i: i + 1], output_hidden_states=False)
                mx.eval(features)
                self._features[digest] = features
                if len(self._features) > FEATURE_CACHE_SIZE:
                    self._features.popitem(last=False)
            else:
                self.feature_hits += 1
                self._features.move_to_end(digest)
            parts.append(features)
            start += size
        return mx.concatenate(parts, axis=0)

    def _collect(self, responses: list) -> None:
        now = time.perf_counter()
        for r in responses:
            row = self._running.get(r.uid)
            if row is None:
                continue
            if row.ttft is None:
                row.ttft = now - row.admitted_at
            token = int(r.token)
            if token in self._eos or token in row.params.stop_token_ids:
                self._finish(r.uid, FinishReason.STOP, removed=r.finish_reason is not None)
                continue
            row.tokens.append(token)
            if row.logprobs is not None:
                row.logprobs.append(float(r.token_logprob))
            if row.top_logprobs is not None:
                top = sorted(r.top_logprobs or [], key=lambda p: -p[1])
                row.top_logprobs.append([(int(t), float(lp)) for t, lp in top][
                    : row.params.top_logprobs])
            if row.params.stop and self._stop_string_seen(row):
                self._finish(r.uid, FinishReason.STOP, removed=r.finish_reason is not None)
            elif r.finish_reason is not None:
                reason = FinishReason.STOP if r.finish_reason == "stop" else FinishReason.LENGTH
                self._finish(r.uid, reason, removed=True)

    def _stop_string_seen(self, row: _Row) -> bool:
        text = self.tokenizer.decode(row.tokens)
        hit = _find_stop(text, row.params.stop, row.stop_scan_from)
        row.stop_scan_from = max(0, len(text) - max(len(s) for s in row.params.stop))
        return hit is not None

    def _finish(self, uid: int, reason: FinishReason, removed: bool = False) -> None:
        row = self._running.pop(uid)
        self.memory.remove(row.id)
        if not removed:
            self._gen.remove(uid)
        if row.processor is not None and len(row.tokens) > row.processor.consumed:
            row.processor.advance(row.tokens[-1])
        self._finished.append(self._output(row, reason))

    def _output(self, row: _Row, reason: FinishReason, error: str | None = None) -> Output:
        text = self.tokenizer.decode(row.tokens) if row.tokens else ""
        hit = _find_stop(text, row.params.stop, 0)
        if hit is not None:
            text, reason = text[:hit], FinishReason.STOP
        if row.ttft is not None:
            self.stats.ttfts.append(row.ttft)
        self.stats.completion_tokens += len(row.tokens)
        return Output(
            request_id=row.id, text=text, token_ids=row.tokens, finish_reason=reason,
            prompt_tokens=len(row.inputs.input_ids), logprobs=row.logprobs,
            top_logprobs=row.top_logprobs, ttft_s=row.ttft, error=error,
            constraint_complete=row.processor.complete if row.processor else None,
        )


def _eos_ids(tokenizer: Any, model: Any) -> list[int]:
    """End-of-sequence ids from the tokenizer and the model's config (ints or lists)."""
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_ids", None),
                  getattr(tokenizer, "eos_token_id", None),
                  getattr(getattr(model, "config", None), "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple, set)):
            ids.update(int(v) for v in value)
    return sorted(ids)
