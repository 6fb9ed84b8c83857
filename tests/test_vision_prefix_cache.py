"""The prefix cache on image rows: blocks are keyed on the pictures' content as well as the
tokens, so a shared system prompt is served to every row, a shared picture (and the text after
it) only to rows with the same picture, and outputs never change."""

import logging
import os
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import jsonl, run, write_rows
from PIL import Image

from batchrun.cache.prefix import block_keys
from batchrun.engine.backends.vision import image_starts
from batchrun.engine.config import EngineConfig
from batchrun.engine.types import SamplingParams
from batchrun.engine.vision_engine import VisionEngine
from batchrun.io.media import ImageCache, image_parts

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_data"
MODEL = SAMPLE / "demo-vision-model"
IMAGES = sorted((SAMPLE / "images").glob("*.png"))
SYSTEM = {"role": "system", "content": "You label product photos for a catalogue. " + " ".join(
    f"Rule {i}: name the colour and the shape of item {i} precisely." for i in range(12))}
QUESTION = "Now answer in one word. " + " ".join(
    f"Check {i}: is the object in the picture of kind {i}?" for i in range(14))


@pytest.fixture(scope="module")
def vlm():
    return VisionEngine.load(str(MODEL))


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> tuple[Path, Path]:
    """Two pictures of the same size (the same prompt tokens), different content."""
    folder = tmp_path_factory.mktemp("twins")
    paths = []
    for name, color in (("red", (220, 30, 30)), ("blue", (30, 30, 220))):
        picture = Image.new("RGB", (96, 96), (250, 250, 250))
        picture.paste(color, (16, 16, 80, 80))
        picture.save(folder / f"{name}.png")
        paths.append(folder / f"{name}.png")
    return paths[0], paths[1]


def chat(*parts) -> list[dict]:
    """The system prompt, then a user turn: str parts are text, Paths are images."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else
               {"type": "image_url", "image_url": {"url": str(p)}} for p in parts]
    return [SYSTEM, {"role": "user", "content": content}]


def generate(vlm, chats, cache: bool, concurrency: int = 16, cache_dir=None):
    """(outputs in order, the engine) for the chats, greedy, 8 tokens."""
    config = EngineConfig(max_concurrency=concurrency, prefix_cache=cache,
                          cache_dir=str(cache_dir) if cache_dir else None)
    engine = VisionEngine(vlm.model, vlm.processor, config, vlm.context_length,
                          model_fingerprint=vlm.model_fingerprint)
    engine.enable_prefix_cache()
    images = ImageCache()
    ids = [engine.add_vision(inputs(vlm, c, images), SamplingParams(max_tokens=8, logprobs=True))
           for c in chats]
    outs = {o.request_id: o for o in engine.run()}
    assert all(outs[i].error is None for i in ids)
    return [outs[i] for i in ids], engine


def inputs(vlm, messages, images=None):
    """The processor's inputs for a chat (its pictures are absolute paths)."""
    images = images or ImageCache()
    return vlm.prompts.prepare(messages, [images.load(ref, Path(ref).parent, where)
                                          for where, ref in image_parts(messages)])


def same_logprobs(outs, others) -> bool:
    """The same tokens with the same log-probabilities (to float rounding)."""
    return all(a.token_ids == b.token_ids and
               all(abs(x - y) < 1e-4 for x, y in zip(a.logprobs, b.logprobs, strict=True))
               for a, b in zip(outs, others, strict=True))


def first_image(vlm, messages) -> int:
    return inputs(vlm, messages).media[0][0]


@pytest.mark.parametrize("concurrency", [16, 3])
def test_a_shared_system_prompt_is_served_from_the_cache_with_identical_outputs(vlm,
                                                                               concurrency):
    chats = [chat("Describe the picture.", IMAGES[i]) for i in range(6)] + [
        chat(IMAGES[6], IMAGES[7], "Compare them."), chat("A row with no picture.")]
    alone = [{"role": "user", "content": [{"type": "text", "text": "No system prompt."},
                                          {"type": "image_url",
                                           "image_url": {"url": str(IMAGES[1])}}]}]
    everything = chats[:3] + [alone] + chats[3:]  # a cold row prefills beside warm ones
    cold, _ = generate(vlm, everything, cache=False, concurrency=concurrency)
    warm, engine = generate(vlm, everything, cache=True, concurrency=concurrency)
    assert same_logprobs(warm, cold)
    common = len(os.path.commonprefix([inputs(vlm, c).input_ids for c in chats]))
    system_blocks = common // 64 * 64
    assert system_blocks >= 256
    assert warm[3].cached_tokens == 0
    assert all(o.cached_tokens >= system_blocks for o in warm[:3] + warm[4:])  # the first too
    assert engine.get_cache_stats()["hits"] == len(chats)


def test_a_picture_and_the_text_after_it_are_shared_only_by_rows_with_that_picture(vlm, twins):
    red, blue = twins
    chats = [chat(red, QUESTION), chat(blue, QUESTION), chat(red, QUESTION),
             chat(blue, QUESTION + " Last.")]
    start = first_image(vlm, chats[0])
    assert start == first_image(vlm, chats[1])  # the same tokens up to here and past it
    cold, _ = generate(vlm, chats, cache=False)
    warm, _ = generate(vlm, chats, cache=True)
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert same_logprobs(warm, cold)
    assert cold[0].prompt_tokens == cold[1].prompt_tokens
    assert not same_logprobs(cold[:1], cold[1:2])  # the pictures matter to the answer
    # Each picture's pair shares its picture and the question after it, never the other's.
    for o in warm:
        assert o.cached_tokens > start + 64
    # Rows alone in the cache: nothing of another picture is ever served.
    solo, _ = generate(vlm, [chats[0], chats[1]], cache=True)
    assert all(o.cached_tokens <= start for o in solo)
    assert same_logprobs(solo, cold[:2])


def test_image_blocks_are_reused_from_disk_by_a_later_engine(vlm, twins, tmp_path):
    red, blue = twins
    chats = [chat(red, QUESTION), chat(red, QUESTION + " Again."), chat(blue, QUESTION)]
    cold, _ = generate(vlm, chats, cache=False)
    (tmp_path / "cache").mkdir(mode=0o700)
    generate(vlm, chats, cache=True, cache_dir=tmp_path / "cache")
    later, engine = generate(vlm, chats, cache=True, cache_dir=tmp_path / "cache")
    assert [o.token_ids for o in later] == [o.token_ids for o in cold]
    assert same_logprobs(later, cold)
    assert engine.get_cache_stats()["disk_loaded_blocks"] > 0
    start = first_image(vlm, chats[0])
    assert later[0].cached_tokens > start and later[1].cached_tokens > start
    assert later[2].cached_tokens <= start  # the blue row found no block with its picture


def test_a_model_whose_inputs_cannot_be_cut_runs_its_rows_cold(vlm, monkeypatch, caplog):
    backend_type = type(vlm.backend)
    embed = backend_type._embed
    monkeypatch.setattr(backend_type, "_embed",
                        lambda self, inputs: {**embed(self, inputs), "per_image_thing": 1})
    chats = [chat("Describe the picture.", IMAGES[i]) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="batchrun"):
        outs, engine = generate(vlm, chats, cache=True)
    monkeypatch.undo()
    cold, _ = generate(vlm, chats, cache=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold]
    assert all(o.cached_tokens == 0 for o in outs)
    warnings = [r for r in caplog.records if "cannot be cut" in r.getMessage()]
    assert len(warnings) == 1 and "per_image_thing" in warnings[0].getMessage()


def test_block_keys_differ_from_the_block_where_a_different_picture_starts():
    tokens = list(range(300))
    plain = block_keys(tokens, 64, b"root")
    red = block_keys(tokens, 64, b"root", ((150, "aa"),))
    blue = block_keys(tokens, 64, b"root", ((150, "bb"),))
    assert red[:2] == blue[:2] == plain[:2]  # blocks before the picture: text only
    assert all(r != b and r != p for r, b, p in zip(red[2:], blue[2:], plain[2:], strict=False))
    assert block_keys(tokens, 64, b"root", ((150, "aa"),)) == red


def test_images_are_matched_to_their_placeholder_runs():
    ids = [1, 9, 9, 2, 3, 9, 9, 9, 4]
    assert image_starts(ids, 9, ("a", "b")) == ((1, "a"), (5, "b"))
    # Runs that do not pair with the pictures: every picture counts from the first one.
    assert image_starts(ids, 9, ("a", "b", "c")) == ((1, "a"), (1, "b"), (1, "c"))
    assert image_starts(ids, 7, ("a",)) == ((0, "a"),)
    assert image_starts(ids, 9, ()) == ()


def test_a_job_of_image_rows_reuses_its_cache_on_a_second_run(tmp_path):
    rows = [{"custom_id": f"r{i}", "messages": chat("Describe the picture.", image),
             "max_tokens": 6} for i, image in enumerate(IMAGES[:4])]
    data = write_rows(tmp_path / "rows.jsonl", rows)
    cache = tmp_path / "cache"
    images = ("--media-root", SAMPLE / "images")  # the pictures lie outside the rows' folder
    run(data, "--model", MODEL, "--job-dir", tmp_path / "one", "--cache-dir", cache, *images)
    run(data, "--model", MODEL, "--job-dir", tmp_path / "two", "--cache-dir", cache, *images)
    run(data, "--model", MODEL, "--job-dir", tmp_path / "off", "--no-prefix-cache", *images)
    texts = [[r["text"] for r in jsonl(tmp_path / job / "results.jsonl")]
             for job in ("one", "two", "off")]
    assert len(texts[0]) == 4 and texts[0] == texts[1] == texts[2]
    second = [r["usage"] for r in jsonl(tmp_path / "two" / "results.jsonl")]
    assert all(u["cached_tokens"] >= 128 for u in second)


def test_an_aborted_waiting_row_leaves_nothing_behind(vlm, twins):
    """A row whose shared prefix was computed, then aborted while it waits for room."""
    red, blue = twins
    images = ImageCache()
    first = inputs(vlm, [{"role": "user", "content": QUESTION + QUESTION}], images)
    engine = VisionEngine(vlm.model, vlm.processor,
                          EngineConfig(prefill_tokens=len(first.input_ids) + 10),
                          vlm.context_length, model_fingerprint=vlm.model_fingerprint)
    engine.enable_prefix_cache()
    engine.add_vision(first, SamplingParams(max_tokens=4))
    waiting = [engine.add_vision(inputs(vlm, chat(red, QUESTION + f" {i}"), images),
                                 SamplingParams(max_tokens=4)) for i in range(3)]
    engine.step()
    for request in waiting:
        engine.abort(request)
    engine.run()
    assert not engine.has_work()
    assert engine.backend._kwargs == {} and engine.backend._gen.warm == {}


def test_image_inputs_without_placement_never_share_a_picture():
    from batchrun.engine.backends.vision import VisionInputs

    pixels = mx.zeros((1,))
    two = VisionInputs([1, 9, 9, 2], pixels, digests=("a", "b"))
    assert two.media == ((0, "a"), (0, "b"))  # every block depends on both pictures
    unnamed = [VisionInputs([1, 9, 9, 2], pixels) for _ in range(2)]
    assert unnamed[0].media and unnamed[0].media != unnamed[1].media
    assert VisionInputs([1, 2]).media == ()  # text only: the tokens say everything


def test_the_fingerprint_of_a_vision_model_covers_its_image_preprocessing(tmp_path):
    import json
    import shutil

    from batchrun.models import model_fingerprint

    copy = tmp_path / "model"
    shutil.copytree(MODEL, copy)
    before = model_fingerprint(str(copy))
    config = json.loads((copy / "preprocessor_config.json").read_text())
    config["image_mean"] = [0.5, 0.5, 0.5]
    (copy / "preprocessor_config.json").write_text(json.dumps(config))
    assert model_fingerprint(str(copy)) != before
