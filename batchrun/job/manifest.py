"""job.json: what a job is (input, model and option fingerprints), so a re-run can tell whether it
resumes the same job or would mix two different ones into one output."""

from __future__ import annotations

import hashlib
import secrets
import time
from pathlib import Path

import batchrun
from batchrun.job.state import DamagedFile, read_json, write_atomic

CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def input_fingerprint(path: Path) -> dict:
    return {"path": str(Path(path).resolve()), "size": path.stat().st_size,
            "sha256": file_sha256(path)}


def new_manifest(input_fp: dict, model: str, model_path: str, model_fp: str, options: dict,
                 output: Path) -> dict:
    return {
        "batchrun_version": batchrun.__version__,
        "created": int(time.time()),
        "job_id": secrets.token_hex(8),  # the job's own, kept on resume: its records' ids
        "input": input_fp,
        "model": {"name": model, "path": model_path, "fingerprint": model_fp},
        "options": options,
        "output": str(output),
    }


def differences(old: dict, new: dict) -> list[str]:
    """What changed between the job on disk and this command, in words (`new` may leave out
    the model: its fingerprint is known only once it is found)."""
    changed = []
    if old["input"]["sha256"] != new["input"]["sha256"]:
        changed.append(f"the input changed ({old['input']['path']}: "
                       f"{old['input']['size']:,} -> {new['input']['size']:,} bytes)")
    if "model" in new and old["model"]["fingerprint"] != new["model"]["fingerprint"]:
        changed.append(f"the model changed ({old['model']['name']} -> {new['model']['name']})")
    for key in sorted(set(old["options"]) | set(new["options"])):
        a, b = old["options"].get(key), new["options"].get(key)
        if a != b:
            changed.append(f"option {key}: {a!r} -> {b!r}")
    return changed


def well_formed(manifest: dict) -> bool:
    """Whether a job.json has the fields a resume compares."""
    try:
        return (isinstance(manifest["input"]["sha256"], str)
                and isinstance(manifest["model"]["fingerprint"], str)
                and isinstance(manifest["options"], dict)
                and isinstance(manifest["created"], int))
    except (KeyError, TypeError):
        return False


def saved_manifest(job_dir: Path) -> dict | None:
    """The job folder's job.json, or None for a new job; raises DamagedFile (saying what to
    do) if it is damaged."""
    fix = f"move the job folder {job_dir} away to start over, or pass another --job-dir"
    try:
        manifest = load_manifest(job_dir)
    except DamagedFile as e:
        raise DamagedFile(f"{e}: {fix}") from None
    if manifest is not None and not well_formed(manifest):
        raise DamagedFile(f"{Path(job_dir) / 'job.json'} is damaged (fields are missing): {fix}")
    return manifest


def load_manifest(job_dir: Path) -> dict | None:
    """job.json, or None; raises state.DamagedFile if it is not a JSON object."""
    return read_json(Path(job_dir) / "job.json")


def save_manifest(job_dir: Path, manifest: dict) -> None:
    import orjson

    write_atomic(Path(job_dir) / "job.json", orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
