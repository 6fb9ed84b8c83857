"""Memory budget: admit a sequence only while the batch's KV cache still fits.

mlx-lm's batched KV cache holds every running sequence padded to the longest one, so a batch of
B sequences whose longest needs L tokens costs about B * L * bytes_per_token. The budget is a
fraction of device memory (MLX's recommended working set on Metal / CUDA, physical RAM on CPU)
minus the weights; on Metal and CUDA MLX's own memory and cache limits are set to match.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache


@dataclass(slots=True)
class KVFootprint:
    per_token: int  # bytes of KV cache per token of one sequence
    per_sequence: int  # fixed bytes per sequence (recurrent states, rotating windows)


def measure_kv(model: nn.Module) -> KVFootprint:
    """Probe the model's cache with a one-token forward pass; works for any mlx-lm model."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    per_token = fixed = 0
    for c in cache:
        keys = getattr(c, "keys", None)
        window = getattr(c, "max_size", None)
        if keys is not None and window is None:
            per_token += c.nbytes // keys.shape[-2]
        elif keys is not None and isinstance(window, int) and window > 0:
            fixed += c.nbytes // keys.shape[-2] * window  # a sliding window, once full
        else:
            fixed += c.nbytes
    return KVFootprint(per_token, fixed)


def weights_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def device_memory_bytes() -> int:
    """Memory MLX may use: the GPU's recommended working set, else physical RAM."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# A GPU prefill's activations may take this share of the device's memory; with the model's
# widths that gives its token budget, kept within GPU_PREFILL_TOKENS.
PREFILL_MEMORY_SHARE = 0.15
GPU_PREFILL_TOKENS = (8192, 262144)


def activation_bytes(model: nn.Module | None) -> int | None:
    """About what one prompt token's activations take in a forward pass: an MLP's three
    intermediate-wide arrays and four hidden-wide ones, in the weights' float type, twice over
    for what stays alive between kernels. None if the model does not say its widths."""
    args = _text_args(model)
    hidden = args.get("hidden_size")
    if not isinstance(hidden, int) or hidden <= 0:
        return None
    intermediate = args.get("intermediate_size")
    if not isinstance(intermediate, int) or intermediate <= 0:
        intermediate = 4 * hidden
    floats = [v.dtype for _, v in tree_flatten(model.parameters())
              if mx.issubdtype(v.dtype, mx.floating)]
    size = 4 if floats and all(d == mx.float32 for d in floats) else 2
    return 2 * size * (3 * intermediate + 4 * hidden)


def prefill_token_budget(model: nn.Module | None) -> int:
    """Padded prompt tokens one GPU prefill may take: PREFILL_MEMORY_SHARE of the device's
    memory over `activation_bytes`, within GPU_PREFILL_TOKENS (the low end if the model does
    not say its widths)."""
    low, high = GPU_PREFILL_TOKENS
    per_token = activation_bytes(model)
    if per_token is None:
        return low
    return max(low, min(high, int(device_memory_bytes() * PREFILL_MEMORY_SHARE / per_token)))


def _text_args(model: nn.Module | None) -> dict:
    """The model's text widths: its args, or their `text_config` where the text model's are
    nested there (Qwen3.5, Gemma 3's multimodal checkpoints)."""
    args = getattr(model, "args", None)
    found = {k: getattr(args, k, None) for k in ("hidden_size", "intermediate_size")}
    nested = getattr(args, "text_config", None)
    if found["hidden_size"] is None and nested is not None:
        get = nested.get if isinstance(nested, dict) else lambda k: getattr(nested, k, None)
        found = {k: get(k) for k in found}
    return found


def kv_budget(model: nn.Module, utilization: float) -> int:
    """Bytes available to KV caches; also caps MLX's allocator on GPUs."""
    total = device_memory_bytes()
    if mx.default_device() == mx.gpu:
        mx.set_memory_limit(int(total * utilization))
        mx.set_cache_limit(int(total * (1 - utilization)))
    # Activations and allocator slack scale with the batch; keep a tenth of the rest for them.
    return max(0, int((total * utilization - weights_bytes(model)) * 0.9))


class MemoryBudget:
    """Ask/do pair: `fits` before admitting, `add` / `remove` as sequences come and go."""

    def __init__(self, footprint: KVFootprint, budget_bytes: int):
        self.footprint = footprint
        self.budget = budget_bytes
        self._lengths: dict[int, int] = {}

    def cost(self, lengths: list[int]) -> int:
        if not lengths:
            return 0
        f = self.footprint
        return len(lengths) * (max(lengths) * f.per_token + f.per_sequence)

    def fits_alone(self, length: int) -> bool:
        return self.cost([length]) <= self.budget

    def fits(self, length: int) -> bool:
        return self.cost([*self._lengths.values(), length]) <= self.budget

    def add(self, request_id: int, length: int) -> None:
        self._lengths[request_id] = length

    def remove(self, request_id: int) -> None:
        self._lengths.pop(request_id, None)

    @property
    def used(self) -> int:
        return self.cost(list(self._lengths.values()))
