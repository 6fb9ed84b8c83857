"""The vision backend: vision-language models through mlx-vlm's BatchGenerator, under the same
engine core as text models (engine.py: scheduling, fault recovery, stops, log-probabilities,
outputs).

Text-only rows, one-image rows and multi-image rows of any image sizes share one running batch
and join it as others finish. Every row enters the BatchGenerator as its prompt's token ids plus
its own input embeddings (image features merged into the text embeddings by the model's
`get_input_embeddings`), as mlx-vlm's server does; mlx-vlm's `batch_generate` (one image per row,
rows split by image shape) is not used.

- Sampling: mlx-vlm samples a whole batch with one sampler, so the batch samples greedily and a
  sampled row perturbs its own logits with Gumbel noise from its seed and token position
  (argmax of logits / T + Gumbel noise is a draw from softmax(logits / T)): the row's text does
  not depend on the batch.
- Constraints run as logits processors. A choices row's choices are scored from the model's
  probabilities (choices.py) after its prompt, run again on its own with its images: mlx-vlm's
  batch does not hand out one row's KV.
- The prefix cache: a prefix's KV depends on the images in it, which the token ids do not show
  (every image is the same run of placeholder tokens), so a row's blocks are keyed on its
  images' content digests from the first image on (`Sequence.media`, cache/prefix.py): a shared
  system prompt is served from the cache to every row, a shared image only to rows with the same
  picture. A row starts from its cached blocks in mlx-vlm's batch through vision_batch.py. A
  model whose prompt inputs cannot be cut at a position (vision_batch.cut) runs its rows cold.
- A repeated image is decoded once (io/media/) and, for models whose `get_input_embeddings`
  takes `cached_image_features` (the Qwen2-VL family), its vision features are computed once
  per job.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from batchrun.cache.prefix import Block, Media, PrefixCache
from batchrun.engine.config import EngineConfig
from batchrun.engine.postprocess import Step
from batchrun.engine.sequence import Sequence
from batchrun.engine.types import SamplingParams

MAX_TOP_LOGPROBS = 20  # SamplingParams' bound; mlx-vlm computes one k for the whole batch
FEATURE_CACHE_SIZE = 256  # images whose vision features are kept (an LRU)
MAX_IMAGES_PER_ROW = 32  # more is a row error (too_many_images); the context also bounds it

log = logging.getLogger("batchrun")


@dataclass(slots=True)
class VisionInputs:
    """A row's processor output: token ids with image placeholders, and pixel tensors."""

    input_ids: list[int]
    pixel_values: Any = None  # mx.array, or None for a text-only row
    extra: dict = field(default_factory=dict)  # image_grid_thw, attention_mask, ...
    digests: tuple[str, ...] = ()  # content hashes of the row's images, in order
    media: Media = ()  # where each image's placeholders start, with its digest (prefix keys)

    def __post_init__(self) -> None:
        # Inputs made without VisionPrompts.prepare may carry pixels and no placement: every
        # block then depends on all of the row's images (or, with no digests either, on a
        # salt no other row has), so no picture's KV is ever served to another.
        if self.pixel_values is not None and len(self.media) != len(self.digests):
            self.media = tuple((0, d) for d in self.digests)
        if self.pixel_values is not None and not self.digests:
            self.media = ((0, f"unidentified-{id(self)}-{time.time_ns()}"),)


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
        from batchrun.engine.backends.prompt import PromptError

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
        kwargs = dict(chat_template_kwargs or {})
        # an answer begun (the last message the assistant's): the text ends inside it
        begun = bool(kwargs.get("continue_final_message"))
        try:
            return template_owner.apply_chat_template(
                parts_messages, tools=tools, add_generation_prompt=not begun, tokenize=False,
                **kwargs)
        except Exception as e:  # a template error is the row's, never the job's
            raise PromptError(f"the chat template could not render the messages: {e}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def encode_chat(self, messages: list[dict], tools: list | None = None,
                    enable_thinking: bool | None = None,
                    chat_template_kwargs: dict | None = None,
                    continue_final_message: bool = False) -> list[int]:
        kwargs = dict(chat_template_kwargs or {})
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        if continue_final_message:
            from batchrun.engine.backends.prompt import PromptError

            if not messages or not isinstance(messages[-1], dict) \
                    or messages[-1].get("role") != "assistant" or not messages[-1].get("content"):
                raise PromptError("continue_final_message needs the last message to be the "
                                  "assistant's, with the text the answer begins with")
            kwargs["continue_final_message"] = True
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
        digests = tuple(image.digest for image in images)
        return VisionInputs(input_ids, inputs.get("pixel_values") if pictures else None, extra,
                            digests, image_starts(input_ids, self.image_token_index, digests))


def image_starts(ids: list[int], image_token: int | None, digests: tuple[str, ...]) -> Media:
    """Each image's digest at the position of its first placeholder token. Where the runs of
    placeholders do not pair one to one with the images, every digest is put at the first
    placeholder (or the prompt's start): the row's blocks from there on then match only rows
    with all the same pictures."""
    starts = [i for i, t in enumerate(ids)
              if t == image_token and (i == 0 or ids[i - 1] != image_token)]
    if len(starts) == len(digests):
        return tuple(zip(starts, digests, strict=True))
    return tuple((starts[0] if starts else 0, digest) for digest in digests)


class GumbelSampler:
    """A sampled row's own randomness as a logits processor: filter, scale by 1/T, add Gumbel
    noise drawn with key `step` of the row's key sequence. The batch then takes the argmax.
    With `keep`, the model's log-probabilities (before the noise) of each step are kept for
    the row's logprobs (`logprobs(step)`): the batch's own are of the noised logits."""

    def __init__(self, params: SamplingParams, seed: int, keep: bool = False):
        self.params = params
        self.keys = mx.random.split(mx.random.key(seed & 0xFFFF_FFFF_FFFF_FFFF),
                                    params.max_tokens)
        self.step = 0
        self._kept: dict[int, mx.array] | None = {} if keep else None

    def logprobs(self, step: int) -> mx.array | None:
        """The log-probabilities step `step` sampled from (once: then forgotten)."""
        return self._kept.pop(step, None) if self._kept is not None else None

    def __call__(self, context: Any, logits: mx.array) -> mx.array:
        p = self.params
        x = logits.astype(mx.float32)
        x = x - mx.logsumexp(x, axis=-1, keepdims=True)
        if self._kept is not None:
            self._kept[self.step] = x[0]
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


class VisionBackend:
    """mlx-vlm's BatchGenerator over the model's language model; each row enters as its token
    ids plus its own input embeddings (images merged in), computed when it is admitted."""

    accepts_images = True
    scores_choices = True  # from the row's prompt computed again on its own (score_choices)
    prefix_cache = True  # blocks keyed on the images' content as well as the tokens
    windowed_prefixes = False  # a sliding-window language model's rows compute their prompts
    stateful_prefixes = False  # ... and a recurrent one's

    def __init__(self, model: Any, processor: Any):
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        self.model = model
        self.kv_model = model.language_model
        tokenizer = processor.tokenizer if hasattr(processor, "tokenizer") else processor
        self.tokenizer = tokenizer
        self._wrapped = TokenizerWrapper(tokenizer)  # for its streaming detokenizer
        self.processor = processor
        self.prompts = VisionPrompts(processor, model.config)
        self.eos = tuple(_eos_ids(tokenizer, model))
        config = getattr(model, "config", None)
        self.vocab_size = (getattr(config, "vocab_size", None)
                           or getattr(getattr(config, "text_config", None), "vocab_size", None)
                           or len(tokenizer))
        self._features: OrderedDict[str, mx.array] = OrderedDict()
        self.feature_hits = self.feature_misses = 0
        self._kwargs: dict[int, dict] = {}  # request id -> its embeddings, until inserted
        self._sampled: dict[int, list] = {}  # uid -> [GumbelSampler, tokens seen]: logprobs
        self._choice_kwargs: dict[int, dict] = {}  # choices rows' embeddings, until scored
        self.warm_starts = True  # False once a row's prompt inputs cannot be cut (cut())
        self._gen = None

    def start(self, max_concurrency: int, config: EngineConfig) -> None:
        from batchrun.engine.backends.vision_batch import WarmStartBatchGenerator

        self.close()
        self._sampled.clear()
        self._choice_kwargs.clear()
        self._prefill_step = config.prefill_step_size
        self._gen = WarmStartBatchGenerator(
            self.kv_model, self.processor, stop_tokens=list(self.eos),
            completion_batch_size=max_concurrency,
            prefill_batch_size=min(config.prefill_batch_size or max_concurrency,
                                   max_concurrency),
            prefill_step_size=config.prefill_step_size,
            compute_logprobs=True, top_logprobs_k=MAX_TOP_LOGPROBS, greedy_sampling=True)

    def share_prefixes(self, on: bool) -> bool:
        return False

    def detokenizer(self) -> Any:
        return self._wrapped.detokenizer

    def reject(self, params: SamplingParams) -> str | None:
        if params.adjusts_logits:
            return ("presence_penalty, frequency_penalty, repetition_penalty, logit_bias and "
                    "min_tokens are not supported with vision models yet: remove them")
        if params.max_thinking_tokens is not None and params.constraint is None:
            return "max_thinking_tokens is not supported with vision models yet: remove it"
        return None

    def prepare(self, seq: Sequence) -> str | None:
        try:
            self._row_kwargs(seq)
        except Exception as e:  # a model that rejects these images: this row's error
            return f"the model could not read this row's images: {type(e).__name__}: {e}"
        return None

    def _row_kwargs(self, seq: Sequence, keep: bool = True) -> dict:
        """The row's input embeddings; with `keep`, kept until it is inserted."""
        kwargs = self._kwargs.get(seq.id)
        if kwargs is None:
            kwargs = self._embed(seq.inputs if seq.inputs is not None else
                                 VisionInputs(seq.prompt))
            if keep:
                self._kwargs[seq.id] = kwargs
        return kwargs

    def _warm_start(self, seq: Sequence, blocks: list[Block], kwargs: dict) -> tuple | None:
        """(the row's inputs past its cached tokens, the caches holding those), or None: the
        row runs from its whole prompt (`seq.cached` is then 0)."""
        from mlx_vlm.models.cache import KVCache

        from batchrun.engine.backends.vision_batch import cut

        rest = cut(kwargs, seq.cached) if self.warm_starts else None
        if rest is None and self.warm_starts:
            self.warm_starts = False
            log.warning("prefix cache: this model's prompt inputs (%s) cannot be cut at a "
                        "cached prefix; its rows run without the prefix cache",
                        ", ".join(sorted(kwargs)))
        if rest is None or not seq.cached:
            seq.cached = 0
            return None
        return rest, PrefixCache.to_kv_caches(blocks, KVCache)

    def insert(self, seqs: list[Sequence], blocks: list[list], upcoming=()) -> list[int]:
        processors, samplers = [], []
        for seq in seqs:
            row = [*seq.params.logits_processors,
                   *([seq.processor] if seq.processor is not None else [])]
            sampler = None
            if not seq.params.greedy:
                wants = bool(seq.params.logprobs or seq.params.top_logprobs)
                sampler = GumbelSampler(seq.params, seq.seed, keep=wants)
                row.append(sampler)
            processors.append(row)
            samplers.append(sampler)
        kwargs = [self._kwargs.pop(s.id) for s in seqs]
        warm = [self._warm_start(s, b, kw) for s, b, kw in zip(seqs, blocks, kwargs, strict=True)]
        rows = [w[0] if w else kw for w, kw in zip(warm, kwargs, strict=True)]
        uids = self._gen.insert([s.prompt[s.cached:] for s in seqs],
                                max_tokens=[s.max_tokens for s in seqs],
                                prompt_kwargs=rows, logits_processors=processors)
        for uid, seq, kw, w in zip(uids, seqs, kwargs, warm, strict=True):
            if w is not None:
                self._gen.warm[uid] = (seq.cached, w[1])
            if seq.choice_tokens is not None:  # kept to score the choices (score_choices)
                self._choice_kwargs[uid] = kw
        for uid, sampler in zip(uids, samplers, strict=True):
            if sampler is not None and sampler._kept is not None:
                self._sampled[uid] = [sampler, 0]
        return uids

    def next(self) -> tuple[bool, list[Step]]:
        prompt_work, responses = self._gen.next()
        return bool(prompt_work), [self._step(r) for r in responses]

    def _step(self, r: Any) -> Step:
        step = Step(r.uid, int(r.token), r.finish_reason, token_logprob=r.token_logprob,
                    top=r.top_logprobs)
        sampled = self._sampled.get(r.uid)
        if sampled is not None:  # the model's distribution, not the noised one the batch saw
            sampler, index = sampled
            sampled[1] += 1
            step.logprobs = sampler.logprobs(index)
        return step

    def leave(self, uids: list[int]) -> None:
        for uid in uids:
            self._gen.remove(uid)

    def remove(self, uid: int, in_batch: bool) -> None:
        self._sampled.pop(uid, None)
        self._choice_kwargs.pop(uid, None)
        if in_batch:
            self._gen.remove(uid)

    def score_choices(self, rows: list[tuple[Sequence, Step]]) -> list[list[list[float]]]:
        """Each row's prompt (its images merged in) run again on its own, then its choices
        (choices.py): mlx-vlm's batch does not hand out one row's KV. The batch passes its
        rows' RoPE offsets itself, so these calls leave the running rows unchanged."""
        from mlx_lm.models.cache import make_prompt_cache

        from batchrun.engine.decoding.choices import log_softmax, score_alone

        out = []
        for seq, step in rows:
            kwargs = self._choice_kwargs.pop(step.uid)
            cache = make_prompt_cache(self.kv_model)
            logits = self.kv_model(mx.array(seq.prompt)[None], cache=cache, **kwargs)
            first = log_softmax(getattr(logits, "logits", logits)[0, -1])
            out.append(score_alone(seq, _LogitsOnly(self.kv_model), cache, first))
        return out

    def compute_prefix(self, seq: Sequence, upto: int, blocks: list[Block]) -> list[tuple]:
        """Prefill the row's first `upto` tokens (its images merged in) on its own, after
        `blocks`; each layer's (keys, values) over all of them."""
        from mlx_vlm.models.cache import KVCache, make_prompt_cache

        from batchrun.engine.backends.vision_batch import cut

        if not self.warm_starts:
            raise ValueError("this model's rows run without the prefix cache")
        # Not kept for the row: it may be aborted while it waits, and nothing would drop them.
        kwargs = self._row_kwargs(seq, keep=False)
        caches = PrefixCache.to_kv_caches(blocks, KVCache) if blocks else \
            make_prompt_cache(self.kv_model)
        done = caches[0].offset
        while done < upto:
            end = min(upto, done + self._prefill_step)
            part = cut(kwargs, done, end)
            if part is None:
                raise ValueError("this model's prompt inputs cannot be cut at a prefix")
            self.kv_model(mx.array(seq.prompt[done:end])[None], cache=caches, **part)
            mx.eval([c.state for c in caches])
            done = end
        return [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in caches]

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()
            self._gen = None

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


class _LogitsOnly:
    """A language model whose call returns its logits (mlx-vlm's return an output object)."""

    def __init__(self, model: Any):
        self.model = model

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        out = self.model(inputs, cache=cache)
        return getattr(out, "logits", out)


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
