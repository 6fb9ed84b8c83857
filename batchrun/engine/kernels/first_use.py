"""A process's first use of MLX's GPU kernels, paid while the model's weights load.

On a CUDA GPU a process's first forward pass costs 0.4-0.5 s more than its second (kernels
loaded into the process, cuBLAS set up), whatever the weights: measured on the H200 with a 1B
Llama, the real model's first warm-up took 0.03 s instead of 0.40-0.48 after a stand-in's
(`benchmarks/history/scripts/probe_warmup_overlap.py`). So while mlx-lm loads the weights, a thread
builds a one-layer stand-in of the model's configuration (random weights in the model's dtype,
quantized as it is, a small vocabulary) and runs on it, on a stream of its own, what the
engine's warm-up runs: a padded two-row prefill and three decode steps.

Only on CUDA, where it was measured (`BATCHRUN_STAND_IN_WARM_UP=0` turns it off). A stand-in
that cannot be built or run (an architecture a one-layer copy of its configuration does not
fit) is skipped, said at debug level: the job loses only the head start.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("batchrun")

ENV = "BATCHRUN_STAND_IN_WARM_UP"
VOCAB = 4096  # the stand-in's vocabulary: the output layer of a real one is up to 1 GB
JOIN_TIMEOUT_S = 120.0
_started = threading.Event()  # once a process: after that its kernels are loaded


def wanted() -> bool:
    """On a CUDA GPU, unless turned off."""
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    return os.environ.get(ENV) != "0" and cuda is not None and cuda.is_available() \
        and mx.default_device() == mx.gpu


def start(model_path: str) -> threading.Thread | None:
    """Warm up a stand-in of the model in `model_path` on a thread (None where not wanted, done
    already in this process, or the configuration is unreadable); join it once the model is
    loaded (`finish`)."""
    if _started.is_set() or not wanted():
        return None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not flat(config):
        return None
    _started.set()
    thread = threading.Thread(target=run, args=(config,), name="batchrun-stand-in", daemon=True)
    thread.start()
    return thread


def finish(thread: threading.Thread | None) -> None:
    if thread is not None:
        thread.join(JOIN_TIMEOUT_S)
        if thread.is_alive():
            log.warning("the GPU warm-up beside the model's loading is still running after "
                        "%.0f s; the job starts anyway", JOIN_TIMEOUT_S)


def run(config: dict) -> bool:
    """Build the stand-in and warm it up on a stream of its own; whether it ran."""
    import mlx.core as mx

    try:
        with mx.stream(mx.new_stream(mx.default_device())):
            warm_up(stand_in(config))
        return True
    except Exception as e:  # any architecture's own failure: only the head start is lost
        log.debug("no GPU warm-up beside the model's loading (%s: %s)", type(e).__name__, e)
        return False


def flat(config: Any) -> bool:
    """A configuration a one-layer stand-in is sure to be one layer of: its layer count and
    vocabulary at the top, no nested model configuration (a vision-language model's text_config
    with a layer count of its own would build a full-depth random model beside the real one)."""
    return (isinstance(config, dict)
            and type(config.get("num_hidden_layers")) is int
            and type(config.get("vocab_size")) is int
            and not any(isinstance(v, dict) and ("num_hidden_layers" in v or "vocab_size" in v)
                        for v in config.values()))


def stand_in(config: dict) -> Any:
    """A one-layer model of `config`'s architecture, dtype and quantization, random weights."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map
    from mlx_lm import utils

    config = dict(config, num_hidden_layers=1, vocab_size=min(VOCAB, config["vocab_size"]))
    # mlx-lm's own choice of classes for a configuration (its load calls the same)
    classes = getattr(utils, "get_model_classes", None) or utils._get_classes
    model_class, args_class = classes(config=config)
    model = model_class(args_class.from_dict(config))
    if len(getattr(model, "layers", ())) != 1:  # its random weights are not made (lazy)
        raise ValueError("the stand-in is not one layer deep")
    dtype = getattr(mx, str(config.get("torch_dtype") or "bfloat16").removeprefix("torch."))
    model.update(tree_map(lambda a: a.astype(dtype), model.parameters()))
    quantization = config.get("quantization")
    if isinstance(quantization, dict):
        nn.quantize(model, **{k: quantization[k] for k in ("group_size", "bits", "mode")
                              if k in quantization})
    mx.eval(model.parameters())
    return model


def warm_up(model: Any) -> None:
    """What the engine's warm-up runs: two rows of 16 and 9 tokens prefilled together (the
    second left-padded), then three decode steps."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    vocab = model.args.vocab_size if hasattr(model, "args") else VOCAB
    tokens = mx.array([[(1 + i) % vocab for i in range(16)],
                       [0] * 7 + [(40 + i) % vocab for i in range(9)]])
    cache = [BatchKVCache([0, 7]) for _ in model.layers]
    logits = model(tokens, cache=cache)[:, -1]
    for _ in range(3):
        logits = model(mx.argmax(logits, axis=-1)[:, None], cache=cache)[:, -1]
        mx.eval(logits)
