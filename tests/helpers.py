"""Small helpers the job-level tests share: run the CLI in-process, write and read JSONL."""

import json
import time
from pathlib import Path

import orjson
from click.testing import CliRunner

from batchrun.cli import cli


def jsonl(path) -> list:
    return [orjson.loads(x) for x in Path(path).read_bytes().splitlines() if x.strip()]


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def run(*args, code=0):
    """`batchrun run ARGS --quiet`, asserting its exit code."""
    result = CliRunner().invoke(cli, ["run", *map(str, args), "--quiet"])
    assert result.exit_code == code, result.output
    return result


def committed_rows(job: Path) -> int:
    """Rows with a record that the job's state.json records (0 before the first commit)."""
    try:
        state = orjson.loads((job / "state.json").read_bytes())
    except (OSError, ValueError):
        return 0
    return state["rows_done"] + state["rows_failed"]


def wait_until(condition, proc, timeout: float = 60.0) -> None:
    """Wait for `condition()` while the process `proc` runs; fails if it ends or time runs
    out first."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, "the job ended before the condition held"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def choice_logprob(lm, prompt: str, choice: str) -> float:
    """A choice's log-probability after a prompt, from one uncached forward of the model over
    both: the sum of its tokens' log-probabilities (what choices.py reports)."""
    import mlx.core as mx

    ids = lm.tokenizer.encode(prompt)
    tokens = lm.tokenizer.encode(choice, add_special_tokens=False)
    logits = lm.model(mx.array(ids + tokens)[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sum(logprobs[len(ids) - 1 + i, t].item() for i, t in enumerate(tokens))


def write_gguf(model_dir: Path, out: Path, dtype: str = "float32",
               tokenizer: dict | None = None) -> Path:
    """An mlx-lm Llama folder written as llama.cpp's converter writes a GGUF file: its tensor
    names, query and key rows permuted for llama.cpp's rotary layout, the tokenizer's
    vocabulary, merges and chat template in the metadata (or the `tokenizer` metadata given)."""
    import mlx.core as mx

    config = json.loads((model_dir / "config.json").read_text())
    weights = mx.load(str(model_dir / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    arch = config["model_type"]  # llama, qwen2 or qwen3: llama.cpp's names for them
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors = {}
    for name, w in weights.items():
        stem, _, part = name.rpartition(".")
        if stem == "model.embed_tokens":
            target = "token_embd"
        elif stem == "model.norm":
            target = "output_norm"
        elif stem == "lm_head":
            target = "output"
        else:
            layer, rest = stem.removeprefix("model.layers.").split(".", 1)
            target = f"blk.{layer}.{names[rest]}"
        if arch == "llama" and target.endswith((".attn_q", ".attn_k")):
            n = heads if target.endswith("attn_q") else kv_heads
            w = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2) \
                .reshape(w.shape)
        tensors[f"{target}.{part}"] = w.astype(getattr(mx, dtype))
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    size = config["vocab_size"]
    tokens, types = [f"<unused{i}>" for i in range(size)], [1] * size
    for text, i in tok["model"]["vocab"].items():
        tokens[i] = text
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    meta = {"general.architecture": arch, "general.name": "batchrun test model",
            f"{arch}.embedding_length": u32(config["hidden_size"]),
            f"{arch}.block_count": u32(config["num_hidden_layers"]),
            f"{arch}.feed_forward_length": u32(config["intermediate_size"]),
            f"{arch}.attention.head_count": u32(heads),
            f"{arch}.attention.head_count_kv": u32(kv_heads),
            f"{arch}.attention.key_length": u32(head_dim),
            f"{arch}.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"]),
            f"{arch}.rope.freq_base": mx.array(config.get("rope_theta", 10000.0)),
            f"{arch}.context_length": u32(config["max_position_embeddings"]),
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": u32(2), "tokenizer.ggml.padding_token_id": u32(0),
            "tokenizer.chat_template": tok_config["chat_template"]}
    if config.get("rope_scaling"):  # Llama 3.1's: llama.cpp stores each frequency's factor
        from mlx_lm.models.rope_utils import Llama3RoPE

        dims = config["head_dim"]
        rope = Llama3RoPE(dims, base=config["rope_theta"], scaling_config=config["rope_scaling"])
        tensors["rope_freqs.weight"] = rope._freqs / config["rope_theta"] ** (
            mx.arange(0, dims, 2) / dims)
    if tokenizer is not None:
        meta = {k: v for k, v in meta.items() if not k.startswith("tokenizer.")} | tokenizer
    mx.save_gguf(str(out), tensors, meta)
    return out
