"""The SHA-256 of every weight file, remembered between runs so a large model is read once.

Invariant: a weight file's digest comes from reading all of its bytes, now or in an earlier run;
an earlier digest is reused only while the file keeps its identity (device, inode, size, mtime
and ctime in nanoseconds). Any write to a file moves its ctime, which no user can set back, so a
changed file, even one whose mtime was restored, is read again.

The memo (`fingerprints/weights.json` in batchrun's cache folder) is untrusted input: it is used
only if its folder and file are ours, not writable by others, and not links; a memo that is
damaged, unreadable or too large is ignored, and one that cannot be written (a read-only home)
only means the next run reads the weights again. It keeps the newest MEMO_ENTRIES files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("batchrun.models")
READ_BYTES = 8 << 20
MEMO_FORMAT = "batchrun-weight-digests-1"
MEMO_ENTRIES = 512
MEMO_MAX_BYTES = 1 << 20
# File timestamps tick coarsely (a jiffy on many filesystems): a file changed this close to
# being hashed could change again with the same timestamps, so its digest is not reused.
RACY_NS = 50_000_000
HASH_THREADS = 4
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def memo_folder() -> Path:
    """Beside the prefix cache: $BATCHRUN_CACHE_DIR, else $XDG_CACHE_HOME/batchrun, else
    ~/.cache/batchrun."""
    named = os.environ.get("BATCHRUN_CACHE_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if named:
        root = Path(named).expanduser()
    elif os.path.isabs(xdg):  # the XDG spec ignores a relative value
        root = Path(xdg) / "batchrun"
    else:
        root = Path.home() / ".cache" / "batchrun"
    return root / "fingerprints"


def weight_digests(paths: list[Path]) -> dict[Path, str]:
    """The SHA-256 (hex) of each file's full contents, read only where the memo has none."""
    memo = load_memo(memo_folder())
    found, todo = {}, []
    for p in paths:
        digest = _remembered(memo, os.stat(p))
        if digest:
            found[p] = digest
        else:
            todo.append(p)
    if not todo:
        return found
    started = time.time_ns()
    with ThreadPoolExecutor(min(HASH_THREADS, len(todo))) as pool:
        hashed = list(pool.map(hash_file, todo))
    fresh = {}
    for p, (digest, st) in zip(todo, hashed, strict=True):
        found[p] = digest
        if st is not None:
            fresh[_key(st)] = [*_stamp(st), digest, started]
    if fresh:
        store_memo(memo_folder(), fresh)
    return found


def fd_digests(fds: list[int]) -> list[str]:
    """The SHA-256 (hex) of each open regular file's full contents, read (from its start, its
    offset left alone) only where the memo has none: what a caller opened without following
    a link is what is hashed."""
    memo = load_memo(memo_folder())
    found: list[str] = []
    fresh = {}
    for fd in fds:
        digest = _remembered(memo, os.fstat(fd))
        if digest is None:
            started = time.time_ns()
            digest, st = hash_fd(fd)
            if st is not None:
                fresh[_key(st)] = [*_stamp(st), digest, started]
        found.append(digest)
    if fresh:
        store_memo(memo_folder(), fresh)
    return found


def hash_file(path: Path) -> tuple[str, os.stat_result | None]:
    """The SHA-256 (hex) of the file's contents, read in large chunks, and the file's stat
    (None if the file changed while it was read)."""
    h = hashlib.sha256()
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        before = os.fstat(f.fileno())
        while n := f.readinto(buf):
            h.update(view[:n])
        after = os.fstat(f.fileno())
    return h.hexdigest(), _unchanged(before, after)


def hash_fd(fd: int) -> tuple[str, os.stat_result | None]:
    """`hash_file` of an open file, read with pread from its start (its offset left alone)."""
    h = hashlib.sha256()
    before = os.fstat(fd)
    at = 0
    while chunk := os.pread(fd, READ_BYTES, at):
        h.update(chunk)
        at += len(chunk)
    return h.hexdigest(), _unchanged(before, os.fstat(fd))


def _unchanged(before: os.stat_result, after: os.stat_result) -> os.stat_result | None:
    """`after` if the file kept its identity while it was read, else None."""
    same = _key(before) == _key(after) and _stamp(before) == _stamp(after)
    return after if same else None


def _remembered(memo: dict[str, list], st: os.stat_result) -> str | None:
    """The memo's digest of the file with this stat, if it still has its identity."""
    entry = memo.get(_key(st))
    if entry and entry[:3] == _stamp(st) and entry[4] - st.st_ctime_ns > RACY_NS:
        return entry[3]
    return None


def _key(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}"


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


# -- the memo -------------------------------------------------------------------------------------


def load_memo(folder: Path) -> dict[str, list]:
    """Valid entries of the memo in `folder`: key -> [size, mtime_ns, ctime_ns, digest,
    hashed_at_ns]; {} when there is no trustworthy memo."""
    try:
        data = json.loads(_read_private(folder, "weights.json"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != MEMO_FORMAT:
        return {}
    files = data.get("files")
    if not isinstance(files, dict):
        return {}
    return {k: v for k, v in files.items() if _valid_entry(v)}


def store_memo(folder: Path, fresh: dict[str, list]) -> None:
    """Add `fresh` entries to the memo (merged with what another run may have written since),
    keeping the newest MEMO_ENTRIES; a memo that cannot be written is left as it is."""
    try:
        os.makedirs(folder.parent, mode=0o700, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        files = load_memo(folder) | fresh
        newest = sorted(files.items(), key=lambda kv: kv[1][4], reverse=True)[:MEMO_ENTRIES]
        data = json.dumps({"format": MEMO_FORMAT, "files": dict(newest)}).encode()
        if _folder_problem(os.lstat(folder)):
            return
        from batchrun.io.files import write_atomic

        write_atomic(folder / "weights.json", data, mode=0o600)  # ours alone
    except OSError as e:
        log.debug("weight digest memo not written in %s: %s", folder, e)


def _read_private(folder: Path, name: str) -> bytes:
    """The bytes of `folder/name` if both are ours, private and no links; OSError otherwise."""
    dir_fd = os.open(folder, _DIR)
    try:
        if problem := _folder_problem(os.fstat(dir_fd)):
            raise PermissionError(f"{folder} {problem}")
        fd = os.open(name, _READ, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(f"{folder / name} is not a file of ours")
        if st.st_size > MEMO_MAX_BYTES:
            raise PermissionError(f"{folder / name} is larger than a memo can be")
        return f.read(MEMO_MAX_BYTES + 1)


def _folder_problem(st: os.stat_result) -> str | None:
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != os.geteuid():
        return "is owned by another user"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "is writable by other users"
    return None


def _valid_entry(v: object) -> bool:
    return (isinstance(v, list) and len(v) == 5
            and all(type(x) is int and x >= 0 for x in (v[0], v[1], v[2], v[4]))
            and isinstance(v[3], str) and len(v[3]) == 64
            and all(c in "0123456789abcdef" for c in v[3]))
