"""The bundled demo vision model is reproducible from its script, loads offline through mlx-vlm,
and its output depends on the image; the sample images are reproducible from theirs."""

import hashlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

from batchrun.models import REPO_ROOT
from tools.demo_models.build_vision import MAX_PIXELS, build_vision

VISION_MODEL = REPO_ROOT / "sample_data" / "demo-vision-model"
IMAGES = REPO_ROOT / "sample_data" / "images"
ONE_IMAGE = [{"role": "user", "content": [{"type": "text", "text": "Describe the picture."},
                                          {"type": "image"}]}]


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def vision():
    """The bundled model through `mlx_vlm.load`, offline, with every hub download recorded."""
    import huggingface_hub
    import mlx_vlm.utils

    calls = []

    def no_hub(*args, **kwargs):
        calls.append((args, kwargs))
        raise OSError("offline test: the hub was asked")

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        mp.setattr(huggingface_hub, "hf_hub_download", no_hub)
        mp.setattr(huggingface_hub, "snapshot_download", no_hub)
        mp.setattr(mlx_vlm.utils, "snapshot_download", no_hub)
        model, processor = mlx_vlm.load(str(VISION_MODEL))
    return model, processor, calls


def generate(vision, messages, images=(), max_tokens=12) -> list[int]:
    from mlx_vlm import generate

    model, processor, _ = vision
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    result = generate(model, processor, prompt, image=[str(IMAGES / n) for n in images] or None,
                      max_tokens=max_tokens, temperature=0.0)
    return list(result.token_ids)


def test_build_script_reproduces_the_bundled_files(tmp_path):
    a = digests(build_vision(tmp_path / "a"))
    b = digests(build_vision(tmp_path / "b"))
    assert a == b
    assert a == digests(VISION_MODEL)
    assert {"preprocessor_config.json", "processor_config.json",
            "video_preprocessor_config.json", "chat_template.jinja"} <= set(a)
    assert digests(build_vision(tmp_path / "c", seed=1)) != a


def test_loads_offline_without_asking_the_hub(vision):
    model, processor, calls = vision
    assert calls == []
    assert type(model).__module__.startswith("mlx_vlm.models.qwen2_vl")
    assert processor.image_processor.max_pixels == MAX_PIXELS


def test_config_agrees_with_the_tokenizer(vision):
    model, processor, _ = vision
    config = json.loads((VISION_MODEL / "config.json").read_text())
    tokenizer = processor.tokenizer
    assert config["model_type"] == "qwen2_vl" and config["torch_dtype"] == "float32"
    assert config["vocab_size"] == len(tokenizer)
    assert not config["tie_word_embeddings"]
    assert isinstance(config["vision_config"]["mlp_ratio"], int)
    for key, token in [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                       ("vision_start_token_id", "<|vision_start|>"),
                       ("vision_end_token_id", "<|vision_end|>")]:
        assert config[key] == tokenizer.convert_tokens_to_ids(token)
    assert model.config.image_token_id == config["image_token_id"]
    assert model.config.vision_start_token_id == config["vision_start_token_id"]
    assert 1e6 < (VISION_MODEL / "model.safetensors").stat().st_size < 10e6


def test_chat_template_renders_content_lists(vision):
    _, processor, _ = vision
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                     {"type": "text", "text": " with "},
                                     {"type": "image_url", "image_url": {"url": "x.png"}}]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": "Why?"},
    ]
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    assert processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\nCompare {image} with {image}<|im_end|>\n"
        "<|im_start|>assistant\nThey differ.<|im_end|>\n"
        "<|im_start|>user\nWhy?<|im_end|>\n"
        "<|im_start|>assistant\n")


@pytest.mark.parametrize(("size", "tokens"), [((112, 112), 16), ((160, 120), 12), ((48, 48), 4),
                                              ((1000, 1000), 16), ((1000, 800), 12)])
def test_images_are_resized_to_at_most_16_tokens(vision, size, tokens):
    from mlx_vlm import prepare_inputs
    from PIL import Image

    _, processor, _ = vision
    prompt = processor.apply_chat_template(ONE_IMAGE, add_generation_prompt=True, tokenize=False)
    inputs = prepare_inputs(processor, images=[Image.new("RGB", size, "red")], prompts=prompt)
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert inputs["input_ids"][0].tolist().count(image_token) == tokens
    t, h, w = inputs["image_grid_thw"][0].tolist()
    assert t == 1 and h * w == 4 * tokens


def test_output_depends_on_the_image_and_is_deterministic(vision):
    # Both stripe images are 120x90: the same prompt tokens, only the pixels differ.
    vertical = generate(vision, ONE_IMAGE, ["vertical_stripes.png"])
    horizontal = generate(vision, ONE_IMAGE, ["horizontal_stripes.png"])
    assert len(vertical) == len(horizontal) == 12
    assert vertical != horizontal
    assert generate(vision, ONE_IMAGE, ["vertical_stripes.png"]) == vertical


def test_two_images_and_text_only_prompts_generate(vision):
    two = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"},
                                        {"type": "text", "text": "with"}, {"type": "image"}]}]
    assert generate(vision, two, ["red_square.png", "house.png"])
    text = generate(vision, [{"role": "user", "content": "Explain recursion."}])
    assert 0 < len(text) <= 12


def load_sample_script():
    path = REPO_ROOT / "scripts" / "make_sample_images.py"
    spec = importlib.util.spec_from_file_location("make_sample_images", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sample_images_are_reproducible_from_the_script():
    script = load_sample_script()
    assert sorted(script.IMAGES) == sorted(p.name for p in IMAGES.iterdir())
    sizes = set()
    for name, draw in script.IMAGES.items():
        buf = io.BytesIO()
        image = draw()
        image.save(buf, format="PNG", optimize=False)
        assert buf.getvalue() == (IMAGES / name).read_bytes(), name
        sizes.add(image.size)
    assert len(sizes) >= 6
    lines = (REPO_ROOT / "sample_data" / "images.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == script.rows()


def test_sample_rows_point_at_the_sample_images():
    rows = [json.loads(line) for line in
            (REPO_ROOT / "sample_data" / "images.jsonl").read_text().splitlines()]
    counts = []
    for row in rows:
        urls = [part["image_url"]["url"] for m in row["messages"]
                if isinstance(m["content"], list) for part in m["content"]
                if part["type"] == "image_url"]
        assert all((REPO_ROOT / "sample_data" / url).is_file() for url in urls), row
        counts.append(len(urls))
    assert counts.count(0) == 2 and counts.count(2) >= 2 and len(rows) >= 10
