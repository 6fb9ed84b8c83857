"""Issue 6's GPU benchmark: bf16 Llama-3.2-1B-shaped model (random weights), 1,024 rows of
128-token prompts, 256 new tokens; batchrun vs mlx-lm batch_generate vs HF transformers
`generate` (PyTorch), plus the decode roofline from the measured memory bandwidth.

    python scripts/bench_gpu.py OUT_DIR [--rows 1024] [--concurrency 256,1024] [--profile]
        [--systems batchrun,batchrun_masked,batchrun_defaults,batchrun_mlx_step,batch_generate,hf]

`batchrun_mlx_step` is batchrun on mlx-lm's own GenerationBatch instead of
engine/backends/batch.py's; `batchrun_masked` decodes through MLX's attention with mlx-lm's mask
instead of the ranged decode kernel (engine/kernels/decode_attention.py); `batchrun_defaults`
runs with no flags.
`--profile` adds the bare model's decode step (the floor any engine on MLX can reach) and a
timing of where batchrun's step goes: waiting on the device vs host work.

Runs on a machine with MLX's CUDA (or Metal) backend. Writes OUT_DIR/gpu.json.
"""

import argparse
import json
import random
import time
from pathlib import Path

import batchrun  # noqa: F401

# isort: split
import mlx.core as mx

import batchrun.engine.backends.text as text_module
from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.kernels import decode_attention
from batchrun.engine.types import SamplingParams
from batchrun.models import load_model
from batchrun.models.random_model import build

PROMPT_TOKENS, NEW_TOKENS = 128, 256


def bandwidth_gbs() -> float:
    """Device memory bandwidth: a large on-device copy (read + write)."""
    a = mx.zeros((1 << 30) // 2, dtype=mx.bfloat16)  # 1 GiB
    mx.eval(a)
    for _ in range(3):
        mx.eval(a + 1)
    start = time.perf_counter()
    n = 20
    for _ in range(n):
        mx.eval(a + 1)
    return 2 * a.nbytes * n / (time.perf_counter() - start) / 1e9


def prompts(rows: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(rows)]


def run_batchrun(lm, ps, concurrency, defaults=False):
    config = EngineConfig() if defaults else EngineConfig(max_concurrency=concurrency,
                                                          prefill_batch_size=64)
    engine = Engine(lm.model, lm.tokenizer, config, lm.context_length)
    start = time.perf_counter()
    for p in ps:
        engine.add_tokens(p, SamplingParams(max_tokens=NEW_TOKENS))
    outs = engine.run()
    wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": sum(o.completion_tokens for o in outs),
            "mean_batch": engine.stats.mean_batch_size, "steps": engine.stats.decode_steps,
            "prefill_s": engine.stats.prefill_time, "decode_s": engine.stats.decode_time,
            "peak_memory_gb": mx.get_peak_memory() / 1e9}


def run_batch_generate(lm, ps, concurrency):
    from mlx_lm.generate import batch_generate

    start = time.perf_counter()
    out = batch_generate(lm.model, lm.tokenizer, ps, max_tokens=NEW_TOKENS,
                         completion_batch_size=concurrency, prefill_batch_size=64,
                         return_token_ids=True)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": sum(len(t) for t in out.token_ids),
            "prefill_s": out.stats.prompt_time, "decode_s": out.stats.decode_time}


def run_hf(model_dir: Path, ps, batch: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(ps), batch):
        ids = torch.tensor(ps[i: i + batch], device="cuda")
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
        tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    torch.cuda.synchronize()
    return {"wall_s": time.perf_counter() - start, "tokens": tokens, "batch": batch}


def bare_decode(lm, batch: int, steps: int = 32) -> dict:
    """The kernel floor: the model alone decoding `batch` rows (no scheduler, no mask).

    `sync`: build a step's graph, then wait for it (host and device one after the other);
    `pipelined`: build step i+1 while the device runs step i, as BatchGenerator does;
    `masked`: pipelined on mlx-lm's BatchKVCache (per-row offsets and an attention mask, as in
    any continuous batch), to price the mask.
    """
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    args = lm.model.args
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    dtype = lm.model.model.embed_tokens.weight.dtype
    result = {"batch": batch}
    for mode in ("sync", "pipelined", "masked"):
        shape = (batch, args.num_key_value_heads, PROMPT_TOKENS + 2 * steps + 256, head_dim)
        if mode == "masked":
            cache = [BatchKVCache([0] * batch) for _ in lm.model.layers]
            for c in cache:
                c.keys, c.values = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
                c._idx, c.offset = PROMPT_TOKENS, mx.full((batch,), PROMPT_TOKENS)
        else:
            cache = make_prompt_cache(lm.model)
            for c in cache:
                c.keys, c.values = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
                c.offset = PROMPT_TOKENS
        y = mx.zeros((batch,), mx.int32)

        def step(y, cache=cache):
            logits = lm.model(y[:, None], cache=cache)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return mx.argmax(logprobs, axis=-1)

        for _ in range(4):
            y = step(y)
            mx.eval(y)
        build = 0.0
        start = time.perf_counter()
        if mode == "sync":
            for _ in range(steps):
                t = time.perf_counter()
                y = step(y)
                build += time.perf_counter() - t
                mx.eval(y)
        else:
            nxt = step(y)
            mx.async_eval(nxt)
            for _ in range(steps):
                t = time.perf_counter()
                after = step(nxt)
                build += time.perf_counter() - t
                mx.async_eval(after)
                nxt.tolist()
                nxt = after
            mx.eval(nxt)
        total = time.perf_counter() - start
        result[mode] = {"step_ms": total / steps * 1e3, "host_build_ms": build / steps * 1e3,
                        "tokens_per_s": batch * steps / total}
    return result


def engine_decode_only(lm, batch: int, steps: int = 32) -> dict:
    """batchrun's decode step alone: every row admitted and prefilled, then `steps` steps timed;
    with and without the BatchGenerator's own stream, to compare with `bare_decode`."""
    from mlx_lm.generate import generation_stream

    result = {"batch": batch}
    for stream_name, stream in (("generation_stream", generation_stream),
                                ("default_stream", mx.default_stream(mx.default_device()))):
        engine = Engine(lm.model, lm.tokenizer, EngineConfig(max_concurrency=batch,
                                                             prefill_batch_size=64),
                        lm.context_length)
        engine.backend._gen._stream = stream
        for p in prompts(batch, 777):
            engine.add_tokens(p, SamplingParams(max_tokens=steps + 64))
        while engine.num_waiting or len(engine.backend._gen._generation_batch) < batch:
            engine.step()
        for _ in range(4):
            engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - start
        result[stream_name] = {"step_ms": total / steps * 1e3,
                               "tokens_per_s": batch * steps / total}
        engine.close()
        del engine
        mx.clear_cache()
    return result


def attention_cost(lm, batch: int, length: int = PROMPT_TOKENS + NEW_TOKENS // 2) -> dict:
    """One layer's decode attention at `batch` rows: fused without a mask vs with the boolean
    and additive masks a padded continuous batch needs."""
    args = lm.model.args
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    dtype = lm.model.model.embed_tokens.weight.dtype
    q = mx.random.normal((batch, args.num_attention_heads, 1, head_dim)).astype(dtype)
    k = mx.random.normal((batch, args.num_key_value_heads, length, head_dim)).astype(dtype)
    v = mx.random.normal(k.shape).astype(dtype)
    keep = mx.arange(length)[None, None, None, :] >= mx.arange(batch)[:, None, None, None] % 8
    masks = {"none": None, "bool": keep,
             "additive": mx.where(keep, 0.0, -mx.inf).astype(dtype)}
    result = {"batch": batch, "kv_length": length}
    for name, mask in masks.items():
        mx.eval(q, k, v, *([mask] if mask is not None else []))
        for _ in range(3):
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask))
        start = time.perf_counter()
        for _ in range(20):
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask))
        result[f"{name}_ms"] = (time.perf_counter() - start) / 20 * 1e3
    return result


def profile_batchrun(lm, ps, concurrency: int, out: Path) -> dict:
    """One run with `mx.eval` timed (where Python waits for the device) and a cProfile of the
    host work (written to OUT/profile_cN.txt; cProfile slows the host part somewhat)."""
    import cProfile
    import io
    import pstats

    real_eval = mx.eval
    waited = [0.0]

    def timed_eval(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real_eval(*args, **kwargs)
        finally:
            waited[0] += time.perf_counter() - t

    results = {"concurrency": concurrency, "rows": len(ps)}
    mx.eval = timed_eval
    try:
        r = run_batchrun(lm, ps, concurrency)
    finally:
        mx.eval = real_eval
    results |= {"wall_s": r["wall_s"], "steps": r["steps"], "device_wait_s": waited[0],
                "host_s": r["wall_s"] - waited[0],
                "host_ms_per_step": (r["wall_s"] - waited[0]) / r["steps"] * 1e3,
                "wait_ms_per_step": waited[0] / r["steps"] * 1e3}
    profiler = cProfile.Profile()
    profiler.enable()
    run_batchrun(lm, ps, concurrency)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    (out / f"profile_c{concurrency}.txt").write_text(text.getvalue())
    return results


def roofline(config: dict, gbs: float, batch: int) -> dict:
    """Decode tokens/s if every step only had to read the weights and the batch's KV."""
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    weights = config["batchrun_weight_bytes"]
    kv_per_token = layers * kv_heads * head_dim * 2 * 2  # keys and values, 2 bytes each
    mean_len = PROMPT_TOKENS + NEW_TOKENS / 2
    step_bytes = weights + batch * mean_len * kv_per_token
    step_s = step_bytes / (gbs * 1e9)
    return {"batch": batch, "step_bytes": step_bytes, "step_ms": step_s * 1000,
            "tokens_per_s": batch / step_s}


def main() -> None:
    global NEW_TOKENS
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--systems", default="batchrun,batch_generate,hf")
    parser.add_argument("--concurrency", default="256,1024")
    parser.add_argument("--shape", default="llama-1b")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure every (concurrency, system) this many times, interleaved, "
                             "so no system gains from running after another")
    parser.add_argument("--profile", action="store_true",
                        help="also the bare-model decode floor and a cProfile of batchrun")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    NEW_TOKENS = args.new_tokens
    model_dir = Path(f"/tmp/{args.shape}")
    if not (model_dir / "config.json").exists():
        t = time.perf_counter()
        build(model_dir, args.shape)
        print(f"built {args.shape} in {time.perf_counter() - t:.0f}s", flush=True)
    lm = load_model(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    config["batchrun_weight_bytes"] = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    gbs = bandwidth_gbs()
    ps = prompts(args.rows, 777)
    results = {"device": str(mx.default_device()), "device_info": mx.device_info(),
               "bandwidth_gbs": gbs, "rows": args.rows, "prompt_tokens": PROMPT_TOKENS,
               "new_tokens": NEW_TOKENS, "runs": []}
    systems = args.systems.split(",")
    # Warm-up: compile kernels.
    run_batchrun(lm, ps[:8], 8)
    plan = [(rep, c, name) for rep in range(args.repeat)
            for c in map(int, args.concurrency.split(",")) for name in systems]
    for rep, c, name in plan:
        if name == "batchrun":
            r = run_batchrun(lm, ps, c)
        elif name == "batchrun_mlx_step":  # batchrun on mlx-lm's own GenerationBatch
            text_module.LEAN_STEP = False
            r = run_batchrun(lm, ps, c)
            text_module.LEAN_STEP = True
        elif name == "batchrun_masked":  # decode attention through mlx-lm's mask
            decode_attention.ENABLED = False
            r = run_batchrun(lm, ps, c)
            decode_attention.ENABLED = True
        elif name == "batchrun_defaults":  # no flags: the engine's own concurrency and prefill
            r = run_batchrun(lm, ps, c, defaults=True)
        elif name == "batch_generate":
            r = run_batch_generate(lm, ps, c)
        else:
            continue
        r |= {"system": name, "concurrency": c, "rep": rep,
              "tokens_per_s": r["tokens"] / r["wall_s"],
              "roofline": roofline(config, gbs, c)}
        results["runs"].append(r)
        print(json.dumps(r), flush=True)
        mx.clear_cache()
    if args.profile:
        results["bare"], results["profiles"] = [], []
        for c in map(int, args.concurrency.split(",")):
            results["bare"].append(bare_decode(lm, c))
            print(json.dumps(results["bare"][-1]), flush=True)
            results.setdefault("engine_decode", []).append(engine_decode_only(lm, c))
            print(json.dumps(results["engine_decode"][-1]), flush=True)
            results.setdefault("attention", []).append(attention_cost(lm, c))
            print(json.dumps(results["attention"][-1]), flush=True)
            mx.clear_cache()
            results["profiles"].append(profile_batchrun(lm, ps[:c], c, args.out))
            print(json.dumps(results["profiles"][-1]), flush=True)
            mx.clear_cache()
        (args.out / "gpu.json").write_text(json.dumps(results, indent=2, default=str))
    if "hf" in systems:
        del lm
        mx.clear_cache()
        for b in map(int, args.concurrency.split(",")):
            r = run_hf(model_dir, ps, b)
            r |= {"system": "transformers", "tokens_per_s": r["tokens"] / r["wall_s"]}
            results["runs"].append(r)
            print(json.dumps(r), flush=True)
    (args.out / "gpu.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
