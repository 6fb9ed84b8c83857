"""Random-weight models of real families and quantizations, for tests and benchmarks.

A model is built from mlx-lm's own classes for a config of the family's shape, its weights drawn
from a seeded generator, quantized as mlx-lm's converter would (`mlx_lm.utils.quantize_model`),
and saved with the demo tokenizer (random_model.py): a folder `mlx_lm.load` and batchrun load
like any downloaded one, built with no download.

    python -m batchrun.models.build OUT --family qwen3 --size tiny --quantize 4bit
    python -m batchrun.models.build OUT --family qwen3_moe --size bench --quantize 4bit

Families: llama, qwen2 (biases on q, k and v), qwen3, qwen3_moe (mixture of experts), gpt_oss
(experts and attention sinks), gemma3 (sliding window), qwen3_5 (gated-delta recurrent layers),
granite_hybrid (Mamba-2 layers beside attention, Granite 4's hybrid). Sizes: `tiny` (a few MB,
for tests on the CPU) and `bench` (the shapes the GPU benchmarks use). Quantizations: none, 4bit and
8bit (affine, group 64; `-g32` / `-g128` for other groups), mxfp4 (gpt-oss's format), 4bit-mixed
(embedding and head in 8-bit, as mixed recipes keep them) and 4bit-fullhead (embedding and head
unquantized).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

# Each family's config at size "tiny" and size "bench"; vocab_size 0 is the demo tokenizer's.
_COMMON = {"rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "rope_theta": 10000.0,
           "tie_word_embeddings": False}
FAMILIES: dict[str, dict[str, dict]] = {
    "llama": {
        "tiny": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=768,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64),
        "bench": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                      vocab_size=128256),
    },
    "qwen3": {
        "tiny": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=768,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64),
        # Qwen3-1.7B's shape (~2B with its 152k vocabulary)
        "bench": dict(hidden_size=2048, num_hidden_layers=28, intermediate_size=6144,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                      vocab_size=151936),
    },
    "qwen2": {
        "tiny": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=768,
                     num_attention_heads=4, num_key_value_heads=2),
        # Qwen2.5-1.5B's shape
        "bench": dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960,
                      num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
    },
    "qwen3_moe": {
        "tiny": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=768,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=128),
        "bench": dict(hidden_size=2048, num_hidden_layers=12, intermediate_size=6144,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768,
                      vocab_size=151936),
    },
    "gpt_oss": {
        "tiny": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=256,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     num_local_experts=8, num_experts_per_tok=2, sliding_window=128),
        "bench": dict(hidden_size=2880, num_hidden_layers=12, intermediate_size=2880,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                      num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                      vocab_size=201088),
    },
    "gemma3": {
        "tiny": dict(hidden_size=256, num_hidden_layers=6, intermediate_size=768,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                     query_pre_attn_scalar=64, sliding_window=64, sliding_window_pattern=6),
        # Gemma-3-1B's shape
        "bench": dict(hidden_size=1152, num_hidden_layers=26, intermediate_size=6912,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                      query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
                      vocab_size=262144),
    },
    "qwen3_5": {
        "tiny": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
                     linear_value_head_dim=32, full_attention_interval=4),
        "bench": dict(hidden_size=2048, num_hidden_layers=24, intermediate_size=6144,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                      linear_num_value_heads=16, linear_num_key_heads=16,
                      linear_key_head_dim=128, linear_value_head_dim=128,
                      full_attention_interval=4, vocab_size=151936),
    },
    # Granite 4's hybrid: Mamba-2 layers beside attention (dense, no experts)
    "granite_hybrid": {
        "tiny": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                     num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
                     embedding_multiplier=1.0, attention_multiplier=0.125,
                     logits_scaling=1.0, residual_multiplier=1.0,
                     layer_types=["mamba", "mamba", "attention", "mamba"],
                     mamba_n_heads=16, mamba_d_head=32, mamba_proj_bias=False,
                     mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1,
                     mamba_conv_bias=True, position_embedding_type="rope",
                     shared_intermediate_size=512),
        "bench": dict(hidden_size=1536, num_hidden_layers=24, intermediate_size=3072,
                      num_attention_heads=12, num_key_value_heads=4, attention_bias=False,
                      embedding_multiplier=1.0, attention_multiplier=0.0078125,
                      logits_scaling=1.0, residual_multiplier=1.0,
                      layer_types=["attention" if i % 6 == 5 else "mamba" for i in range(24)],
                      mamba_n_heads=48, mamba_d_head=64, mamba_proj_bias=False,
                      mamba_d_state=128, mamba_d_conv=4, mamba_n_groups=1,
                      mamba_conv_bias=True, position_embedding_type="rope",
                      shared_intermediate_size=4096, vocab_size=100352),
    },
}
MODEL_TYPES = {"gemma3": "gemma3_text", "granite_hybrid": "granitemoehybrid"}
MOE_DEFAULTS = {"qwen3_moe": dict(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)}
SIZES = ("tiny", "bench")
QUANTIZATIONS = ("none", "4bit", "4bit-g32", "4bit-g128", "8bit", "8bit-g32", "mxfp4",
                 "4bit-mixed", "4bit-fullhead")


def family_config(family: str, size: str, vocab_size: int, eos: list[int],
                  dtype: str) -> dict:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    shape = dict(FAMILIES[family][size])
    config = {"model_type": MODEL_TYPES.get(family, family), **_COMMON,
              **MOE_DEFAULTS.get(family, {}), **shape}
    config["vocab_size"] = shape.get("vocab_size") or vocab_size
    config.update(eos_token_id=eos, torch_dtype=dtype, batchrun_family=family,
                  batchrun_size=size)
    return config


def parse_quantization(spec: str) -> dict | None:
    """{"bits", "group_size", "mode", "recipe"} for a QUANTIZATIONS name; None for "none"."""
    if spec == "none":
        return None
    if spec == "mxfp4":
        return {"bits": 4, "group_size": 32, "mode": "mxfp4", "recipe": None}
    m = re.fullmatch(r"([48])bit(?:-g(32|64|128))?(?:-(mixed|fullhead))?", spec)
    if not m or spec not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {spec!r}; choose from "
                         f"{', '.join(QUANTIZATIONS)}")
    return {"bits": int(m.group(1)), "group_size": int(m.group(2) or 64), "mode": "affine",
            "recipe": m.group(3)}


def _is_edge(path: str) -> bool:
    """The embedding and the head: what mixed recipes keep wider."""
    return path.endswith(("embed_tokens", "lm_head"))


def build_family(out: str | Path, family: str, size: str = "tiny", quantize: str = "none",
                 dtype: str = "float32", seed: int = 0) -> Path:
    """Write a model folder of `family` at `size`, quantized as `quantize` says, from weights
    drawn in `dtype` (a quantized model's scales take it: float32 ones compute in float32)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    from batchrun.models.random_model import build_tokenizer, write_json

    quant = parse_quantization(quantize)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    n_vocab = build_tokenizer(out, seed=0)
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    eos = [t["id"] for t in added if t["content"] in ("<|im_end|>", "<|endoftext|>")]
    config = family_config(family, size, n_vocab, eos, dtype)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    key = mx.random.key(seed)
    weights = []
    for i, (name, p) in enumerate(sorted(tree_flatten(model.parameters()))):
        weights.append((name, _draw(name, p, mx.random.split(key, i + 1)[-1]).astype(
            getattr(mx, dtype))))
        mx.eval(weights[-1][1])
    model.update(tree_unflatten(weights))
    if quant is not None:
        recipe = quant.pop("recipe")

        def predicate(path: str, module: Any) -> bool | dict:
            if not _is_edge(path) or recipe is None:
                return True
            if recipe == "fullhead":
                return False
            return {"bits": 8, "group_size": quant["group_size"], "mode": "affine"}

        model, config = quantize_model(model, config, quant["group_size"], quant["bits"],
                                       mode=quant["mode"], quant_predicate=predicate)
    save_model(out, model)
    save_config(config, out / "config.json")
    write_json(out / "generation_config.json", {"eos_token_id": eos})
    return out


def _draw(name: str, p: Any, key: Any) -> Any:
    """A parameter's random value: norms one, biases and sinks zero, an embedding unit
    normal, other matrices fan-in scaled normal (the head with a gain of 4, so greedy decoding
    has clear winners)."""
    import mlx.core as mx

    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and leaf == "weight" or leaf in ("A_log",):
        return mx.ones(p.shape, mx.float32) if "norm" in name else mx.zeros(p.shape)
    if leaf in ("bias", "sinks", "dt_bias") or p.ndim < 2:
        return mx.zeros(p.shape, mx.float32)
    if "embed_tokens" in name:
        return mx.random.normal(p.shape, key=key)
    gain = 4.0 if "lm_head" in name else 1.0
    return mx.random.normal(p.shape, key=key) * (gain / p.shape[-1] ** 0.5)
