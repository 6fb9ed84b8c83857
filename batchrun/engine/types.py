"""Requests, sampling parameters and finished outputs: the engine's vocabulary.

The engine speaks token ids and integer request ids; row ids, files and reports live above it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from batchrun.engine.decoding.constrain import Constraint


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length reached
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # the request could not be run (see Output.error)


MAX_SEED = 2**64 - 1  # a seed is one unsigned 64-bit integer (mx.random.key's)


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Per-request sampling. Raises ValueError naming the field on a bad value."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    # The answer must match this (JSON schema, regex, choices); see constrain.py.
    constraint: Constraint | None = None
    # OpenAI's penalties (generated tokens), vLLM's repetition penalty (prompt and generated
    # tokens; 1 is none), additive logit bias per token id, and a floor under the answer's
    # length (EOS and stop_token_ids are barred until then): sampling.LogitAdjustments.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # A thinking model's reasoning block ends after at most this many tokens (None: unbounded);
    # a constraint applies to the answer after it (engine/decoding/reasoning.py).
    max_thinking_tokens: int | None = None
    # The row asked its template for a reasoning block (enable_thinking: True): a constrained
    # answer may reason first, and the constraint applies after the block; False: a raw prompt,
    # never read as reasoning; None: the prompt decides (a template that opened a block).
    thinking: bool | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               "max_tokens", self.max_tokens, "an integer >= 1")
        _check(_finite(self.temperature) and self.temperature >= 0,
               "temperature", self.temperature, "a number >= 0")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
               "an integer >= 0 (0 disables it)")
        _check(_finite(self.min_p) and 0 <= self.min_p < 1, "min_p", self.min_p, "in [0, 1)")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                     and 0 <= self.seed <= MAX_SEED),
               "seed", self.seed, f"an integer in [0, {MAX_SEED}]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "non-empty strings")
        _check(isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= 20,
               "top_logprobs", self.top_logprobs, "an integer in [0, 20]")
        _check(self.constraint is None or isinstance(self.constraint, Constraint),
               "constraint", self.constraint, "a Constraint")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, name, value, "a number in [-2, 2]")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", self.repetition_penalty, "a number > 0 (1 is none)")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 and _finite(b)
                   and -100 <= b <= 100 for t, b in self.logit_bias), "logit_bias",
               dict(self.logit_bias), "token ids mapped to numbers in [-100, 100]")
        _check(self.max_thinking_tokens is None
               or (type(self.max_thinking_tokens) is int and self.max_thinking_tokens >= 0),
               "max_thinking_tokens", self.max_thinking_tokens, "an integer >= 0")
        _check(isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
               and 0 <= self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               f"an integer in [0, max_tokens = {self.max_tokens}]")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                   for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
               "token ids")

    @property
    def adjusts_logits(self) -> bool:
        """Penalties, logit bias or min_tokens apply (sampling.LogitAdjustments)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.min_tokens or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


@dataclass(slots=True)
class Output:
    """A finished request."""

    request_id: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int = 0
    # Per generated token: the sampled token's logprob, and the top alternatives.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    ttft_s: float | None = None
    error: str | None = None
    # Constrained rows: whether the answer is a whole match of the constraint (False when it
    # was cut short, e.g. by max_tokens); with choices, log P(choice | prompt) for each.
    constraint_complete: bool | None = None
    choice_logprobs: dict[str, float] | None = None
    thinking_opened: bool = False  # the prompt ended inside a reasoning block (reasoning.py)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


# Guesses a row: 6 on a CPU, where a wider verification costs more than it gains; on a GPU, where
# a guess is cheap, 12 for prompt lookup and 8 for a draft (BENCHMARKS.md, Speculative decoding).
DEFAULT_DRAFT_TOKENS = 6
DEFAULT_NGRAM_TOKENS_GPU = 12
DEFAULT_DRAFT_MODEL_TOKENS_GPU = 8


def default_draft_tokens(method: str, gpu: bool | None = None) -> int:
    """The guesses a row for `method` on the default device (`gpu`: whether it is a GPU)."""
    if gpu is None:
        import mlx.core as mx

        gpu = mx.default_device() != mx.cpu
    if not gpu:
        return DEFAULT_DRAFT_TOKENS
    return DEFAULT_NGRAM_TOKENS_GPU if method == "ngram" else DEFAULT_DRAFT_MODEL_TOKENS_GPU


@dataclass(slots=True)
class EngineConfig:
    """Scheduling and memory knobs."""

    max_concurrency: int | None = None  # None: as many as memory allows, capped by the device
    # Rows joining the batch per prefill: at most prefill_batch_size of them (None: no cap but
    # the next), their uncached prompt tokens, padded to the longest, at most prefill_tokens
    # (None: chosen from the device, see device_defaults).
    prefill_batch_size: int | None = None
    prefill_tokens: int | None = None
    prefill_step_size: int = 2048
    # Fraction of device memory (RAM on CPU) that weights + KV caches may use.
    memory_utilization: float = 0.85
    # An absolute KV-cache budget in bytes; overrides memory_utilization when set.
    kv_budget_bytes: int | None = None
    # Prefix cache: on by default; its memory share of the KV budget; its disk folder
    # (None: no disk). Blocks are prefix_block_size tokens.
    prefix_cache: bool = True
    prefix_cache_fraction: float = 0.2
    prefix_block_size: int = 64
    cache_dir: str | None = None
    # Rows starting with the same cached prefix attend one shared copy of its KV (False: each
    # row holds its own copy, as before; kept for side-by-side benchmarks).
    shared_prefix: bool = True
    # Speculative decoding where the batch is narrow (speculate.py): "off", "ngram" (prompt
    # lookup) or "draft" (draft_model, a model sharing the tokenizer); draft_tokens guesses a
    # row a step (None: default_draft_tokens for the method and the default device).
    speculate: str = "off"
    draft_model: str | None = None
    draft_tokens: int | None = None

    def __post_init__(self) -> None:
        _check(self.max_concurrency is None or self.max_concurrency >= 1, "max_concurrency",
               self.max_concurrency, "an integer >= 1")
        _check(self.prefill_batch_size is None or self.prefill_batch_size >= 1,
               "prefill_batch_size", self.prefill_batch_size, ">= 1")
        _check(self.prefill_tokens is None or self.prefill_tokens >= 1, "prefill_tokens",
               self.prefill_tokens, ">= 1")
        _check(self.prefill_step_size >= 1, "prefill_step_size", self.prefill_step_size, ">= 1")
        _check(0 < self.memory_utilization <= 1, "memory_utilization", self.memory_utilization,
               "in (0, 1]")
        _check(self.speculate in ("off", "ngram", "draft"), "speculate", self.speculate,
               'one of "off", "ngram", "draft"')
        _check(self.speculate != "draft" or bool(self.draft_model), "draft_model",
               self.draft_model, "a model (speculate is draft)")
        if self.draft_tokens is None:
            self.draft_tokens = default_draft_tokens(self.speculate)
        _check(isinstance(self.draft_tokens, int) and 1 <= self.draft_tokens <= 16,
               "draft_tokens", self.draft_tokens, "an integer in [1, 16]")


# (concurrency cap, prefill token budget) by device. Measured: on this 2-core CPU a prefill of
# ~2k padded tokens (8 rows of the mixed workload, or 64 labeling rows past a cached prefix);
# on the H200, 1B model, up to 1,024 rows decoding gave 2.3x the throughput of the CPU's
# settings, and prefills of 256 rows of 128 tokens four times fewer than a job's whole first
# 1,024 rows cost it ~1 s of its 6 (benchmarks/history/BENCHMARKS-2026-12.md). A GPU's prefill
# budget comes from its memory and the model (memory.prefill_token_budget).
DEVICE_DEFAULTS = {"cpu": (256, 2048), "gpu": (1024, None)}


def device_defaults(model=None) -> tuple[int, int]:
    """(concurrency cap, prefill token budget) for the default device and this model."""
    import mlx.core as mx

    from batchrun.engine.memory import prefill_token_budget

    cap, tokens = DEVICE_DEFAULTS["cpu" if mx.default_device() == mx.cpu else "gpu"]
    return cap, tokens or prefill_token_budget(model)


@dataclass(slots=True)
class SpeculationStats:
    """Speculative decoding's account (speculate.py)."""

    steps: int = 0  # verification forwards
    proposed: int = 0  # tokens proposed
    accepted: int = 0  # of them, kept: the tokens gained over one a row a step


@dataclass(slots=True)
class EngineStats:
    """What the engine did; timings in seconds, memory in bytes."""

    requests_finished: int = 0
    prompt_tokens: int = 0  # tokens of admitted prompts, cached ones included
    cached_tokens: int = 0
    completion_tokens: int = 0
    # Wall time of the steps that ran prompt work (they decode the running rows too), and of
    # the steps that only decoded, with the tokens those made.
    prefill_time: float = 0.0
    decode_time: float = 0.0
    decode_tokens: int = 0
    decode_steps: int = 0
    batch_size_sum: int = 0  # sum over decode steps of the running batch size
    peak_memory_bytes: int = 0
    ttfts: list[float] = field(default_factory=list)
    # (seconds since start, prompt tokens, completion tokens, running sequences), sampled.
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)
    speculation: SpeculationStats = field(default_factory=SpeculationStats)

    def record_step(self, prompt_work: bool, decoded: int, seconds: float,
                    peak_memory: int, rows: int | None = None) -> None:
        """One engine step: timed as prefill if it ran prompt work, else as decode; `rows`
        decoded `decoded` tokens (more than one a row where it speculated)."""
        if prompt_work:
            self.prefill_time += seconds
        else:
            self.decode_time += seconds
            self.decode_tokens += decoded
        if decoded:
            self.decode_steps += 1
            self.batch_size_sum += decoded if rows is None else rows
        self.peak_memory_bytes = max(self.peak_memory_bytes, peak_memory)

    @property
    def prefill_tokens_per_s(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prefill_time if self.prefill_time > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def mean_batch_size(self) -> float:
        return self.batch_size_sum / self.decode_steps if self.decode_steps else 0.0

    def ttft_quantile(self, q: float) -> float | None:
        if not self.ttfts:
            return None
        values = sorted(self.ttfts)
        return values[min(len(values) - 1, int(q * len(values)))]
