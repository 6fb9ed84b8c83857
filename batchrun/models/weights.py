"""The weight plan: how a loaded model's weights are held for speed on this device.

A batch job runs many rows a step, so its matmuls are compute-bound, and there the arithmetic of
a weight's format matters more than the bytes it saves. Measured on this repository's 2-core CPU
(BENCHMARKS.md, "Quantized and mixture-of-experts models"): a 1,024 x 3,072 matmul of 32 rows
takes 1.8 ms in float32, 44 ms in bf16 and 110 ms in 4-bit; on an H100 a 4-bit matmul takes
1.4-2.7x the bf16 time from 1 to 1,024 rows, where dequantizing first costs 1.15x. So `auto`
holds a quantized layer dequantized, once, in the compute dtype, where that fits in memory:

- CPU: every floating weight in float32 (quantized layers dequantized, half-precision ones
  widened): MLX's CPU matmuls are fast in float32 only.
- CUDA: quantized layers dequantized into the model's own float dtype (bf16 or fp16).
- Metal: kept as loaded. Apple silicon's quantized kernels are fast and its memory, shared with
  the system, is what limits a batch; dequantizing would trade batch width for nothing.

A plan that does not fit whole converts layers in order of use until it would (attention and
dense layers and the head first: every token runs them; a mixture of experts' experts last),
and leaves at least half of the usable memory to the KV cache and activations. `quantized`
keeps every weight as loaded (mlx-lm's own arithmetic); `dequantized` converts every layer
whatever the memory. The plan is said on the run's model line and in report.json; it changes
the KV a prompt gives (rounding), so it salts the prefix cache's key.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.nn as nn

MODES = ("auto", "quantized", "dequantized")
# Routed rows (rows x experts a row) from which GroupedSwitchLinear groups them by expert.
GROUP_MIN_ROWS = 512
# Rows one call of a mixture of experts' block may take on CUDA: MLX's CUDA quantized expert
# kernel (gather_qmm) puts the routed rows (tokens x experts a token) on a grid axis CUDA caps
# at 65,535, and its argpartition (the router's top-k) the tokens: a launch past it fails
# ("invalid argument"; H100, BENCHMARKS.md "Quantized and mixture-of-experts models"). Larger
# calls run in slices: the block by tokens, its experts by routed rows.
CUDA_ROUTED_ROWS = 65535
# The converted weights may take at most this share of the usable memory (the rest: KV cache,
# activations).
WEIGHT_SHARE = 0.5


@dataclass(slots=True)
class WeightPlan:
    """What the plan did; `held` sums it up: "as loaded", "dequantized", "partly dequantized",
    "float32" (a CPU's widened half-precision model)."""

    mode: str  # as asked: auto, quantized or dequantized
    device: str  # cpu, cuda or metal
    held: str
    dtype: str  # the converted layers' dtype ("" when nothing was converted)
    quantization: str  # the loaded format, e.g. "4-bit affine, group 64" ("" when none)
    converted: int = 0  # layers dequantized
    kept: int = 0  # quantized layers kept quantized
    widened: int = 0  # half-precision arrays widened to float32 (CPU)
    grouped: int = 0  # expert layers computed a group of rows an expert (CPU)
    bytes_before: int = 0
    bytes_after: int = 0
    reason: str = ""
    layers: dict[str, int] = field(default_factory=dict)  # converted layers by kind

    @property
    def changed(self) -> bool:
        return bool(self.converted or self.widened)

    def describe(self) -> str:
        """One line for the run's model line, e.g. "4-bit affine, group 64, dequantized to
        float32 (0.3 -> 2.1 GiB): MLX's CPU matmuls are fast in float32 only"."""
        fmt = self.quantization or "unquantized"
        if not self.changed:
            return f"{fmt}, as loaded" + (f": {self.reason}" if self.reason else "")
        size = f"{_size(self.bytes_before)} -> {_size(self.bytes_after)}"
        what = {"float32": "held in float32"}.get(self.held, f"{self.held} to {self.dtype}")
        if self.kept:
            what += f" ({self.converted} layers; {self.kept} kept quantized)"
        if self.grouped:
            what += f", experts grouped by row ({self.grouped} layers)"
        return f"{fmt}, {what} ({size})" + (f": {self.reason}" if self.reason else "")

    def to_dict(self) -> dict:
        return asdict(self)

    def cache_key(self, fingerprint: str) -> str:
        """The prefix cache's model key: `fingerprint` as is for weights as loaded, else salted
        with what was converted (the KV a prompt gives depends on it)."""
        if not self.changed:
            return fingerprint
        salt = f"{fingerprint};held={self.held};dtype={self.dtype};converted={self.converted};" \
               f"widened={self.widened}"
        return hashlib.sha256(salt.encode()).hexdigest()


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def device_kind() -> str:
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def quantized_layers(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of the layers mlx-lm dequantizes: quantized linear, embedding and
    mixture-of-experts (switch) layers, in module order."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
    return [(name, m) for name, m in model.named_modules() if isinstance(m, kinds)]


def describe_quantization(layers: list[tuple[str, Any]]) -> str:
    """The formats of `layers`, commonest first: "4-bit affine, group 64", or
    "mixed: 4-bit affine, group 64 (190 layers); 8-bit affine, group 64 (2 layers)"."""
    counts = Counter(_format(m) for _, m in layers)
    if not counts:
        return ""
    if len(counts) == 1:
        return next(iter(counts))
    return "mixed: " + "; ".join(f"{f} ({n} layers)" for f, n in counts.most_common())


def _format(m: Any) -> str:
    mode = getattr(m, "mode", "affine")
    if mode == "affine":
        return f"{m.bits}-bit affine, group {m.group_size}"
    return f"{mode}" if mode in ("mxfp4", "nvfp4", "mxfp8") else f"{m.bits}-bit {mode}"


def _dequantized_bytes(m: Any, itemsize: int) -> int:
    rows = 1
    for d in m.weight.shape[:-1]:
        rows *= d
    return rows * (m.weight.shape[-1] * 32 // m.bits) * itemsize


def _quantized_bytes(m: Any) -> int:
    return sum(getattr(m, k).nbytes for k in ("weight", "scales", "biases")
               if getattr(m, k, None) is not None)


def _priority(item: tuple[str, Any]) -> int:
    """Lower first: layers every token runs before a mixture of experts' experts."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    return 1 if isinstance(item[1], QuantizedSwitchLinear) else 0


def compute_dtype(model: Any, device: str):
    """The dtype converted layers take: float32 on a CPU; elsewhere the commonest float dtype
    (by bytes) of the model's weights that are not quantized (bf16 when none says)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if device == "cpu":
        return mx.float32
    sizes: Counter = Counter()
    packed = {id(getattr(m, k)) for _, m in quantized_layers(model)
              for k in ("weight", "scales", "biases") if getattr(m, k, None) is not None}
    for _, a in tree_flatten(model.parameters()):
        if id(a) not in packed and a.dtype in (mx.bfloat16, mx.float16, mx.float32):
            sizes[a.dtype] += a.nbytes
    if not sizes:  # every float is a quantized layer's scale: take the scales' dtype
        scales = [m.scales.dtype for _, m in quantized_layers(model)]
        half = [d for d in scales if d in (mx.bfloat16, mx.float16)]
        return half[0] if half else mx.bfloat16
    return sizes.most_common(1)[0][0]


def plan_and_apply(model: Any, mode: str = "auto", memory_utilization: float = 0.85,
                   memory_bytes: int | None = None, device: str | None = None) -> WeightPlan:
    """Decide how `model`'s weights are held (module docstring) and convert them in place,
    one layer at a time (each evaluated before the next: peak memory is the result plus one
    layer). `memory_bytes`: the device's (default: what memory.py measures)."""
    import mlx.core as mx

    from batchrun.engine.memory import device_memory_bytes, weights_bytes

    if mode not in MODES:
        raise ValueError(f"weights must be one of {', '.join(MODES)}, not {mode!r}")
    device = device or device_kind()
    layers = quantized_layers(model)
    fmt = describe_quantization(layers)
    before = weights_bytes(model)
    plan = WeightPlan(mode, device, "as loaded", "", fmt, kept=len(layers), bytes_before=before,
                      bytes_after=before)
    if device == "cuda":
        slice_experts(model, CUDA_ROUTED_ROWS)
    if mode == "quantized":
        plan.reason = "--weights quantized"
        return plan
    if mode == "auto" and device == "metal":
        plan.reason = "Metal's quantized kernels are fast, and memory limits the batch"
        return plan
    dtype = compute_dtype(model, device)
    widen = device == "cpu" and _has_half(model)
    if not layers and not widen:
        plan.reason = ""
        return plan
    itemsize = mx.zeros((), dtype).itemsize
    limit = None
    if mode == "auto":
        usable = (memory_bytes or device_memory_bytes()) * memory_utilization
        limit = usable * WEIGHT_SHARE
    if limit is not None and _widened_bytes(model, widen) > limit:
        widen = False  # even the unquantized weights in float32 would not leave room
    chosen, total = [], _widened_bytes(model, widen)
    for name, m in sorted(layers, key=_priority):
        grow = _dequantized_bytes(m, itemsize) - _quantized_bytes(m)
        if limit is not None and total + grow > limit:
            continue
        chosen.append((name, m))
        total += grow
    _convert(model, chosen, dtype)
    plan.widened = _widen(model) if widen else 0
    if device == "cpu":
        plan.grouped = group_experts(model)
    plan.converted, plan.kept = len(chosen), len(layers) - len(chosen)
    plan.layers = dict(Counter(type(m).__name__.removeprefix("Quantized") for _, m in chosen))
    plan.dtype = _dtype_name(dtype) if plan.changed else ""
    plan.bytes_after = weights_bytes(model)
    if not plan.changed:
        plan.reason = "dequantized weights would not leave half the memory to the batch"
    elif plan.converted and plan.kept:
        plan.held = "partly dequantized"
        plan.reason = "all dequantized would not leave half the memory to the batch"
    elif plan.converted:
        plan.held = "dequantized"
    else:
        plan.held = "float32"
    if plan.changed and not plan.reason:
        plan.reason = {"cpu": "MLX's CPU matmuls are fast in float32 only",
                       "cuda": "faster than quantized kernels at batch sizes",
                       "metal": "--weights dequantized"}[device]
        if mode == "dequantized":
            plan.reason = "--weights dequantized"
    return plan


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _has_half(model: Any) -> bool:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return any(a.dtype in (mx.bfloat16, mx.float16) for _, a in tree_flatten(model.parameters()))


def _widened_bytes(model: Any, widen: bool) -> int:
    """The model's weight bytes once its half-precision arrays are float32 (if `widen`)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return sum(a.nbytes * (2 if widen and a.dtype in (mx.bfloat16, mx.float16) else 1)
               for _, a in tree_flatten(model.parameters()))


def _convert(model: Any, chosen: list[tuple[str, Any]], dtype) -> None:
    """Replace each chosen quantized layer by its unquantized twin holding the dequantized
    weight in `dtype` (mlx-lm's dequantize_model, a layer at a time and cast)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    for name, m in chosen:
        # In float32: dequantize computes in its scales' dtype, and half-precision scales
        # would round every weight to half precision before the widening (a 4-bit model
        # with bfloat16 scales then answered unlike mlx-lm's own quantized matmuls, which
        # compute in float32).
        scales, biases = m.scales, getattr(m, "biases", None)
        if scales.dtype in (mx.float16, mx.bfloat16):
            scales = scales.astype(mx.float32)
            biases = biases.astype(mx.float32) if biases is not None else None
        weight = mx.dequantize(m.weight, scales, biases, m.group_size, m.bits,
                               getattr(m, "mode", "affine")).astype(dtype)
        bias = getattr(m, "bias", None) if "bias" in m else None
        if isinstance(m, nn.QuantizedEmbedding):
            new = nn.Embedding(*weight.shape)
        elif isinstance(m, QuantizedSwitchLinear):
            experts, out_dims, in_dims = weight.shape
            new = SwitchLinear(in_dims, out_dims, experts, bias=bias is not None)
        else:
            new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        new.weight = weight
        if bias is not None:
            new.bias = bias.astype(dtype)
        mx.eval(new.parameters())
        model.update_modules(tree_unflatten([(name, new)]))


def _widen(model: Any) -> int:
    """Half-precision arrays of `model` made float32; how many."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    half = [(k, a) for k, a in tree_flatten(model.parameters())
            if a.dtype in (mx.bfloat16, mx.float16)]
    for k, a in half:
        wide = a.astype(mx.float32)
        mx.eval(wide)
        model.update(tree_unflatten([(k, wide)]))
    return len(half)


class GroupedSwitchLinear(nn.Module):
    """mlx-lm's SwitchLinear (a mixture of experts' layer, weight (experts, out, in)) computed
    as one BLAS matmul an expert over the rows routed to it, on the CPU, from GROUP_MIN_ROWS
    routed rows on: MLX's CPU gather_mm took 4-8x as long from 1,024 routed rows (64 experts,
    1,024 x 512; BENCHMARKS.md, "Quantized and mixture-of-experts models"), and as long at
    256. The routing is read on the host, so a step's graph is evaluated up to it: on
    the CPU that costs little; on a GPU it would cut the step's graph (GPUs keep gather_mm)."""

    def __init__(self, layer: Any):
        super().__init__()
        self.weight = layer.weight
        if "bias" in layer:
            self.bias = layer.bias

    def __call__(self, x, indices, sorted_indices=False):
        import mlx.core as mx
        import numpy as np

        batch = tuple(np.broadcast_shapes(x.shape[:-2], indices.shape))
        if x.shape[-2] != 1 or math.prod(batch) < GROUP_MIN_ROWS:  # mlx-lm's own way
            out = mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=indices,
                               sorted_indices=sorted_indices)
            return out + mx.expand_dims(self.bias[indices], -2) if "bias" in self else out
        rows = mx.broadcast_to(x, (*batch, *x.shape[-2:])).reshape(-1, x.shape[-1])
        routed = np.asarray(mx.broadcast_to(indices, batch).reshape(-1))
        order = np.argsort(routed, kind="stable")
        experts, starts = np.unique(routed[order], return_index=True)
        ends = [*starts[1:], len(order)]
        parts = []
        for e, a, b in zip(experts.tolist(), starts.tolist(), ends, strict=True):
            part = rows[mx.array(order[a:b])] @ self.weight[e].T
            parts.append(part + self.bias[e] if "bias" in self else part)
        out = mx.concatenate(parts)[mx.array(np.argsort(order))]
        return out.reshape(*batch, 1, out.shape[-1])


def group_experts(model: Any) -> int:
    """Every unquantized expert layer of `model` made a GroupedSwitchLinear; how many."""
    from mlx.utils import tree_unflatten
    from mlx_lm.models.switch_layers import SwitchLinear

    found = [(name, m) for name, m in model.named_modules() if type(m) is SwitchLinear]
    if found:
        model.update_modules(tree_unflatten([(n, GroupedSwitchLinear(m)) for n, m in found]))
    return len(found)


def _sliced_call(self, x, indices):
    """A mixture of experts' layer over at most `_max_routed` routed rows a call: the rows
    (leading axes of `indices`, experts a row last) in slices of whole rows, each slice's
    result the same as the whole call's rows (a row's experts never depend on other rows)."""
    import mlx.core as mx

    k = indices.shape[-1]
    lead = indices.shape[:-1]
    rows = math.prod(lead)
    if rows * k <= self._max_routed or x.shape[:-1] != lead:
        return super(type(self), self).__call__(x, indices)
    flat_x, flat_i = x.reshape(rows, x.shape[-1]), indices.reshape(rows, k)
    step = max(1, self._max_routed // k)
    parts = [super(type(self), self).__call__(flat_x[a:a + step], flat_i[a:a + step])
             for a in range(0, rows, step)]
    out = mx.concatenate(parts)
    return out.reshape(*lead, *out.shape[1:])


_SLICED: dict[tuple, type] = {}


def slice_experts(model: Any, max_routed: int) -> int:
    """Every mixture-of-experts layer (mlx-lm's SwitchGLU / SwitchMLP) of `model` made to run
    at most `max_routed` routed rows a call, and the block that routes to it (its parent: the
    router's top-k) at most `max_routed` tokens; how many layers. Each keeps its class's
    behaviour and its parameters' names (its class becomes a subclass that slices)."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    count = 0
    for name, m in model.named_modules():
        if not isinstance(m, (SwitchGLU, SwitchMLP)):
            continue
        count += _sliced(m, _sliced_call, max_routed)
        parent = _module_at(model, name.rpartition(".")[0]) if "." in name else None
        if parent is not None and parent is not model:
            _sliced(parent, _sliced_block_call, max_routed)
    return count


def _sliced(m: Any, call: Any, max_rows: int) -> bool:
    """`m`'s class made a subclass calling `call` (once); its limit set. Whether it was new."""
    cls = type(m)
    new = cls not in _SLICED.values()
    if new:
        key = (cls, call)
        if key not in _SLICED:
            _SLICED[key] = type(f"Sliced{cls.__name__}", (cls,), {"__call__": call})
        m.__class__ = _SLICED[key]
    m._max_routed = max_rows
    return new


def _module_at(model: Any, path: str) -> Any:
    m = model
    for part in path.split("."):
        m = m[int(part)] if isinstance(m, list) else m[part] if isinstance(m, dict) \
            else getattr(m, part, None)
        if m is None:
            return None
    return m


def _sliced_block_call(self, x, *args, **kwargs):
    """A mixture of experts' block (router and experts) over at most `_max_routed` tokens a
    call: the tokens (leading axes of `x`) in slices, as a batch of one row each, where the
    block maps tokens to tokens; each token's result is the whole call's."""
    import mlx.core as mx

    call = super(type(self), self).__call__
    rows = math.prod(x.shape[:-1])
    if args or kwargs or x.ndim < 2 or rows <= self._max_routed:
        return call(x, *args, **kwargs)
    flat = x.reshape(1, rows, x.shape[-1])
    parts = [call(flat[:, a:a + self._max_routed]) for a in range(0, rows, self._max_routed)]
    if not all(isinstance(p, mx.array) and p.shape[:2] == (1, min(self._max_routed, rows - a))
               for p, a in zip(parts, range(0, rows, self._max_routed), strict=True)):
        return call(x)  # not a token-to-token block: run it whole
    out = mx.concatenate(parts, axis=1)
    return out.reshape(*x.shape[:-1], out.shape[-1])
