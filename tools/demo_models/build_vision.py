"""Build a random-weight Qwen2-VL-shaped model that loads through `mlx_vlm.load` like a real one.

The bundled demo vision model (`sample_data/demo-vision-model`) is made here: the demo model's BPE
tokenizer plus Qwen2-VL's vision tokens, a ChatML template that renders OpenAI-style content
lists, the image / video processor files (so loading never asks the hub), and fp32 weights
drawn from a seeded NumPy generator: the same command rebuilds the same bytes. Its text is
meaningless, but it depends on the image: input and output embeddings are untied.

    python -m tools.demo_models.build_vision sample_data/demo-vision-model
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import numpy as np

from batchrun.models.random_model import (
    CONTEXT_LENGTH,
    build_tokenizer,
    tokenizer_config,
    write_json,
)

# Qwen2-VL's image and video markers; one <|image_pad|> in a prompt becomes one token per merged
# 2x2 block of 14 px patches.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE  # image sides are rounded to multiples of this (28 px)
MIN_PIXELS = 2 * FACTOR * 2 * FACTOR  # 56x56: at least 4 image tokens
MAX_PIXELS = 4 * FACTOR * 4 * FACTOR  # 112x112: at most 16 image tokens
# OpenAI CLIP's normalization, as Qwen2-VL uses.
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]

TEXT = {"hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 384,
        "num_attention_heads": 4, "num_key_value_heads": 2}
# mrope_section splits the 16 rotary frequencies of a 32-dim head over (time, height, width).
MROPE_SECTION = [4, 6, 6]
VISION = {"depth": 2, "embed_dim": 64, "num_heads": 4, "mlp_ratio": 4}

# ChatML turns; a content list renders text parts as text and image / video parts as Qwen2-VL's
# markers (the processor expands each <|image_pad|> to the image's token count).
CHAT_TEMPLATE = r"""
{%- for message in messages -%}
<|im_start|>{{ message.role }}
{% if message.content is string -%}
{{ message.content }}
{%- else -%}
{%- for part in message.content -%}
{%- if part.type in ('image', 'image_url', 'input_image') -%}
<|vision_start|><|image_pad|><|vision_end|>
{%- elif part.type == 'video' -%}
<|vision_start|><|video_pad|><|vision_end|>
{%- elif part.type == 'text' -%}
{{ part.text }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
""".strip()


def build_vision_tokenizer(out: Path) -> tuple[dict[str, int], int]:
    """The demo model's tokenizer plus the vision tokens; returns the special tokens' ids and
    the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer

    build_tokenizer(out)  # the demo model's tokenizer (its training is deterministic)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in VISION_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tokenizer_config(CHAT_TEMPLATE))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n")
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    return {t["content"]: t["id"] for t in added if t["special"]}, tok.get_vocab_size()


def model_config(ids: dict[str, int], vocab_size: int, seed: int) -> dict:
    """Qwen2-VL's flat config.json: text fields at the top, the vision tower's nested."""
    return {
        "model_type": "qwen2_vl",
        "architectures": ["Qwen2VLForConditionalGeneration"],
        **TEXT,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": CONTEXT_LENGTH,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": MROPE_SECTION},
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "bos_token_id": None,
        "eos_token_id": [ids["<|endoftext|>"], ids["<|im_end|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "vision_config": {
            **VISION,
            "hidden_size": TEXT["hidden_size"],  # the merger projects into the text width
            "in_channels": 3,
            "patch_size": PATCH_SIZE,
            "spatial_patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        },
        "torch_dtype": "float32",
        "batchrun_seed": seed,
    }


def processor_configs() -> dict[str, dict]:
    """The image, video and processor files; without them the processor looks on the hub."""
    pixels = {"patch_size": PATCH_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
              "merge_size": MERGE_SIZE, "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
              "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
              "do_resize": True, "resample": 3, "do_rescale": True,
              "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": IMAGE_MEAN,
              "image_std": IMAGE_STD, "do_convert_rgb": True}
    return {
        "preprocessor_config.json": {"image_processor_type": "Qwen2VLImageProcessor",
                                     "processor_class": "Qwen2VLProcessor", **pixels},
        "video_preprocessor_config.json": {"video_processor_type": "Qwen2VLVideoProcessor",
                                           "processor_class": "Qwen2VLProcessor", **pixels,
                                           "fps": 2.0, "min_frames": 4, "max_frames": 16},
        "processor_config.json": {"processor_class": "Qwen2VLProcessor"},
    }


def build_vision(out: str | Path, seed: int = 0) -> Path:
    """Write a complete vision model folder to `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = model_config(*build_vision_tokenizer(out), seed)
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", {"eos_token_id": config["eos_token_id"]})
    for name, obj in processor_configs().items():
        write_json(out / name, obj)
    _write_weights(out / "model.safetensors", config, seed)
    return out


def _write_weights(path: Path, config: dict, seed: int) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import qwen2_vl

    # mlx-vlm's own classes name the tensors, as they are after its sanitize step (the patch
    # embedding's Conv3d weight in MLX's channels-last layout).
    cfg = copy.deepcopy(config)  # from_dict edits the dict it is given
    args = qwen2_vl.ModelConfig.from_dict(cfg)
    args.text_config = qwen2_vl.TextConfig.from_dict(cfg["text_config"])
    args.vision_config = qwen2_vl.VisionConfig.from_dict(cfg["vision_config"])
    model = qwen2_vl.Model(args)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, param in sorted(tree_flatten(model.parameters())):
        shape = tuple(param.shape)
        if name.endswith("bias"):
            value = np.zeros(shape, np.float32)
        elif "norm" in name or ".ln_q." in name:
            value = np.ones(shape, np.float32)
        elif "embed_tokens" in name:
            value = rng.standard_normal(shape, np.float32)
        else:
            # fan-in scaling keeps activations O(1), image features as large as token
            # embeddings; a larger gain on lm_head gives peaked logits (clear greedy winners).
            gain = 4.0 if name.endswith("lm_head.weight") else 1.0
            std = gain / np.sqrt(np.prod(shape[1:]))
            value = rng.standard_normal(shape, np.float32) * np.float32(std)
        weights[name] = mx.array(value)
    # Zero logits for the vision markers: like a trained model, it never writes them.
    markers = [config[k] for k in ("vision_start_token_id", "vision_end_token_id",
                                   "image_token_id", "video_token_id")]
    head = np.array(weights["language_model.lm_head.weight"])
    head[markers] = 0.0
    weights["language_model.lm_head.weight"] = mx.array(head)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_vision(args.out, args.seed))


if __name__ == "__main__":
    main()
