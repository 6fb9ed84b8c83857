"""A local image is opened from its root one name at a time, following no link: a folder or a
file swapped for a link while a job runs is refused as that row's error, and the file the link
points to is never read; any OSError on the way is the row's MediaError, never the job's.

The swaps happen at fixed points (patched calls), so no test depends on timing."""

import errno
import io
import os
import shutil

import pytest
from PIL import Image

import batchrun.io.media.load as media_load
import batchrun.io.media.local as media_local
from batchrun.io.media import ImageCache, MediaError, MediaPolicy, load_image

FIELD = "messages[0].content[1].image_url"
RED, BLUE = (200, 10, 10), (10, 10, 200)


def png_bytes(color) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def tree(tmp_path):
    """input/sub/pic.png (red) under the root, elsewhere/pic.png (blue) outside it."""
    inside = tmp_path / "input"
    (inside / "sub").mkdir(parents=True)
    (inside / "sub" / "pic.png").write_bytes(png_bytes(RED))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "pic.png").write_bytes(png_bytes(BLUE))
    return inside, outside


@pytest.fixture
def reads(monkeypatch):
    """Every byte read through os.read while the test runs."""
    seen = bytearray()
    real = os.read

    def spy(fd, n):
        data = real(fd, n)
        seen.extend(data)
        return data

    monkeypatch.setattr(os, "read", spy)
    return seen


def swap_for_link(path, target) -> None:
    """What `mv path path-old; ln -s target path` does."""
    os.rename(path, path.with_name(path.name + "-old"))
    path.symlink_to(target)


def refused(code: str, load) -> str:
    with pytest.raises(MediaError) as info:
        load()
    assert info.value.code == code, str(info.value)
    assert str(info.value).startswith(f"{FIELD}: ")
    return str(info.value)


def color(loaded) -> tuple:
    return loaded.image.getpixel((0, 0))


@pytest.mark.parametrize("loader", [load_image, ImageCache().load])
def test_a_folder_link_below_the_root_is_the_rows_error(tree, loader):
    inside, outside = tree
    (inside / "out").symlink_to(outside)
    (inside / "alias").symlink_to(inside / "sub")  # to inside: refused as well
    for ref, link in (("out/pic.png", "out"), ("alias/pic.png", "alias"),
                      ((inside / "out" / "pic.png").as_uri(), "out")):
        with pytest.raises(MediaError) as info:
            loader(ref, inside, FIELD)
        assert info.value.code == "image_path_not_allowed"
        assert "symbolic link" in str(info.value) and f"({inside / link})" in str(info.value)
    assert color(loader("sub/pic.png", inside, FIELD)) == RED


def test_dot_dot_is_taken_by_its_words_and_cannot_climb_above_the_root(tree):
    inside, outside = tree
    (inside / "out").symlink_to(outside)
    # "out/.." is the root whatever "out" is: the link is never looked at.
    assert color(load_image("out/../sub/pic.png", inside, FIELD)) == RED
    message = refused("image_path_not_allowed",
                      lambda: load_image("sub/../../elsewhere/pic.png", inside, FIELD))
    assert "--media-root DIR" in message


def test_a_folder_swapped_for_a_link_after_the_check_is_not_followed(tree, monkeypatch, reads):
    inside, outside = tree
    resolve = os.path.realpath

    def resolve_then_swap(path, *args, **kwargs):
        real = resolve(path, *args, **kwargs)
        if not (inside / "sub").is_symlink():
            swap_for_link(inside / "sub", outside)
        return real

    monkeypatch.setattr(os.path, "realpath", resolve_then_swap)
    message = refused("image_path_not_allowed", lambda: load_image("sub/pic.png", inside, FIELD))
    assert f"symbolic link ({inside / 'sub'})" in message
    assert png_bytes(BLUE) not in reads


def test_a_folder_swapped_between_the_caches_stat_and_its_read(tree, monkeypatch, reads):
    inside, outside = tree
    stat_local = media_load._stat_local

    def stat_then_swap(*args):
        st = stat_local(*args)
        swap_for_link(inside / "sub", outside)
        return st

    monkeypatch.setattr(media_load, "_stat_local", stat_then_swap)
    refused("image_path_not_allowed", lambda: ImageCache().load("sub/pic.png", inside, FIELD))
    assert png_bytes(BLUE) not in reads


def test_a_folder_swapped_after_it_was_opened_reads_what_was_opened(tree, monkeypatch, reads):
    inside, outside = tree
    real_open = os.open

    def swap_then_open(name, flags, *args, dir_fd=None, **kwargs):
        if name == "pic.png" and not (inside / "sub").is_symlink():
            swap_for_link(inside / "sub", outside)
        return real_open(name, flags, *args, dir_fd=dir_fd, **kwargs)

    monkeypatch.setattr(os, "open", swap_then_open)
    assert color(load_image("sub/pic.png", inside, FIELD)) == RED  # from sub-old, still inside
    assert png_bytes(BLUE) not in reads


def test_a_file_swapped_for_a_link_after_its_check_is_refused(tree, monkeypatch, reads):
    inside, outside = tree
    check = media_local._stat_in

    def check_then_swap(*args):
        st = check(*args)
        swap_for_link(inside / "sub" / "pic.png", outside / "pic.png")
        return st

    monkeypatch.setattr(media_local, "_stat_in", check_then_swap)
    message = refused("image_path_not_allowed", lambda: load_image("sub/pic.png", inside, FIELD))
    assert "symbolic link" in message
    assert png_bytes(BLUE) not in reads


def test_a_folder_vanishing_mid_walk_is_the_rows_error(tree, monkeypatch):
    inside, _ = tree
    real_open = os.open

    def open_then_remove(name, flags, *args, dir_fd=None, **kwargs):
        fd = real_open(name, flags, *args, dir_fd=dir_fd, **kwargs)
        if name == "sub":
            shutil.rmtree(inside / "sub")
        return fd

    monkeypatch.setattr(os, "open", open_then_remove)
    message = refused("image_not_found", lambda: load_image("sub/pic.png", inside, FIELD))
    assert "file not found" in message and str(inside / "sub" / "pic.png") in message


def test_resolving_a_root_that_fails_is_the_rows_error(tree, monkeypatch):
    inside, _ = tree

    def vanished(path, *args, **kwargs):  # as realpath can when a link it met is being replaced
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))

    monkeypatch.setattr(os.path, "realpath", vanished)
    for load in (lambda: load_image("sub/pic.png", inside, FIELD),
                 lambda: ImageCache().load("sub/pic.png", inside, FIELD)):
        assert "No such file or directory" in refused("image_not_found", load)


def test_a_read_that_fails_is_the_rows_error(tree, monkeypatch):
    inside, _ = tree

    def failing(fd, n):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "read", failing)
    message = refused("image_not_found", lambda: load_image("sub/pic.png", inside, FIELD))
    assert "cannot read" in message and "Input/output error" in message


def test_a_nul_in_the_path_is_the_rows_error(tree):
    inside, _ = tree
    refused("invalid_image_url", lambda: load_image("sub/pic\0.png", inside, FIELD))


def test_the_media_root_itself_may_be_a_link(tree, tmp_path):
    inside, outside = tree
    (tmp_path / "root-link").symlink_to(outside)
    policy = MediaPolicy(roots=(tmp_path / "root-link",))
    assert color(load_image(str(tmp_path / "root-link" / "pic.png"), inside, FIELD,
                            policy)) == BLUE
    assert color(load_image(str(outside / "pic.png"), inside, FIELD, policy)) == BLUE
