"""A Hugging Face id is fingerprinted by what is loaded: the resolved snapshot's revision and its
weight files' content hashes, so new weights behind the same name are a different model (no
resume of the old job, no KV from the old weights)."""

import hashlib
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import orjson
import pytest

from batchrun.models import DEMO_MODEL, local_path, model_fingerprint
from batchrun.models import fingerprint as weights_memo
from tests.helpers import jsonl, run, write_rows

REPO = "acme/tiny-demo"


def publish(hub: Path, revision: str, bump: float = 0.0) -> None:
    """Lay out a hub cache entry for REPO at `revision` (the demo model, its embedding moved by
    `bump`) as huggingface_hub stores it: content-addressed blobs, linked from the snapshot."""
    repo = hub / f"models--{REPO.replace('/', '--')}"
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for src in DEMO_MODEL.iterdir():
        data = src.read_bytes()
        if src.name == "model.safetensors" and bump:
            weights = mx.load(str(src))
            name = next(k for k in weights if "embed" in k)
            weights[name] = weights[name] + bump
            tmp = hub / "tmp.safetensors"
            mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
            data = tmp.read_bytes()
            tmp.unlink()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / src.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs" / "main").write_text(revision)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A private hub cache, offline (huggingface_hub reads its settings at import: the
    environment is for subprocesses, the constants for this one)."""
    import huggingface_hub.constants as hf

    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)
    publish(hub, "a" * 40)
    return hub


def test_a_hub_id_is_fingerprinted_by_its_snapshot(hub):
    path = local_path(REPO)
    assert Path(path) == hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / ("a" * 40)
    first = model_fingerprint(path)
    publish(hub, "b" * 40, bump=0.25)  # new weights behind the same name
    second_path = local_path(REPO)
    assert second_path != path and model_fingerprint(second_path) != first
    assert model_fingerprint(path) == first  # the same snapshot keeps its fingerprint


def test_new_weights_behind_a_hub_id_are_a_different_model(hub, tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl",
                      [{"custom_id": f"r{i}", "max_tokens": 6,
                        "messages": [{"role": "system", "content": "You label reviews. " * 30},
                                     {"role": "user", "content": f"review {i}"}]}
                       for i in range(6)])
    cache = tmp_path / "cache"
    run(rows, "--model", REPO, "--job-dir", tmp_path / "old", "--cache-dir", cache)
    publish(hub, "b" * 40, bump=0.25)
    refused = run(rows, "--model", REPO, "--job-dir", tmp_path / "old", "--cache-dir", cache,
                  code=2)
    assert "the model changed" in refused.output
    # A fresh job on the new weights never reuses KV computed with the old ones.
    run(rows, "--model", REPO, "--job-dir", tmp_path / "warm", "--cache-dir", cache)
    run(rows, "--model", REPO, "--job-dir", tmp_path / "cold", "--no-prefix-cache")
    warm = [r["text"] for r in jsonl(tmp_path / "warm" / "results.jsonl")]
    cold = [r["text"] for r in jsonl(tmp_path / "cold" / "results.jsonl")]
    assert warm == cold
    assert warm != [r["text"] for r in jsonl(tmp_path / "old" / "results.jsonl")]


def test_the_ray_driver_fingerprints_the_same_snapshot(hub):
    """The driver (which loads no model) and a loading process agree on the fingerprint."""
    code = ("import batchrun, sys; from batchrun.models import load_model; "
            f"sys.stdout.write(load_model({REPO!r}).fingerprint)")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=os.environ.copy(), check=True).stdout
    assert loaded == model_fingerprint(local_path(REPO))
    assert orjson.dumps(loaded)  # a hex digest


def test_a_cached_hub_id_runs_without_a_packet_for_the_hub(hub, tmp_path, monkeypatch):
    """With the network allowed (not HF_HUB_OFFLINE), a model the hub cache holds is read from
    there: no name resolved, so no request (huggingface_hub's download functions, even told
    local_files_only, build request headers that fetch the Hub's agent registry)."""
    import socket

    import huggingface_hub.constants as hf
    from huggingface_hub.utils import _detect_agent

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf, "AGENT_HARNESSES_PATH", str(tmp_path / "no-registry.json"))
    monkeypatch.setattr(_detect_agent, "_registry", None)  # not fetched yet in this process
    resolved = []

    def no_network(host, *args, **kwargs):
        resolved.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    rows = write_rows(tmp_path / "rows.jsonl", [{"custom_id": "r0", "prompt": "hi",
                                                 "max_tokens": 3}])
    run(rows, "--model", REPO, "--job-dir", tmp_path / "job")
    assert jsonl(tmp_path / "job" / "results.jsonl")[0]["custom_id"] == "r0"
    assert resolved == []


# -- every byte of the weights ------------------------------------------------------------------

MB = 1 << 20


def settle() -> None:
    """Let a file just written age past the window in which its digest is not reused."""
    time.sleep(2 * weights_memo.RACY_NS / 1e9)


def negate_tensors(path: Path, names: list[str]) -> None:
    """Flip the sign of float32 tensors `names` in a safetensors file in place (same size)."""
    data = bytearray(path.read_bytes())
    header_len = struct.unpack("<Q", data[:8])[0]
    header = orjson.loads(data[8:8 + header_len])
    for name in names:
        start, end = header[name]["data_offsets"]
        assert header[name]["dtype"] == "F32"
        for i in range(8 + header_len + start + 3, 8 + header_len + end, 4):
            data[i] ^= 0x80  # the sign bit of a little-endian float32
    path.write_bytes(bytes(data))


def weights_folder(path: Path, weights: bytes) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(weights)
    return path


@pytest.fixture
def reads(monkeypatch):
    """The weight files read in full, in order."""
    seen = []
    real = weights_memo.hash_file

    def counting(path):
        seen.append(Path(path))
        return real(path)

    monkeypatch.setattr(weights_memo, "hash_file", counting)
    return seen


def test_weights_that_differ_only_in_the_middle_are_different_models(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(DEMO_MODEL, a)
    shutil.copytree(DEMO_MODEL, b)
    layer0 = ["model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"]
    negate_tensors(b / "model.safetensors", layer0)
    old, new = (a / "model.safetensors").read_bytes(), (b / "model.safetensors").read_bytes()
    changed = [i for i in range(len(old)) if old[i] != new[i]]
    assert len(old) == len(new) > 2 * MB and changed[0] >= MB and changed[-1] < len(old) - MB
    assert model_fingerprint(str(a)) != model_fingerprint(str(b))


def test_an_unchanged_weight_file_is_read_once(tmp_path, reads):
    model = weights_folder(tmp_path / "m", os.urandom(3 * MB))
    settle()
    first = model_fingerprint(str(model))
    assert model_fingerprint(str(model)) == first
    assert reads == [model / "model.safetensors"]
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert model_fingerprint(str(copy)) == first  # another file: read, and the same model
    assert reads[1:] == [copy / "model.safetensors"]


def test_a_rewrite_keeping_size_and_mtime_is_read_again(tmp_path, reads):
    model = weights_folder(tmp_path / "m", os.urandom(3 * MB))
    path = model / "model.safetensors"
    settle()
    seen = {model_fingerprint(str(model))}
    before = os.stat(path)
    with open(path, "r+b") as f:  # in place: the same inode
        f.seek(MB + 12345)
        f.write(b"x" * 64)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == \
        (before.st_ino, before.st_size, before.st_mtime_ns)
    settle()
    seen.add(model_fingerprint(str(model)))
    data = bytearray(path.read_bytes())  # a new file renamed over it, mtime put back
    data[len(data) // 2] ^= 1
    (model / "new").write_bytes(bytes(data))
    os.replace(model / "new", path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    settle()
    seen.add(model_fingerprint(str(model)))
    assert len(seen) == 3 and len(reads) == 3


def test_a_file_changed_just_before_it_was_hashed_is_hashed_again(tmp_path, reads):
    """Timestamps tick coarsely: a digest taken right after a write is checked once more."""
    model = weights_folder(tmp_path / "m", os.urandom(MB))
    first = model_fingerprint(str(model))
    settle()
    assert model_fingerprint(str(model)) == model_fingerprint(str(model)) == first
    assert len(reads) == 2


DAMAGED = {"empty": b"", "torn": b'{"format": "batchrun-weight-di', "zeros": b"\x00" * 100,
           "a list": b"[1, 2]",
           "no files": b'{"format": "batchrun-weight-digests-1", "files": [1]}',
           "bad entry": b'{"format": "batchrun-weight-digests-1", "files": '
                        b'{"1:2": [1, 2, 3, "zz", 4]}}',
           "too large": b" " * (2 * MB)}


@pytest.mark.parametrize("damage", DAMAGED.values(), ids=DAMAGED.keys())
def test_a_damaged_memo_is_ignored(tmp_path, reads, damage):
    a = weights_folder(tmp_path / "a", os.urandom(3 * MB))
    settle()
    expected = model_fingerprint(str(a))
    memo = weights_memo.memo_folder() / "weights.json"
    memo.write_bytes(damage)
    assert model_fingerprint(str(a)) == expected
    assert len(reads) == 2  # read again, and remembered again
    assert orjson.loads(memo.read_bytes())["format"] == weights_memo.MEMO_FORMAT
    assert model_fingerprint(str(a)) == expected and len(reads) == 2


def forge(folder: Path, path: Path, digest: str) -> None:
    """A memo entry claiming `path` holds bytes with SHA-256 `digest`."""
    st = os.stat(path)
    entry = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest, time.time_ns()]
    weights_memo.store_memo(folder, {f"{st.st_dev}:{st.st_ino}": entry})


@pytest.mark.parametrize("how", ["owner", "link", "shared folder"])
def test_a_memo_that_is_not_private_is_not_trusted(tmp_path, how):
    weights = os.urandom(3 * MB)
    a = weights_folder(tmp_path / "a", weights)
    b = weights_folder(tmp_path / "b", weights[:MB] + os.urandom(MB) + weights[-MB:])
    settle()
    folder = weights_memo.memo_folder()
    forge(folder, b / "model.safetensors", hashlib.sha256(weights).hexdigest())
    memo = folder / "weights.json"
    assert model_fingerprint(str(b)) == model_fingerprint(str(a))  # ours: trusted
    forge(folder, b / "model.safetensors", hashlib.sha256(weights).hexdigest())
    if how == "owner":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(memo, 12345, 12345)
    elif how == "link":
        memo.rename(folder / "elsewhere.json")
        memo.symlink_to(folder / "elsewhere.json")
    else:
        folder.chmod(0o777)
    assert model_fingerprint(str(b)) != model_fingerprint(str(a))


def test_an_unwritable_cache_folder_still_fingerprints_every_byte(tmp_path, monkeypatch, reads):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("BATCHRUN_CACHE_DIR", str(tmp_path / "file" / "cache"))
    weights = os.urandom(3 * MB)
    a = weights_folder(tmp_path / "a", weights)
    b = weights_folder(tmp_path / "b", weights[:MB] + os.urandom(MB) + weights[-MB:])
    settle()
    assert model_fingerprint(str(a)) == model_fingerprint(str(a)) != model_fingerprint(str(b))
    assert len(reads) == 3  # no memo: read every time


def test_the_memo_keeps_only_the_newest_entries(tmp_path):
    folder = tmp_path / "memo"
    n = weights_memo.MEMO_ENTRIES
    for start in (0, n):
        weights_memo.store_memo(folder, {f"1:{i}": [1, 2, 3, "a" * 64, i] for i in
                                         range(start, start + n)})
    kept = weights_memo.load_memo(folder)
    assert sorted(int(k.split(":")[1]) for k in kept) == list(range(n, 2 * n))
    assert (folder / "weights.json").stat().st_size < weights_memo.MEMO_MAX_BYTES
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (folder / "weights.json").stat().st_mode & 0o777 == 0o600


def test_the_memo_lives_beside_the_prefix_cache(tmp_path, monkeypatch):
    assert weights_memo.memo_folder() == tmp_path / "cache" / "fingerprints"  # conftest's
    monkeypatch.delenv("BATCHRUN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert weights_memo.memo_folder() == tmp_path / "xdg" / "batchrun" / "fingerprints"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert weights_memo.memo_folder() == tmp_path / "home" / ".cache" / "batchrun" / "fingerprints"
