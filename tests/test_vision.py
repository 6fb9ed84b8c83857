"""Image rows on the bundled tiny vision model (Qwen2-VL-shaped, random weights): one continuous
batch for text, one-image and multi-image rows, per-row errors for bad media, and no confusion
between images behind the same text."""

import base64
import shutil
from pathlib import Path

import mlx_vlm
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import jsonl, run, write_rows
from PIL import Image

from batchrun.cli import cli
from batchrun.engine.config import EngineConfig
from batchrun.engine.types import SamplingParams
from batchrun.engine.vision_engine import VisionEngine
from batchrun.io.media import ImageCache, image_parts

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_data"
MODEL = SAMPLE / "demo-vision-model"
IMAGES = sorted((SAMPLE / "images").glob("*.png"))


@pytest.fixture(scope="module")
def vlm():
    return VisionEngine.load(str(MODEL))


def image(url) -> dict:
    return {"type": "image_url", "image_url": {"url": str(url)}}


def user(*parts) -> list[dict]:
    """A user message: str parts are text, Path parts and image() dicts are images."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else
               p if isinstance(p, dict) else image(p) for p in parts]
    return [{"role": "user", "content": content}]


def engine(vlm, concurrency: int) -> VisionEngine:
    return VisionEngine(vlm.model, vlm.processor, EngineConfig(max_concurrency=concurrency),
                        vlm.context_length)


def add(eng: VisionEngine, messages, params: SamplingParams) -> int:
    cache = ImageCache()
    images = [cache.load(ref, SAMPLE, where) for where, ref in image_parts(messages)]
    return eng.add_vision(eng.prompts.prepare(messages, images), params)


def reference(vlm, messages, max_tokens: int) -> list[int]:
    """mlx-vlm's own single-request greedy generation, stopped at EOS like batchrun."""
    images = [str(ref) for _, ref in image_parts(messages)]
    out = mlx_vlm.generate(vlm.model, vlm.processor, vlm.prompts.render(messages),
                           image=images or None, max_tokens=max_tokens, temperature=0.0,
                           verbose=False)
    tokens = list(out.token_ids)
    return tokens[: next((i for i, t in enumerate(tokens) if t in (0, 2)), len(tokens))]


CHATS = [
    user("Describe the picture.", IMAGES[0]),
    user("What is here?", IMAGES[1]),
    user("Compare", IMAGES[2], "with", IMAGES[3]),  # two images of different sizes
    [{"role": "user", "content": "A text-only row in the same batch."}],
    user("Describe the picture.", IMAGES[4]),
    user(IMAGES[5], IMAGES[6], IMAGES[7], "Three pictures."),
    user("Short text only"),
]


@pytest.mark.parametrize("concurrency", [1, 3, 16])
def test_batched_rows_equal_mlx_vlm_generate_alone(vlm, concurrency):
    eng = engine(vlm, concurrency)  # at 3, rows join the batch as others finish
    ids = [add(eng, chat, SamplingParams(max_tokens=12)) for chat in CHATS]
    outs = {o.request_id: o for o in eng.run()}
    for chat, rid in zip(CHATS, ids, strict=True):
        assert outs[rid].error is None
        assert outs[rid].token_ids == reference(vlm, chat, 12), chat
    if concurrency == 16:
        assert eng.stats.mean_batch_size > 3  # text and image rows decoded together


def test_different_images_behind_the_same_text_give_different_answers(vlm):
    eng = engine(vlm, 16)
    ids = {img: add(eng, user("Describe the picture.", img), SamplingParams(max_tokens=10))
           for img in IMAGES}
    outs = {o.request_id: o.token_ids for o in eng.run()}
    answers = [tuple(outs[ids[img]]) for img in IMAGES]
    assert len(set(answers)) >= len(IMAGES) - 1


def test_seeded_sampling_of_an_image_row_does_not_depend_on_the_batch(vlm):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    alone = engine(vlm, 1)
    rid = add(alone, CHATS[0], params)
    (solo,) = alone.run()
    crowded = engine(vlm, 16)
    for chat in CHATS[1:]:
        add(crowded, chat, SamplingParams(max_tokens=9, temperature=0.8, seed=3))
    target = add(crowded, CHATS[0], params)
    out = {o.request_id: o for o in crowded.run()}[target]
    assert rid == 0 and out.token_ids == solo.token_ids
    other = engine(vlm, 1)
    add(other, CHATS[0], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=8))
    assert other.run()[0].token_ids != solo.token_ids


def test_a_repeated_image_is_encoded_once(vlm):
    eng = engine(vlm, 16)
    for i in range(4):
        add(eng, user(f"Question {i}", IMAGES[0]), SamplingParams(max_tokens=3))
    add(eng, user("And", IMAGES[1]), SamplingParams(max_tokens=3))
    eng.run()
    assert (eng.backend.feature_misses, eng.backend.feature_hits) == (2, 3)








def test_same_text_different_images_are_never_confused(tmp_path):
    """Identical prompt tokens (an image is a run of placeholder tokens) but different pictures:
    each row gets its own answer; the same picture (as a file or a data URI) the same answer."""
    for name, color in (("a", (220, 30, 30)), ("b", (30, 30, 220))):  # same size: same tokens
        picture = Image.new("RGB", (96, 96), (250, 250, 250))
        picture.paste(color, (16, 16, 80, 80))
        picture.save(tmp_path / f"{name}.png")
    data_uri = "data:image/png;base64," + base64.b64encode(
        (tmp_path / "a.png").read_bytes()).decode()
    rows = [{"custom_id": name, "messages": user("Describe the picture.", image(url)),
             "max_tokens": 10} for name, url in
            [("a", "a.png"), ("b", "b.png"), ("a-again", data_uri), ("b-again", "b.png")]]
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--model", MODEL, "--job-dir", job)
    results = {r["custom_id"]: r for r in jsonl(job / "results.jsonl")}
    assert results["a"]["usage"]["prompt_tokens"] == results["b"]["usage"]["prompt_tokens"]
    out = {name: r["text"] for name, r in results.items()}
    assert out["a"] != out["b"]
    assert out["a"] == out["a-again"] and out["b"] == out["b-again"]


def test_bad_media_is_a_row_error_and_the_job_goes_on(tmp_path, monkeypatch):
    import batchrun.engine.backends.vision as vision

    monkeypatch.setattr(vision, "MAX_IMAGES_PER_ROW", 3)
    good = tmp_path / "good.png"
    Image.new("RGB", (40, 40), (200, 10, 10)).save(good)
    (tmp_path / "truncated.png").write_bytes(good.read_bytes()[:60])
    (tmp_path / "notes.png").write_text("not a picture")
    cases = {
        "missing": "nowhere/missing.png",
        "unreachable": "https://example.invalid/cat.png",
        "private-url": "http://10.255.255.1/cat.png",
        "outside": "/etc/passwd",
        "corrupt": "truncated.png",
        "unsupported": "notes.png",
        "bad-data-uri": "data:image/png;base64,@@@",
    }
    rows = [{"custom_id": name, "messages": user("Look", image(url))}
            for name, url in cases.items()]
    rows.append({"custom_id": "too-many", "messages": user(*[image("good.png")] * 4)})
    rows.append({"custom_id": "ok", "messages": user("Look", image("good.png")),
                 "max_tokens": 4})
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--model", MODEL, "--job-dir", job)
    errors = {e["custom_id"]: e["error"] for e in jsonl(job / "errors.jsonl")}
    assert [r["custom_id"] for r in jsonl(job / "results.jsonl")] == ["ok"]
    assert {k: v["code"] for k, v in errors.items()} == {
        "missing": "image_not_found", "unreachable": "image_unreachable",
        "private-url": "image_url_not_allowed", "outside": "image_path_not_allowed",
        "corrupt": "corrupt_image", "unsupported": "unsupported_image",
        "bad-data-uri": "invalid_image_url", "too-many": "too_many_images"}
    assert errors["missing"]["message"].startswith("messages[0].content[1].image_url")


def test_image_rows_on_a_text_model_are_row_errors(tmp_path):
    rows = [{"custom_id": "img", "messages": user("Look", IMAGES[0])},
            {"custom_id": "txt", "prompt": "plain", "max_tokens": 3}]
    job = tmp_path / "job"
    run(write_rows(tmp_path / "rows.jsonl", rows), "--job-dir", job)
    (error,) = jsonl(job / "errors.jsonl")
    assert error["custom_id"] == "img" and error["error"]["code"] == "vision_model_required"
    assert [r["custom_id"] for r in jsonl(job / "results.jsonl")] == ["txt"]


def test_parquet_image_column_with_bytes_and_paths(tmp_path):
    """An image column as HF datasets writes it: {bytes, path} structs (or null: a text row)."""
    shutil.copy(IMAGES[2], tmp_path / "pic.png")
    images = [{"bytes": IMAGES[1].read_bytes(), "path": None},
              {"bytes": None, "path": "pic.png"}, None]
    table = pa.table({"id": ["bytes", "path", "none"], "image": images,
                      "question": ["What is it?"] * 3})
    pq.write_table(table, tmp_path / "rows.parquet")
    job = tmp_path / "job"
    run(tmp_path / "rows.parquet", "--model", MODEL, "--job-dir", job, "--id-column", "id",
        "--image-column", "image", "--prompt-template", "{question}", "--max-tokens", "5",
        "-o", tmp_path / "out.parquet")
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["id"] for r in out] == ["bytes", "path", "none"]
    assert all(r["error"] is None for r in out)
    assert out[0]["prompt_tokens"] > out[2]["prompt_tokens"]  # image tokens count
    assert out[1]["prompt_tokens"] > out[2]["prompt_tokens"]


def test_job_file_describes_the_sample_images(tmp_path):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    shutil.copy(ROOT / "jobs" / "label_images.toml", jobs)
    shutil.copytree(SAMPLE / "images", tmp_path / "sample_data" / "images")
    shutil.copy(SAMPLE / "images.jsonl", tmp_path / "sample_data")
    shutil.copytree(MODEL, tmp_path / "sample_data" / "demo-vision-model")
    result = CliRunner().invoke(cli, ["run", str(jobs / "label_images.toml"), "--quiet"])
    assert result.exit_code == 0, result.output
    results = jsonl(jobs / "label_images" / "results.jsonl")
    source = jsonl(SAMPLE / "images.jsonl")
    assert [r["custom_id"] for r in results] == [r["custom_id"] for r in source]
    assert all(r["usage"]["completion_tokens"] > 0 for r in results)


def test_stop_strings_and_constraints_on_image_rows(vlm):
    from batchrun.engine.types import Constraint

    free = engine(vlm, 1)
    add(free, CHATS[0], SamplingParams(max_tokens=12))
    (full,) = free.run()
    stop = full.text[3:6]  # a string the row writes: it must end there
    eng = engine(vlm, 8)
    rid = add(eng, CHATS[0], SamplingParams(max_tokens=12, stop=(stop,)))
    regex = add(eng, CHATS[1], SamplingParams(
        max_tokens=20, constraint=Constraint.regex(r"[a-z]{2,6}-[0-9]{2}")))
    outs = {o.request_id: o for o in eng.run()}
    assert outs[rid].text == full.text[: full.text.index(stop)]
    assert outs[rid].finish_reason.value == "stop"
    import re

    assert re.fullmatch(r"[a-z]{2,6}-[0-9]{2}", outs[regex].text)
    assert outs[regex].constraint_complete


def test_image_rows_choice_probs_come_from_their_own_image(vlm):
    from batchrun.engine.types import Constraint

    params = SamplingParams(max_tokens=4, constraint=Constraint.choices(["red", "blue", "dark"]))
    eng = engine(vlm, 4)
    ids = [add(eng, user("What colour is it?", path), params) for path in IMAGES[:2]]
    ids.append(add(eng, user("What colour is it?", IMAGES[0]), params))
    outs = {o.request_id: o for o in eng.run()}
    a, b, again = (outs[i].choice_logprobs for i in ids)
    assert a is not None and set(a) == {"red", "blue", "dark"}
    assert any(abs(a[c] - b[c]) > 1e-4 for c in a)  # another image, other probabilities
    assert all(abs(a[c] - again[c]) < 1e-4 for c in a)  # the same image, the same ones


def test_a_vision_model_without_mlx_vlm_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "mlx_vlm", None)  # import mlx_vlm fails
    rows = write_rows(tmp_path / "rows.jsonl", [{"prompt": "hi", "max_tokens": 2}])
    result = CliRunner().invoke(cli, ["run", str(rows), "--model", str(MODEL), "--job-dir",
                                      str(tmp_path / "job"), "--quiet"])
    assert result.exit_code == 1
    assert "pip install -e '.[vision]'" in result.output  # as the README says
    assert "--model" not in result.output  # no unrelated hint


def test_a_vision_models_text_rows_take_an_answer_prefix(tmp_path):
    """--answer-prefix on a vision-language model: its text rows' answers begin with it; a row
    with an image is that row's error (not yet supported there), the job goes on."""
    shutil.copy(IMAGES[0], tmp_path / "pic.png")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"custom_id": "text", "question": "What is red?"}\n'
                    '{"custom_id": "image", "question": "What is it?", "image": "pic.png"}\n')
    job = tmp_path / "job"
    run(rows, "--model", MODEL, "--job-dir", job, "--prompt-template", "{question}",
        "--image-column", "image", "--answer-prefix", "Answer:", "--max-tokens", "3")
    (result,) = jsonl(job / "results.jsonl")
    assert result["custom_id"] == "text"
    (error,) = jsonl(job / "errors.jsonl")
    assert error["custom_id"] == "image" and error["error"]["code"] == "unsupported_field"
    plain = tmp_path / "plain"
    run(rows, "--model", MODEL, "--job-dir", plain, "--prompt-template", "{question}",
        "--image-column", "image", "--max-tokens", "3")
    without = next(r for r in jsonl(plain / "results.jsonl") if r["custom_id"] == "text")
    assert result["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"]
