"""What the engine did (EngineStats), speculation's account included; the step loop fills it in,
the job's report reads it."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    cached_disk_tokens: int = 0  # of them, from blocks read from disk (a run before's)
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
