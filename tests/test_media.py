"""Images that rows reference load as upright RGB with a pixel digest; bad media is a MediaError
with a code and a message that names the field, never a crash or a hang."""

import base64
import functools
import http.server
import io
import socket
import threading
import time

import pytest
from PIL import Image

from batchrun.io.media import (
    DEFAULT_POLICY,
    ImageCache,
    LoadedImage,
    MediaError,
    MediaPolicy,
    check_image_count,
    count_images,
    image_parts,
    load_image,
)

FIELD = "messages[0].content[1].image_url"
LOOPBACK = MediaPolicy(allow_private_urls=True)  # the test servers listen on 127.0.0.1


def picture(width=32, height=24, seed=0, mode="RGB") -> Image.Image:
    """A small picture whose pixels differ with `seed` (JPEG and PNG both keep its size)."""
    image = Image.new(mode, (width, height))
    image.putdata([((x * 7 + seed) % 256, (y * 11 + seed) % 256, (x * y + seed) % 256)[
        :len(mode)] for y in range(height) for x in range(width)])
    return image


def encode(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **kwargs)
    return out.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def fails(code: str, ref, base_dir, field=FIELD, policy=DEFAULT_POLICY,
          **limits) -> MediaError:
    with pytest.raises(MediaError) as info:
        load_image(ref, base_dir, field, policy, **limits)
    assert info.value.code == code, str(info.value)
    assert str(info.value).startswith(f"{field}: ")
    return info.value


@pytest.fixture
def png(tmp_path):
    path = tmp_path / "imgs" / "a.png"
    path.parent.mkdir()
    path.write_bytes(encode(picture()))
    return path


def test_relative_path_resolves_against_the_input_folder(tmp_path, png):
    loaded = load_image("imgs/a.png", tmp_path, FIELD)
    assert isinstance(loaded, LoadedImage)
    assert (loaded.width, loaded.height) == (32, 24)
    assert loaded.image.mode == "RGB" and loaded.image.size == (32, 24)
    assert loaded.image.getpixel((3, 2)) == picture().getpixel((3, 2))


def test_absolute_path_and_file_url_load_the_same_picture(tmp_path, png):
    elsewhere = tmp_path / "other"  # the input's folder; png's folder is a media root
    roots = MediaPolicy(roots=(png.parent,))
    by_path = load_image(str(png), elsewhere, FIELD, roots)
    by_url = load_image(png.as_uri(), elsewhere, FIELD, roots)
    assert by_path.digest == by_url.digest == load_image("imgs/a.png", tmp_path, FIELD).digest


@pytest.mark.parametrize("fmt, mime", [("PNG", "image/png"), ("JPEG", "image/jpeg")])
def test_data_uri(tmp_path, fmt, mime):
    loaded = load_image(data_uri(encode(picture(), fmt), mime), tmp_path, FIELD)
    assert (loaded.width, loaded.height) == (32, 24)
    assert loaded.image.mode == "RGB"


def test_digest_depends_on_pixels_not_on_encoding(tmp_path, png):
    on_disk = load_image(str(png), tmp_path, FIELD)
    as_uri = load_image(data_uri(png.read_bytes()), tmp_path, FIELD)
    as_bmp = load_image(data_uri(encode(picture(), "BMP"), "image/bmp"), tmp_path, FIELD)
    assert on_disk.digest == as_uri.digest == as_bmp.digest
    assert len(on_disk.digest) == 64
    assert on_disk == as_bmp  # equality and hashing follow the digest
    assert len({on_disk, as_uri, as_bmp}) == 1


def test_different_pictures_have_different_digests(tmp_path):
    a = load_image(encode(picture(seed=0)), tmp_path, FIELD)
    b = load_image(encode(picture(seed=1)), tmp_path, FIELD)
    flipped = load_image(encode(picture(24, 32)), tmp_path, FIELD)
    assert len({a.digest, b.digest, flipped.digest}) == 3


def test_exif_orientation_is_applied(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: rotate 90 degrees clockwise to view
    loaded = load_image(encode(picture(40, 20), "JPEG", exif=exif), tmp_path, FIELD)
    assert (loaded.width, loaded.height) == (20, 40)


def test_transparent_pixels_become_white(tmp_path):
    image = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    image.putpixel((0, 0), (10, 20, 30, 255))
    loaded = load_image(encode(image), tmp_path, FIELD)
    assert loaded.image.getpixel((1, 1)) == (255, 255, 255)
    assert loaded.image.getpixel((0, 0)) == (10, 20, 30)


def test_missing_file_names_the_field_and_the_absolute_path(tmp_path):
    error = fails("image_not_found", "imgs/nope.png", tmp_path)
    assert str(tmp_path / "imgs" / "nope.png") in str(error)
    fails("image_not_found", (tmp_path / "gone.png").as_uri(), tmp_path)
    fails("image_not_found", ".", tmp_path)  # a folder


@pytest.mark.parametrize("url", ["https://example.invalid/x.png", "http://[::1]:1/x.png"])
def test_unreachable_url_fails_fast(tmp_path, url):
    start = time.monotonic()
    error = fails("image_unreachable", url, tmp_path, policy=LOOPBACK)
    assert time.monotonic() - start < 5
    assert url in str(error) and "local path" in str(error)


@pytest.fixture
def no_proxy(monkeypatch):
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                 "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def server(tmp_path, png, no_proxy):
    """An HTTP server on localhost serving tmp_path."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_http_url_loads_and_http_errors_are_unreachable(tmp_path, png, server):
    loaded = load_image(f"{server}/imgs/a.png", tmp_path / "x", FIELD, LOOPBACK)
    assert loaded.digest == load_image(str(png), tmp_path, FIELD).digest
    error = fails("image_unreachable", f"{server}/imgs/missing.png", tmp_path, policy=LOOPBACK)
    assert "HTTP 404 Not Found" in str(error)
    fails("image_too_large", f"{server}/imgs/a.png", tmp_path, policy=LOOPBACK, max_bytes=10)


def test_a_server_that_never_answers_times_out(tmp_path, no_proxy):
    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never accepts or replies
        start = time.monotonic()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/x.png"
        error = fails("image_unreachable", url, tmp_path,
                      policy=MediaPolicy(allow_private_urls=True, timeout=0.3))
        assert time.monotonic() - start < 2
        assert "0.3 s deadline" in str(error)


def test_a_hanging_name_lookup_is_abandoned(tmp_path, no_proxy, monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: time.sleep(3))
    start = time.monotonic()
    error = fails("image_unreachable", "https://slow.example/x.png", tmp_path,
                  policy=MediaPolicy(timeout=0.3))
    assert time.monotonic() - start < 2
    assert "resolving slow.example" in str(error)


def test_truncated_png_is_corrupt(tmp_path):
    data = encode(picture(200, 200))
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    fails("corrupt_image", "cut.png", tmp_path)
    fails("corrupt_image", data[:20], tmp_path)  # the signature, then nothing readable
    jpeg = encode(picture(200, 200), "JPEG")
    fails("corrupt_image", jpeg[: len(jpeg) // 3], tmp_path)


def test_text_file_named_png_is_unsupported(tmp_path):
    (tmp_path / "notes.png").write_text("just some words, not pixels\n")
    fails("unsupported_image", "notes.png", tmp_path)
    fails("unsupported_image", b"", tmp_path)


def test_non_image_data_uri(tmp_path):
    error = load_error(data_uri(b"hello", "text/plain"), tmp_path)
    assert error.code in ("unsupported_image", "invalid_image_url")
    fails("unsupported_image", data_uri(b"hello, not an image"), tmp_path)


def test_bad_data_uris_are_invalid_urls(tmp_path):
    fails("invalid_image_url", "data:image/png;base64,@@not base64!!", tmp_path)
    fails("invalid_image_url", "data:image/png;base64,iVBORw0KGgoA=A", tmp_path)
    fails("invalid_image_url", "data:image/png;base64", tmp_path)  # no comma
    fails("invalid_image_url", "data:image/png;base64,", tmp_path)


@pytest.mark.parametrize("ref", ["", "   ", "s3://bucket/x.png", "ftp://host/x.png",
                                 "file://host/x.png", None, 12, {"caption": "x"}])
def test_unusable_references_are_invalid_urls(tmp_path, ref):
    fails("invalid_image_url", ref, tmp_path)


def test_too_large_by_bytes_or_pixels(tmp_path, png):
    size = png.stat().st_size
    fails("image_too_large", str(png), tmp_path, max_bytes=size - 1)
    fails("image_too_large", data_uri(png.read_bytes()), tmp_path, max_bytes=size - 1)
    fails("image_too_large", png.read_bytes(), tmp_path, max_bytes=size - 1)
    error = fails("image_too_large", str(png), tmp_path, max_pixels=32 * 24 - 1)
    assert "32x24" in str(error)
    assert load_image(str(png), tmp_path, FIELD, max_bytes=size, max_pixels=32 * 24).width == 32


def test_pixel_cap_is_checked_before_decoding(tmp_path):
    # 60 Mpx that compress to a few KB: refused from the header, under the default caps.
    (tmp_path / "bomb.png").write_bytes(encode(Image.new("1", (10_000, 6_000))))
    start = time.monotonic()
    error = fails("image_too_large", "bomb.png", tmp_path)
    assert time.monotonic() - start < 1
    assert "10000x6000" in str(error)


def test_parquet_column_values(tmp_path, png):
    expected = load_image(str(png), tmp_path, FIELD).digest
    data = png.read_bytes()
    for ref in (data, bytearray(data), memoryview(data), {"bytes": data, "path": "missing.png"},
                {"bytes": None, "path": "imgs/a.png"}, {"bytes": b"", "path": str(png)},
                {"path": png.as_uri()}):
        assert load_image(ref, tmp_path, "image").digest == expected, ref
    fails("image_not_found", {"bytes": None, "path": "missing.png"}, tmp_path, field="image")
    fails("invalid_image_url", {"bytes": None, "path": None}, tmp_path, field="image")
    fails("corrupt_image", {"bytes": data[:100], "path": None}, tmp_path, field="image")


def test_image_parts_walks_messages_in_order():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": {"url": "a.png", "detail": "low"}},
            {"type": "image_url", "image_url": "b.png"},
        ]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        {"role": "user", "content": [{"type": "image", "image": "c.png"}]},
    ]
    assert image_parts(messages) == [
        ("messages[1].content[1].image_url", "a.png"),
        ("messages[1].content[2].image_url", "b.png"),
        ("messages[3].content[0].image", "c.png"),
    ]
    assert count_images(messages) == 3
    assert image_parts(messages, prefix="body.messages")[0][0] == \
        "body.messages[1].content[1].image_url"
    assert image_parts([{"role": "user", "content": "text only"}]) == []


@pytest.mark.parametrize("content, code, field", [
    ({"type": "text", "text": "x"}, "invalid_content", "messages[0].content"),
    (7, "invalid_content", "messages[0].content"),
    (["plain string part"], "invalid_content", "messages[0].content[0]"),
    ([{"text": "no type"}], "invalid_content", "messages[0].content[0]"),
    ([{"type": "input_audio", "input_audio": {}}], "invalid_content", "messages[0].content[0]"),
    ([{"type": "text", "text": 5}], "invalid_content", "messages[0].content[0]"),
    ([{"type": "image_url", "image_url": {}}], "invalid_image_url",
     "messages[0].content[0].image_url"),
    ([{"type": "image_url", "image_url": {"url": ""}}], "invalid_image_url",
     "messages[0].content[0].image_url"),
    ([{"type": "image_url"}], "invalid_image_url", "messages[0].content[0].image_url"),
    ([{"type": "image"}], "invalid_image_url", "messages[0].content[0]"),
])
def test_bad_message_structure_names_the_field(content, code, field):
    with pytest.raises(MediaError) as info:
        image_parts([{"role": "user", "content": content}])
    assert info.value.code == code
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_messages_must_be_a_list_of_objects():
    for messages, field in (("hi", "messages"), (["hi"], "messages[0]")):
        with pytest.raises(MediaError) as info:
            image_parts(messages)
        assert (info.value.code, info.value.field) == ("invalid_content", field)


def test_too_many_images():
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"{i}.png"}} for i in range(3)]}]
    check_image_count(count_images(messages), 3, "messages")
    check_image_count(count_images(messages), None, "messages")
    with pytest.raises(MediaError) as info:
        check_image_count(count_images(messages), 2, "messages")
    assert info.value.code == "too_many_images"
    assert str(info.value).startswith("messages: ") and "limit of 2" in str(info.value)


def test_cache_decodes_a_repeated_image_once(tmp_path, png):
    cache = ImageCache()
    first = cache.load("imgs/a.png", tmp_path, FIELD)
    again = [cache.load("imgs/a.png", tmp_path, FIELD), cache.load(str(png), tmp_path, FIELD),
             cache.load(png.as_uri(), tmp_path / "imgs", FIELD)]
    assert all(loaded is first for loaded in again)
    assert (cache.misses, cache.hits) == (1, 3)
    uri = data_uri(encode(picture(seed=5)))
    assert cache.load(uri, tmp_path, FIELD) is cache.load(uri, tmp_path, "other")
    assert cache.load(encode(picture(seed=5)), tmp_path, FIELD).digest == \
        cache.load(uri, tmp_path, FIELD).digest
    assert cache.misses == 2  # the same bytes, raw or in a data URI, share one entry


def test_cache_sees_a_changed_file(tmp_path, png):
    cache = ImageCache()
    before = cache.load(str(png), tmp_path, FIELD)
    png.write_bytes(encode(picture(50, 10)))
    after = cache.load(str(png), tmp_path, FIELD)
    assert before.digest != after.digest and after.width == 50
    assert cache.misses == 2


def test_cache_remembers_failures_without_caching_them_as_images(tmp_path):
    (tmp_path / "bad.png").write_text("not an image")
    cache = ImageCache()
    for field in ("messages[0].content[0].image_url", "messages[2].content[1].image_url"):
        with pytest.raises(MediaError) as info:
            cache.load("bad.png", tmp_path, field)
        assert info.value.code == "unsupported_image"
        assert str(info.value).startswith(f"{field}: ")
    assert (cache.misses, cache.hits, len(cache)) == (1, 1, 0)


def test_cache_remembers_an_unreachable_url(tmp_path):
    cache = ImageCache()
    url = "https://example.invalid/x.png"
    for _ in range(2):
        with pytest.raises(MediaError) as info:
            cache.load(url, tmp_path, FIELD)
        assert info.value.code == "image_unreachable"
    assert (cache.misses, cache.hits) == (1, 1)


def test_cache_is_bounded(tmp_path):
    cache = ImageCache(max_entries=2)
    refs = [encode(picture(seed=i)) for i in range(3)]
    for ref in refs:
        cache.load(ref, tmp_path, FIELD)
    assert len(cache) == 2 and cache.misses == 3
    cache.load(refs[0], tmp_path, FIELD)  # the oldest was evicted
    assert cache.misses == 4
    small = ImageCache(max_cached_bytes=32 * 24 * 3)
    small.load(encode(picture()), tmp_path, FIELD)
    small.load(encode(picture(seed=1)), tmp_path, FIELD)
    assert len(small) == 1 and small.cached_bytes == 32 * 24 * 3


def load_error(ref, base_dir) -> MediaError:
    with pytest.raises(MediaError) as info:
        load_image(ref, base_dir, FIELD)
    return info.value
