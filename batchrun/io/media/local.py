"""Local paths and the walk that follows no link. A local path (or file:// URL) is read only if it
lies under an allowed root (`..` taken by its words, never climbing above the root), is opened
from that root one name at a time without following any symbolic link, and is a regular file
within the byte limit; a FIFO or a device is refused without being opened. No message quotes a
file's content, and a path outside the roots gets one message whether or not it exists.
"""

from __future__ import annotations

import contextlib
import os
import stat
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

from batchrun.io.media.errors import MediaError, _too_large, read_bounded
from batchrun.io.media.policy import MediaPolicy


class _LocalPath(NamedTuple):
    root: str  # an allowed root, its own links resolved once
    parts: tuple[str, ...]  # the names below it: no "", "." or ".."

    @property
    def path(self) -> Path:
        return Path(self.root, *self.parts)


def _allowed_path(path: str, base_dir: Path, policy: MediaPolicy) -> _LocalPath:
    """The allowed root that `path` lies under by its words alone (`..` removed lexically, no
    link below a root resolved), and the names below it; the deepest root wins, so a root that
    is a link inside another is walked from its target. Else one message whatever the path is:
    it must not tell whether the file exists."""
    if "\0" in path:
        raise MediaError("invalid_image_url", "the image path holds a NUL character")
    try:
        target = Path(os.path.normpath(os.path.join(os.path.abspath(base_dir), path)))
        found = max(_roots_holding(target, (base_dir, *policy.roots)), default=None,
                    key=lambda match: len(match[0].parts))
    except OSError as e:  # the current folder is gone, or a root moved while it resolved
        raise MediaError("image_not_found", f"cannot read {path}: {e.strerror or e}") from None
    if found is not None:
        form, real = found
        return _LocalPath(real, target.relative_to(form).parts)
    raise MediaError("image_path_not_allowed", "the image path lies outside the folders images "
                     "may be read from (the input file's folder and each --media-root); pass "
                     "--media-root DIR to allow the folder that holds it")


def _roots_holding(target: Path, roots: tuple[Path, ...]) -> Iterator[tuple[Path, str]]:
    """(the root as written or resolved, its resolved path) for each root that holds `target`.
    A root's own links are the user's, so it may be named either way."""
    for root in roots:
        real = os.path.realpath(root)
        for form in (Path(os.path.normpath(os.path.abspath(root))), Path(real)):
            if target.is_relative_to(form):
                yield form, real


def _file_url_path(url: str) -> Path:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError("invalid_image_url", f"{url!r} names host {parts.netloc!r}; a file URL "
                         "needs an absolute path: file:///abs/path.png")
    return Path(urllib.request.url2pathname(parts.path))


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))
_DIR_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECTORY
# Never blocking: a FIFO swapped in after the check opens at once, and fstat refuses it.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _check_regular(st: os.stat_result, path: Path, max_bytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        raise MediaError("image_not_found", f"{path} is {kind}, not an image file; only "
                         "regular files are read")
    if st.st_size > max_bytes:
        raise _too_large(st.st_size, max_bytes)


def _stat_local(local: _LocalPath, max_bytes: int) -> os.stat_result:
    """The stat of an allowed file; one that is no regular file is refused without opening it
    (opening a FIFO or a device could block or act)."""
    with _file_errors(local):
        parent = _open_parent(local)
        try:
            return _stat_in(parent, local, max_bytes)
        finally:
            os.close(parent)


def _read_local(local: _LocalPath, max_bytes: int) -> bytes:
    with _file_errors(local):
        parent = _open_parent(local)
        try:
            _stat_in(parent, local, max_bytes)
            fd = _open_in(parent, local, len(local.parts) - 1, _FILE_FLAGS)
        finally:
            os.close(parent)
        try:
            _check_regular(os.fstat(fd), local.path, max_bytes)
            return _read_fd(fd, max_bytes)
        finally:
            os.close(fd)


def _open_parent(local: _LocalPath) -> int:
    """The folder that holds the file, opened from the root one name at a time, each relative
    to the last and none through a link: a folder swapped for a link is refused, not followed,
    and one swapped after it was opened no longer matters (its descriptor is held)."""
    fd = os.open(local.root, _DIR_FLAGS)
    try:
        for i in range(len(local.parts) - 1):
            child = _open_in(fd, local, i, _DIR_FLAGS)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_in(parent: int, local: _LocalPath, i: int, flags: int) -> int:
    """Open the path's name `i` in `parent`; a link there is refused, in words that say so."""
    try:
        return os.open(local.parts[i], flags, dir_fd=parent)
    except OSError:  # O_NOFOLLOW on a link: ELOOP, or ENOTDIR or EMLINK on some systems
        if _is_link(parent, local.parts[i]):
            raise _through_link(local, i) from None
        raise


def _stat_in(parent: int, local: _LocalPath, max_bytes: int) -> os.stat_result:
    if not local.parts:  # the root itself, a folder
        st = os.fstat(parent)
    else:
        st = os.stat(local.parts[-1], dir_fd=parent, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise _through_link(local, len(local.parts) - 1)
    _check_regular(st, local.path, max_bytes)
    return st


def _is_link(parent: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _through_link(local: _LocalPath, i: int) -> MediaError:
    link = Path(local.root, *local.parts[:i + 1])
    return MediaError("image_path_not_allowed", f"the image path goes through a symbolic link "
                      f"({link}), and links below the folders images may be read from are not "
                      "followed (one could be swapped to lead elsewhere); give the file's real "
                      "path, or pass the link itself as --media-root DIR")


@contextlib.contextmanager
def _file_errors(local: _LocalPath) -> Iterator[None]:
    """Any OSError while finding or reading a local file is the row's image_not_found."""
    try:
        yield
    except (FileNotFoundError, NotADirectoryError):
        raise MediaError("image_not_found", f"file not found: {local.path} (relative paths "
                         "resolve against the input file's folder)") from None
    except OSError as e:
        raise MediaError("image_not_found", f"cannot read {local.path}: "
                         f"{e.strerror or e}") from None


def _read_fd(fd: int, max_bytes: int) -> bytes:
    return read_bounded(lambda n: os.read(fd, n), max_bytes)
