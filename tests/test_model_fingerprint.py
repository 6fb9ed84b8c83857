"""A Hugging Face id is fingerprinted by what is loaded: the resolved snapshot's revision and its
weight files' content hashes, so new weights behind the same name are a different model (no
resume of the old job, no KV from the old weights)."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import orjson
import pytest

from batchrun.models import DEMO_MODEL, local_path, model_fingerprint
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
