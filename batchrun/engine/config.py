"""The engine's scheduling and memory knobs (EngineConfig) and the defaults the device decides:
speculation's guesses a row, the concurrency cap and the prefill token budget."""

from __future__ import annotations

from dataclasses import dataclass

from batchrun.engine.types import _check

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
    # How a loaded model's weights are held (models/weights.py): "auto" (the device's plan:
    # dequantized / float32 where it is faster and fits), "quantized" (as loaded) or
    # "dequantized" (every quantized layer, whatever the memory).
    weights: str = "auto"

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
        _check(self.weights in ("auto", "quantized", "dequantized"), "weights", self.weights,
               'one of "auto", "quantized", "dequantized"')


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
