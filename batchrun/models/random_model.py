"""Random-weight Llama-shaped models that load through `mlx_lm.load` like any real one.

The bundled demo model (`sample_data/demo-model`) is made here: a byte-level BPE tokenizer trained
on a synthetic corpus, a ChatML chat template with tools and `enable_thinking`, and fp32 weights
drawn from a seeded NumPy generator, so the same call rebuilds the same files. Larger shapes
(`150m`, `llama-1b`) reuse the tokenizer and exist for benchmarks: their text is meaningless.
It ships because an install without the repo builds the demo model on first use and
`batchrun bench --shape` builds its shapes; the command line is tools/demo_models/build.py.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CONTEXT_LENGTH = 8192
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Plain added tokens: they stay in decoded text, so thinking and tool calls can be parsed.
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                 "</tool_response>"]


@dataclass(frozen=True, slots=True)
class Shape:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int = 0  # 0: the trained tokenizer's size
    dtype: str = "float32"


SHAPES = {
    "demo": Shape(128, 4, 384, 4, 2),
    "150m": Shape(1024, 12, 3072, 16, 4),
    # Llama-3.2-1B's dimensions (its 128k vocabulary included), for GPU benchmarks.
    "llama-1b": Shape(2048, 16, 8192, 32, 8, vocab_size=128256, dtype="bfloat16"),
}

# ---------------------------------------------------------------------------------------------
# A small synthetic English corpus: product reviews, questions and instructions. It trains the
# tokenizer and feeds the sample data, so both share a vocabulary.

PRODUCTS = ["kettle", "backpack", "headphones", "desk lamp", "coffee grinder", "rain jacket",
            "keyboard", "water bottle", "blender", "running shoes", "tent", "monitor",
            "phone case", "vacuum cleaner", "notebook", "frying pan", "bike light", "toaster"]
GOOD = ["sturdy", "quiet", "fast", "comfortable", "reliable", "bright", "well made", "light",
        "easy to clean", "worth the price", "beautifully designed", "simple to set up"]
BAD = ["flimsy", "noisy", "slow", "uncomfortable", "unreliable", "dim", "poorly made", "heavy",
       "hard to clean", "overpriced", "ugly", "confusing to set up"]
OPENERS = ["I bought this {p} last month and", "After two weeks with the {p},", "My new {p}",
           "We ordered the {p} for our trip and", "Honestly, this {p}", "The {p} arrived quickly;"]
TOPICS = ["photosynthesis", "the water cycle", "compound interest", "binary search",
          "the French revolution", "plate tectonics", "vaccines", "black holes", "recursion",
          "supply and demand", "the immune system", "climate change", "neural networks"]
TASKS = ["Explain {t} in two sentences.", "Write a short poem about {t}.",
         "List three facts about {t}.", "Summarize {t} for a ten year old.",
         "What is the most common misconception about {t}?", "Give an analogy for {t}."]


def review(rng: random.Random) -> tuple[str, str, int]:
    """A synthetic review: (product, text, rating 1-5)."""
    product = rng.choice(PRODUCTS)
    rating = rng.randint(1, 5)
    pool = GOOD if rating >= 4 else BAD if rating <= 2 else GOOD + BAD
    first, second = rng.sample(pool, 2)
    opener = rng.choice(OPENERS).format(p=product)
    text = f"{opener} it is {first} and {second}."
    if rating == 3:
        text += " Some days I like it, some days I do not."
    elif rng.random() < 0.5:
        text += " I would " + ("recommend it." if rating >= 4 else "not buy it again.")
    return product, text, rating


def question(rng: random.Random) -> str:
    return rng.choice(TASKS).format(t=rng.choice(TOPICS))


def corpus(seed: int = 0, n: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        lines.append(review(rng)[1] if i % 2 else question(rng))
    lines += ["Classify the sentiment of this review as positive, negative or neutral.",
              "You are a helpful assistant.", '{"name": "get_weather", "arguments": {}}',
              "The quick brown fox jumps over the lazy dog. 0123456789 ,.;:!?'\"()[]{}"]
    return lines


# ---------------------------------------------------------------------------------------------
# Chat template: ChatML turns; a system block that lists tools as JSON; assistant tool calls in
# <tool_call> tags; tool results in <tool_response> tags; `enable_thinking=false` closes an
# empty <think> block in the generation prompt so the model answers directly.

CHAT_TEMPLATE = r"""
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable -%}{%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools or has_system -%}
<|im_start|>system
{% if has_system %}{{ text(messages[0].content) }}{% endif %}
{%- if tools %}{% if has_system %}

{% endif %}Tools you can call, one JSON schema per line:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}To call one, answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
{%- endif %}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if not (loop.first and has_system) -%}
{%- if message.role == 'assistant' -%}
<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ text(message.content) }}
{%- for call in message.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
<tool_call>{"name": "{{ fn.name }}", "arguments": {{ fn.arguments | tojson if fn.arguments is mapping else fn.arguments }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>{{ text(message.content) }}</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ text(message.content) }}<|im_end|>
{% endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif -%}
{%- endif -%}
""".strip()
# mlx-lm infers its JSON tool-call parser from "<tool_call>" and "tool_call.name" in a template.
CHAT_TEMPLATE += "{#- tool_call.name: JSON tool calls -#}"


def build_tokenizer(out: Path, vocab_size: int = 2048, seed: int = 0) -> int:
    """Train a byte-level BPE tokenizer and write the Hugging Face files; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    tok.add_tokens(MARKUP_TOKENS)
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tokenizer_config(CHAT_TEMPLATE))
    return tok.get_vocab_size()


def tokenizer_config(chat_template: str) -> dict:
    """tokenizer_config.json of the demo tokenizers (ChatML markers, no BOS)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": CONTEXT_LENGTH,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }


def build(out: str | Path, shape: str = "demo", seed: int = 0, quantize: str = "none") -> Path:
    """Write a complete model folder to `out`; `quantize` as families.QUANTIZATIONS names
    ("4bit": a 4-bit twin of the shape, quantized as mlx-lm's converter does)."""
    spec = SHAPES[shape]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = model_folder(out, spec, seed, shape)
    _write_weights(out / "model.safetensors", config, spec, seed)
    if quantize != "none":
        _quantize_folder(out, config, quantize)
    return out


def _quantize_folder(out: Path, config: dict, quantize: str) -> None:
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    from batchrun.models.families import parse_quantization

    quant = parse_quantization(quantize)
    if quant["recipe"]:
        raise ValueError(f"{quantize}: the Llama shapes take plain 4bit / 8bit / mxfp4")
    model, _ = load_model(out)
    model, config = quantize_model(model, config, quant["group_size"], quant["bits"],
                                   mode=quant["mode"])
    (out / "model.safetensors").unlink()
    save_model(out, model)
    save_config(config, out / "config.json")


def model_folder(out: Path, spec: Shape, seed: int, shape: str,
                 tokenizer_seed: int | None = None) -> dict:
    """The demo tokenizer, config.json and generation_config.json of a model of this shape in
    `out` (weights not included); the config. The tokenizer is drawn from `tokenizer_seed`
    (default `seed`)."""
    n_vocab = build_tokenizer(out, seed=seed if tokenizer_seed is None else tokenizer_seed)
    vocab_size = spec.vocab_size or n_vocab
    ids = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    eos = [t["id"] for t in ids if t["content"] in ("<|im_end|>", "<|endoftext|>")]
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": CONTEXT_LENGTH,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": eos,
        "torch_dtype": spec.dtype,
        "batchrun_shape": shape,
        "batchrun_seed": seed,
    }
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", {"eos_token_id": eos})
    return config


def _write_weights(path: Path, config: dict, spec: Shape, seed: int) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(config))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, param in sorted(tree_flatten(model.parameters())):
        if name.endswith("norm.weight"):
            value = np.ones(param.shape, np.float32)
        elif "embed_tokens" in name:
            value = rng.standard_normal(param.shape, np.float32)
        else:
            # fan-in scaling keeps activations O(1); a larger gain on lm_head gives peaked
            # logits, so greedy decoding has clear winners rather than near-ties.
            gain = 4.0 if name.startswith("lm_head") else 1.0
            std = gain / np.sqrt(param.shape[-1])
            value = rng.standard_normal(param.shape, np.float32) * np.float32(std)
        weights[name] = mx.array(value).astype(getattr(mx, spec.dtype))
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")

