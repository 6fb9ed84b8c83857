"""Issue 6's GPU benchmark: bf16 Llama-3.2-1B-shaped model (random weights), 1,024 rows of
128-token prompts, 256 new tokens; batchrun vs mlx-lm batch_generate vs HF transformers
`generate` (PyTorch), plus the decode roofline from the measured memory bandwidth.

    python scripts/bench_gpu.py OUT_DIR [--rows 1024] [--systems batchrun,batch_generate,hf]

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

from batchrun.engine.engine import Engine
from batchrun.engine.request import EngineConfig, SamplingParams
from batchrun.models import load_model
from batchrun.models.build import build

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


def run_batchrun(lm, ps, concurrency):
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(max_concurrency=concurrency,
                                                         prefill_batch_size=64),
                    lm.context_length)
    start = time.perf_counter()
    for p in ps:
        engine.add_tokens(p, SamplingParams(max_tokens=NEW_TOKENS))
    outs = engine.run()
    wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": sum(o.completion_tokens for o in outs),
            "mean_batch": engine.stats.mean_batch_size,
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
    for c in map(int, args.concurrency.split(",")):
        for name in systems:
            if name == "batchrun":
                r = run_batchrun(lm, ps, c)
            elif name == "batch_generate":
                r = run_batch_generate(lm, ps, c)
            else:
                continue
            r |= {"system": name, "concurrency": c, "tokens_per_s": r["tokens"] / r["wall_s"],
                  "roofline": roofline(config, gbs, c)}
            results["runs"].append(r)
            print(json.dumps(r), flush=True)
            mx.clear_cache()
    if "hf" in systems:
        del lm
        mx.clear_cache()
        for b in (256,):
            r = run_hf(model_dir, ps, b)
            r |= {"system": "transformers", "tokens_per_s": r["tokens"] / r["wall_s"]}
            results["runs"].append(r)
            print(json.dumps(r), flush=True)
    (args.out / "gpu.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
