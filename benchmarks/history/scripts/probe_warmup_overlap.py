"""Could a process's first use of MLX's kernels hide behind the model's loading? One fresh
process per run, printing one JSON line:

    python scripts/probe_warmup_overlap.py --model PATH --mode serial|overlap

- serial: load the model (mlx-lm's `load`: weights, tokenizer), then a warm-up on it (a padded
  2-row prefill and three decode steps, as the engine's warm-up), then the same again;
- overlap: while the main thread loads the model, a second thread (on a stream of its own)
  builds a one-layer stand-in of the same configuration with random weights and runs the same
  warm-up on it; then the warm-up on the real model, then again.

Reported: the load, each warm-up, and `ready_s` (from the start to the end of the real model's
first warm-up). If the first use is per process (not per model), the overlap's real warm-up
is as short as the serial run's second one, and `ready_s` shrinks by the difference.
"""

import argparse
import json
import threading
import time

import batchrun  # noqa: F401  (BLAS routing before MLX)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def warm_up(model) -> float:
    """Two rows (16 and 9 tokens, left-padded in one prefill), then three decode steps."""
    start = time.perf_counter()
    tokens = mx.array([[1 + i for i in range(16)], [0] * 7 + [40 + i for i in range(9)]])
    cache = make_prompt_cache(model)
    logits = model(tokens, cache=cache)[:, -1]
    for _ in range(3):
        nxt = mx.argmax(logits, axis=-1)
        mx.eval(nxt)
        logits = model(nxt[:, None], cache=cache)[:, -1]
    mx.eval(logits)
    mx.synchronize()
    return time.perf_counter() - start


def stand_in(config: dict):
    """A one-layer model of the same configuration, random weights in the model's dtype."""
    import importlib

    from mlx.utils import tree_map

    args = dict(config, num_hidden_layers=1)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(args))
    dtype = getattr(mx, str(config.get("torch_dtype", "bfloat16")).replace("torch.", ""),
                    mx.bfloat16)
    model.update(tree_map(lambda a: a.astype(dtype), model.parameters()))
    mx.eval(model.parameters())
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", choices=("serial", "overlap"), required=True)
    args = parser.parse_args()
    from mlx_lm.utils import load

    out = {"mode": args.mode}
    start = time.perf_counter()
    worker = None
    if args.mode == "overlap":
        from pathlib import Path

        config = json.loads((Path(args.model) / "config.json").read_text())

        def side() -> None:
            t = time.perf_counter()
            with mx.stream(mx.new_stream(mx.gpu if mx.metal.is_available()
                                         or mx.cuda.is_available() else mx.cpu)):
                out["stand_in_warm_up_s"] = warm_up(stand_in(config))
            out["side_s"] = time.perf_counter() - t

        worker = threading.Thread(target=side)
        worker.start()
    t = time.perf_counter()
    model, _ = load(args.model)
    out["load_s"] = time.perf_counter() - t
    if worker is not None:
        worker.join()
        out["joined_s"] = time.perf_counter() - start
    out["warm_up_s"] = warm_up(model)
    out["ready_s"] = time.perf_counter() - start
    out["again_s"] = warm_up(model)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}),
          flush=True)


if __name__ == "__main__":
    main()
