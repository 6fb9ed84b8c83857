"""The media policy for image rows: local paths only under the allowed roots and only regular
files; http(s) only to public addresses (checked after resolution, on the address dialed, and on
every redirect) unless --allow-private-urls; one deadline per image; no file's or response's
content in any message; and a slow image never holds up other rows or Ctrl-C.

Network tests talk only to loopback servers started here; "private" and "public" hosts are
names whose resolution the test fakes, and connecting anywhere but 127.0.0.1 fails the test."""

import base64
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from helpers import jsonl, run, write_rows
from PIL import Image

import batchrun
from batchrun.io.jsonl import RawRow
from batchrun.io.media import (
    DEFAULT_POLICY,
    ImageCache,
    MediaError,
    MediaPolicy,
    address_problem,
    data_uri,
    fetch,
    load_image,
)
from batchrun.job.errors import UsageError
from batchrun.job.feeder import Feeder
from batchrun.job.rows import RowError, RowOptions, Task, build_task

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "sample_data" / "demo-vision-model"
FIELD = "messages[0].content[1].image_url"
SECRET = "SECRET-7f3a"  # content no message may quote
LOOPBACK = MediaPolicy(allow_private_urls=True)


def png_bytes(color=(200, 10, 10), size=(40, 40)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def refused(code: str, ref, base_dir, policy=DEFAULT_POLICY, field=FIELD) -> str:
    with pytest.raises(MediaError) as info:
        load_image(ref, base_dir, field, policy)
    assert info.value.code == code, str(info.value)
    message = str(info.value)
    assert message.startswith(f"{field}: ") and "\n" not in message
    return message


@pytest.fixture
def folders(tmp_path):
    """An input folder holding one picture, and a picture outside it."""
    inside = tmp_path / "input"
    inside.mkdir()
    (inside / "ok.png").write_bytes(png_bytes())
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "pic.png").write_bytes(png_bytes((10, 10, 200)))
    return inside, outside


# -- Local paths ------------------------------------------------------------------------------

@pytest.mark.parametrize("ref", ["/etc/passwd", "/etc/shadow", "/proc/self/environ",
                                 "file:///etc/passwd", "/no/such/file.png",
                                 {"bytes": None, "path": "/etc/passwd"}])
def test_paths_outside_the_roots_are_refused_alike(folders, ref):
    inside, _ = folders
    message = refused("image_path_not_allowed", ref, inside)
    assert "--media-root DIR" in message
    # The same words whether the file exists or not; nothing of its content or size.
    assert message == refused("image_path_not_allowed", "/no/such/file.png", inside)
    assert "root:" not in message and "bytes" not in message and "/etc" not in message


def test_dot_dot_escape_and_symlinks_below_the_root_are_refused(folders):
    inside, outside = folders
    refused("image_path_not_allowed", "../elsewhere/pic.png", inside)
    refused("image_path_not_allowed", f"{inside}/../elsewhere/pic.png", inside)
    (inside / "link.png").symlink_to(outside / "pic.png")
    (inside / "dir-link").symlink_to(outside)
    (inside / "passwd").symlink_to("/etc/passwd")
    (inside / "alias.png").symlink_to(inside / "ok.png")  # inside too: a link could be swapped
    for ref in ("link.png", "dir-link/pic.png", "passwd", (inside / "link.png").as_uri(),
                "alias.png"):
        assert "symbolic link" in refused("image_path_not_allowed", ref, inside)


def test_media_root_allows_another_folder_and_keeps_the_input_folder(folders):
    inside, outside = folders
    policy = MediaPolicy(roots=(outside,))
    assert load_image(str(outside / "pic.png"), inside, FIELD, policy).width == 40
    assert load_image("../elsewhere/pic.png", inside, FIELD, policy).width == 40
    assert load_image((outside / "pic.png").as_uri(), inside, FIELD, policy).width == 40
    assert load_image("ok.png", inside, FIELD, policy).width == 40
    refused("image_path_not_allowed", "/etc/passwd", inside, policy)


def test_a_link_given_as_a_media_root_is_resolved_once(folders):
    inside, outside = folders
    (inside / "link").symlink_to(outside)
    message = refused("image_path_not_allowed", "link/pic.png", inside)
    assert f"({inside / 'link'})" in message and "--media-root" in message
    policy = MediaPolicy(roots=(inside / "link",))  # the deepest root holding the path wins
    assert load_image("link/pic.png", inside, FIELD, policy).width == 40
    assert load_image(str(inside / "link" / "pic.png"), inside, FIELD, policy).width == 40


def test_roots_are_compared_after_their_own_symlinks(folders, tmp_path):
    inside, _ = folders
    (tmp_path / "input-link").symlink_to(inside)
    assert load_image("ok.png", tmp_path / "input-link", FIELD).width == 40
    assert load_image(str(inside / "ok.png"), tmp_path / "input-link", FIELD).width == 40


def test_a_fifo_inside_the_root_is_refused_without_blocking(folders):
    inside, _ = folders
    os.mkfifo(inside / "pipe.png")  # opening it for reading would wait for a writer
    outcome = []

    def load():
        try:
            load_image("pipe.png", inside, FIELD)
        except MediaError as e:
            outcome.append(e)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=5)
    assert not thread.is_alive(), "reading a FIFO blocked"
    (error,) = outcome
    assert error.code == "image_not_found" and "a FIFO" in str(error)
    assert "regular files" in str(error)


def test_a_folder_is_refused(folders):
    inside, _ = folders
    (inside / "sub.png").mkdir()
    assert "a folder" in refused("image_not_found", "sub.png", inside)
    assert "a folder" in refused("image_not_found", ".", inside)


def test_a_non_image_inside_the_root_is_an_error_without_its_bytes_or_size(folders):
    inside, _ = folders
    content = f"{SECRET} api_key=abc\n" * 7
    (inside / "notes.png").write_text(content)
    message = refused("unsupported_image", "notes.png", inside)
    assert SECRET not in message and "api_key" not in message
    assert str(len(content)) not in message and "bytes" not in message
    (inside / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + SECRET.encode() * 4)
    assert SECRET not in refused("corrupt_image", "bad.png", inside)


def test_the_size_of_an_allowed_file_over_the_limit_may_be_stated(folders):
    inside, _ = folders
    with pytest.raises(MediaError) as info:
        load_image("ok.png", inside, FIELD, max_bytes=10)
    assert info.value.code == "image_too_large" and "MB" in str(info.value)


def decoder_spy(monkeypatch) -> dict[str, list[int]]:
    """The lengths handed to the percent decoders and to the base64 decoder, call by call."""
    seen = {"unescaped": [], "b64decoded": []}

    def spy(module, name, into):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda text, *args, **kwargs: (
            seen[into].append(len(text)), real(text, *args, **kwargs))[1])

    spy(fetch, "unquote", "unescaped")
    spy(data_uri, "unquote_to_bytes", "unescaped")
    spy(data_uri.base64, "b64decode", "b64decoded")
    return seen


def too_large(ref, base_dir, max_bytes: int) -> None:
    with pytest.raises(MediaError) as info:
        load_image(ref, base_dir, FIELD, max_bytes=max_bytes)
    assert info.value.code == "image_too_large" and "MB limit" in str(info.value)


def test_a_data_uri_over_the_limit_is_refused_before_it_is_decoded(tmp_path, monkeypatch):
    image = png_bytes()
    limit = len(image)
    escaped = "data:image/png," + "".join(f"%{b:02X}" for b in image)  # 3 characters a byte
    encoded = "data:image/png;base64," + base64.b64encode(image).decode()
    assert load_image(escaped, tmp_path, FIELD, max_bytes=limit).width == 40
    assert load_image(encoded, tmp_path, FIELD, max_bytes=limit).width == 40
    seen = decoder_spy(monkeypatch)
    too_large(escaped, tmp_path, limit - 1)
    assert seen["unescaped"] == []  # its length alone proves it too large
    too_large(encoded, tmp_path, limit - 1)
    assert seen["b64decoded"] == []
    # Escapes and whitespace hide the size until decoded: a huge URI is decoded a slice at most.
    for payload in (";base64," + "%41" * 300_000, ";base64," + " A" * 300_000,
                    "," + "A" * 3 * (limit - 1)):
        seen["unescaped"].clear()
        too_large("data:image/png" + payload, tmp_path, limit - 1)
        assert sum(seen["unescaped"]) <= data_uri._SLICE and seen["b64decoded"] == []


def test_the_cache_checks_the_policy_before_answering(folders):
    inside, outside = folders
    cache = ImageCache()
    ref = str(outside / "pic.png")
    assert cache.load(ref, inside, FIELD, MediaPolicy(roots=(outside,))).width == 40
    with pytest.raises(MediaError) as info:
        cache.load(ref, inside, FIELD)
    assert info.value.code == "image_path_not_allowed"


def test_media_timeout_must_be_positive():
    with pytest.raises(ValueError, match="over 0 seconds"):
        MediaPolicy(timeout=0)


# -- Addresses --------------------------------------------------------------------------------

@pytest.mark.parametrize("address, kind", [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"),
    ("10.0.0.1", "private"), ("172.16.5.4", "private"), ("192.168.1.1", "private"),
    ("fc00::1", "private"), ("fd12:3456::1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("224.0.0.1", "multicast"), ("ff02::1", "multicast"), ("240.0.0.1", "reserved"),
    ("100.64.0.1", "carrier-grade NAT"), ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:10.0.0.1", "private"), ("::ffff:169.254.169.254", "link-local"),
    ("64:ff9b::a00:1", "private"), ("not-an-ip", "not an IP"),
])
def test_non_public_addresses_are_named(address, kind):
    assert kind in address_problem(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.216.34", "2606:4700:4700::1111",
                                     "::ffff:8.8.8.8"])
def test_public_addresses_pass(address):
    assert address_problem(address) is None


# -- Network: loopback servers and faked name resolution --------------------------------------

@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "HTTP_PROXY",
                 "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)


class Server:
    """A loopback TCP server; `reply(conn, request, server)` answers each connection."""

    def __init__(self, reply):
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[bytes] = []
        self.arrived = threading.Event()
        self.release = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                request += chunk
            self.requests.append(request)
            self.arrived.set()
            with contextlib.suppress(OSError):  # the client went away
                self.reply(conn, request, self)

    def close(self):
        self.release.set()
        self.sock.close()


@pytest.fixture
def serve():
    servers = []

    def start(reply) -> Server:
        servers.append(Server(reply))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def answer(status: str, body: bytes = b"", headers: dict | None = None):
    def reply(conn, request, server):
        lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", "Connection: close",
                 *(f"{k}: {v}" for k, v in (headers or {}).items())]
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    return reply


def request_path(request: bytes) -> str:
    return request.split(b" ", 2)[1].decode()


@pytest.fixture
def dns(monkeypatch):
    """Fake answers for some names (others resolve for real); returns the names looked up."""
    table: dict[str, list[str]] = {}
    looked_up: list[str] = []
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        looked_up.append(host)
        if host in table:
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", (a, port, 0, 0)) if ":" in a
                    else (socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                    for a in table[host]]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return SimpleNamespace(table=table, looked_up=looked_up)


@pytest.fixture
def dialed(monkeypatch):
    """Every address connected to; connecting anywhere but 127.0.0.1 fails the test."""
    addresses: list[str] = []
    real = socket.socket.connect

    def connect(self, address):
        addresses.append(address[0])
        if address[0] != "127.0.0.1":
            raise AssertionError(f"the test tried to connect to {address}")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    return addresses


@pytest.fixture
def loopback_is_public(monkeypatch):
    """A test hook: 127.0.0.1 (the test servers) counts as a public address."""
    real = address_problem
    monkeypatch.setattr(fetch, "address_problem",
                        lambda address: None if address == "127.0.0.1" else real(address))


def test_a_loopback_url_is_refused_before_connecting_unless_allowed(tmp_path, serve, dialed):
    server = serve(answer("200 OK", png_bytes()))
    for url in (f"http://127.0.0.1:{server.port}/a.png", f"http://localhost:{server.port}/a.png",
                f"http://[::1]:{server.port}/a.png", f"http://2130706433:{server.port}/a.png"):
        message = refused("image_url_not_allowed", url, tmp_path)
        assert "loopback" in message and "--allow-private-urls" in message
    assert dialed == [] and server.requests == []
    assert load_image(f"http://127.0.0.1:{server.port}/a.png", tmp_path, FIELD,
                      LOOPBACK).width == 40


@pytest.mark.parametrize("answers, kind", [
    (["10.0.0.1"], "private"), (["169.254.169.254"], "link-local"), (["fd00::5"], "private"),
    (["93.184.216.34", "10.1.2.3"], "private"),  # every address is checked, not just the first
    (["::ffff:127.0.0.1"], "loopback"), (["100.64.1.1"], "carrier-grade NAT"),
])
def test_names_that_resolve_to_non_public_addresses_are_refused(tmp_path, dns, dialed, answers,
                                                                kind):
    dns.table["images.test"] = answers
    message = refused("image_url_not_allowed", "https://images.test/cat.png", tmp_path)
    assert kind in message and "--allow-private-urls" in message
    assert dialed == []


def test_metadata_address_literal_is_refused(tmp_path, dialed):
    refused("image_url_not_allowed", "http://169.254.169.254/latest/meta-data/", tmp_path)
    assert dialed == []


def test_the_checked_address_is_the_one_dialed(tmp_path, dns, monkeypatch):
    """DNS rebinding: the name is looked up once, and the check's address is connected to."""
    answers = iter([["93.184.216.34"], ["127.0.0.1"]])
    real = socket.getaddrinfo

    def rebinding(host, port, *args, **kwargs):
        if host == "rebind.test":
            (a,) = next(answers)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    dialed = []

    def connect(self, address):  # record, and fail as an offline machine would
        dialed.append(address)
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(socket.socket, "connect", connect)
    refused("image_unreachable", "http://rebind.test:8080/x.png", tmp_path)
    assert dialed == [("93.184.216.34", 8080)]


def test_the_request_carries_the_url_host(tmp_path, serve, dns, dialed, loopback_is_public):
    server = serve(answer("200 OK", png_bytes()))
    dns.table["allowed.test"] = ["127.0.0.1"]
    assert load_image(f"http://allowed.test:{server.port}/a.png", tmp_path, FIELD).width == 40
    assert f"Host: allowed.test:{server.port}\r\n".encode() in server.requests[0]
    assert dialed == ["127.0.0.1"] and dns.looked_up.count("allowed.test") == 1


@pytest.mark.parametrize("target", ["http://internal.test/x.png", "http://169.254.169.254/",
                                    "http://[::1]:{port}/a.png", "http://[fe80::1]/x.png",
                                    "file:///etc/passwd", "ftp://allowed.test/x.png"])
def test_a_redirect_to_a_non_public_place_is_refused(tmp_path, serve, dns, dialed,
                                                     loopback_is_public, target):
    def reply(conn, request, server):
        if request_path(request) == "/a.png":
            return answer("200 OK", png_bytes())(conn, request, server)
        location = target.format(port=server.port)
        return answer("302 Found", SECRET.encode(), {"Location": location})(conn, request,
                                                                            server)

    server = serve(reply)
    dns.table["allowed.test"] = ["127.0.0.1"]
    dns.table["internal.test"] = ["10.0.0.1"]
    message = refused("image_url_not_allowed", f"http://allowed.test:{server.port}/start",
                      tmp_path)
    assert "redirects" in message and target.format(port=server.port) not in message
    assert SECRET not in message
    assert set(dialed) == {"127.0.0.1"} and len(server.requests) == 1


def test_redirects_within_allowed_places_are_followed_up_to_five(tmp_path, serve):
    def reply(conn, request, server):
        path = request_path(request)
        if path == "/a.png":
            return answer("200 OK", png_bytes())(conn, request, server)
        hops = int(path.rsplit("/", 1)[1])
        location = "/a.png" if hops == 0 else f"/hop/{hops - 1}"
        answer("301 Moved Permanently", headers={"Location": location})(conn, request, server)

    server = serve(reply)
    base = f"http://127.0.0.1:{server.port}"
    assert load_image(f"{base}/hop/4", tmp_path, FIELD, LOOPBACK).width == 40  # 5 redirects
    message = refused("image_unreachable", f"{base}/hop/5", tmp_path, LOOPBACK)
    assert "more than 5 redirects" in message


def test_a_slow_drip_fails_at_the_deadline(tmp_path, serve):
    def drip_body(conn, request, server):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while not server.release.wait(0.2):  # a byte every 0.2 s: no single read times out
            conn.sendall(b"x")

    def drip_headers(conn, request, server):
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 1000:
            if server.release.wait(0.2):
                return
            conn.sendall(bytes([byte]))

    for reply in (drip_body, drip_headers):
        server = serve(reply)
        start = time.monotonic()
        message = refused("image_unreachable", f"http://127.0.0.1:{server.port}/x.png",
                          tmp_path, MediaPolicy(allow_private_urls=True, timeout=1.0))
        assert 0.9 < time.monotonic() - start < 2.0
        assert "1 s deadline" in message


def test_a_hanging_server_fails_at_the_deadline(tmp_path, serve):
    server = serve(lambda conn, request, server: server.release.wait(30))
    start = time.monotonic()
    refused("image_unreachable", f"http://127.0.0.1:{server.port}/x.png", tmp_path,
            MediaPolicy(allow_private_urls=True, timeout=0.5))
    assert time.monotonic() - start < 1.5


def test_no_response_content_is_quoted(tmp_path, serve):
    body = f"<html>{SECRET} internal admin page</html>".encode()
    cases = {
        "500": (answer(f"500 {SECRET}", body), "image_unreachable", "HTTP 500 Internal Server "
                                                                    "Error"),
        "299": (answer(f"299 {SECRET}", body), "image_unreachable", "HTTP 299"),
        "200": (answer("200 OK", body, {"Content-Type": "image/png"}), "unsupported_image",
                "not a PNG"),
        "banner": (lambda conn, request, server: conn.sendall(f"SSH-2.0-{SECRET}\r\n".encode()),
                   "image_unreachable", "not valid HTTP"),
    }
    for name, (reply, code, expected) in cases.items():
        server = serve(reply)
        message = refused(code, f"http://127.0.0.1:{server.port}/x.png", tmp_path, LOOPBACK)
        assert expected in message, name
        # The URL (with its random port) is the message's own; only the rest may not leak.
        said = message.replace(f"127.0.0.1:{server.port}", "")
        assert SECRET not in said and "admin" not in said and str(len(body)) not in said, name


def test_a_proxy_is_connected_to_and_the_target_still_checked(tmp_path, serve, dns, dialed,
                                                              monkeypatch):
    proxy = serve(answer("200 OK", png_bytes()))
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{proxy.port}")
    dns.table["public.test"] = ["93.184.216.34"]
    dns.table["internal.test"] = ["10.0.0.1"]
    assert load_image("http://public.test/cat.png", tmp_path, FIELD).width == 40
    assert proxy.requests[0].startswith(b"GET http://public.test/cat.png HTTP/1.1\r\n")
    assert b"Host: public.test\r\n" in proxy.requests[0]
    refused("image_url_not_allowed", "http://internal.test/cat.png", tmp_path)
    assert len(proxy.requests) == 1 and dialed == ["127.0.0.1"]


# -- The feeder: image rows load on a pool; nothing waits on them -----------------------------

class FakePrompts:
    max_images = 8

    def encode(self, text):
        return [1, 2, 3]

    def encode_chat(self, messages, tools=None, chat_template_kwargs=None):
        return [1, 2]

    def prepare(self, messages, images, tools=None, chat_template_kwargs=None):
        return SimpleNamespace(input_ids=[9] * len(images), images=images, digests=())


class SlowCache:
    """An ImageCache whose "slow" image waits for `release`; records the threads that load."""

    def __init__(self):
        self.release = threading.Event()
        self.threads: set[str] = set()

    def load(self, ref, base_dir, field, policy=None):
        self.threads.add(threading.current_thread().name)
        if ref == "slow":
            self.release.wait(30)
        if ref == "bad":
            raise MediaError("image_not_found", "file not found: bad", field)
        return f"image:{ref}"


def image_row(ref: str) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": ref}}]}]}


def feeder_for(values: list, lookahead: int = 16, consumed: list | None = None):
    cache = SlowCache()
    options = RowOptions(images=cache)
    prompts = FakePrompts()

    def rows():
        for i, value in enumerate(values):
            if consumed is not None:
                consumed.append(i)
            yield RawRow(i, i + 1, value)

    feeder = Feeder(rows(), lambda raw: build_task(raw.value, raw.index, raw.line, prompts,
                                                    options), lookahead)
    return feeder, cache


def take_all(feeder: Feeder, count: int, timeout: float = 5.0) -> list:
    items, deadline = [], time.monotonic() + timeout
    while len(items) < count and time.monotonic() < deadline:
        items += feeder.take(count - len(items), block=True, linger=0.01, timeout=0.1)
    return items


def test_rows_flow_past_a_slow_image(tmp_path):
    values = [image_row("slow"), *({"prompt": f"p{i}"} for i in range(5)), image_row("fast"),
              image_row("bad")]
    feeder, cache = feeder_for(values)
    try:
        first = take_all(feeder, 7)
        assert sorted(item.index for item in first) == [1, 2, 3, 4, 5, 6, 7]
        by_index = {item.index: item for item in first}
        assert by_index[6].vision.images == ["image:fast"]
        assert isinstance(by_index[7], RowError) and by_index[7].code == "image_not_found"
        assert by_index[7].message.startswith("messages[0].content[1].image_url: ")
        cache.release.set()
        (last,) = take_all(feeder, 1)
        assert isinstance(last, Task) and last.index == 0 and last.vision.images == ["image:slow"]
        assert feeder.take(1, block=True) == [] and feeder.exhausted
        assert all(name.startswith("batchrun-fetch") for name in cache.threads)
    finally:
        cache.release.set()
        feeder.close()


def test_take_times_out_and_close_returns_while_a_fetch_hangs():
    feeder, cache = feeder_for([image_row("slow")])
    try:
        start = time.monotonic()
        assert feeder.take(4, block=True, timeout=0.3) == []
        assert 0.3 <= time.monotonic() - start < 1.0
        start = time.monotonic()
        feeder.close()
        assert time.monotonic() - start < 1.5
    finally:
        cache.release.set()


def test_the_lookahead_bound_holds_while_fetches_hang():
    consumed: list[int] = []
    feeder, cache = feeder_for([image_row("slow")] * 40 + [{"prompt": "after"}], lookahead=4,
                               consumed=consumed)
    try:
        time.sleep(0.5)
        assert len(consumed) == 4  # four rows inside, all waiting on an image: no more read
        cache.release.set()
        taken = 0
        while not feeder.exhausted:
            taken += len(feeder.take(2, block=True))
            assert len(consumed) - taken <= 4
        assert taken == 41
    finally:
        cache.release.set()
        feeder.close()


def test_a_build_failure_surfaces_from_take():
    def build(raw):
        raise RuntimeError("boom")

    feeder = Feeder(iter([RawRow(0, 1, {"prompt": "x"})]), build, lookahead=2)
    with pytest.raises(RuntimeError, match="boom"):
        take_all(feeder, 1)
    feeder.close()


def test_rows_built_on_several_threads_come_out_once_checked_in_input_order():
    import random

    checked = []

    def check(raw):
        checked.append(raw.index)
        return f"dup {raw.index}" if raw.index % 7 == 3 else None

    def build(raw):
        time.sleep(random.random() / 500)  # builds finish out of order
        return raw.index

    rows = [RawRow(i, i + 1, {"prompt": "x"}) for i in range(60)]
    feeder = Feeder(iter(rows), build, lookahead=16, check=check, workers=4)
    items = take_all(feeder, 60)
    feeder.close()
    assert checked == list(range(60))  # the order-dependent checks see the input order
    assert sorted(map(str, items)) == sorted(
        [f"dup {i}" if i % 7 == 3 else str(i) for i in range(60)])


def test_rows_go_on_while_a_slow_input_is_still_being_read():
    """Rows travel between the feeder's threads in batches; no row waits for more to be
    read."""
    produced = []

    def rows():
        for i in range(40):
            produced.append(i)
            yield RawRow(i, i + 1, {"prompt": "x"})
            time.sleep(0.05)

    feeder = Feeder(rows(), lambda raw: raw.index, lookahead=64)
    try:
        first = feeder.take(1, block=True, timeout=5.0)
        assert first == [0] and len(produced) < 10  # taken long before a chunk could fill
        assert sorted(first + take_all(feeder, 39)) == list(range(40))
    finally:
        feeder.close()


def paced_rows(n: int, pace: float):
    for i in range(n):
        time.sleep(pace)
        yield RawRow(i, i + 1, {"prompt": "x"})


def test_an_idle_take_waits_for_rows_while_they_keep_coming():
    """An idle engine's take goes on while each row comes within `linger` of the one before
    (the rows of a job's start are admitted together, not in waves)."""
    feeder = Feeder(paced_rows(30, 0.01), lambda raw: raw.index, lookahead=64)
    try:
        assert feeder.take(100, block=True, linger=0.1, timeout=5.0) == list(range(30))
    finally:
        feeder.close()


def test_an_idle_take_waits_for_rows_still_being_built():
    """Rows read and being built are waited for even when they come in bursts further apart
    than `linger` (build threads hand rows back a piece at a time)."""
    def build(raw):
        if raw.index % 8 == 7:
            time.sleep(0.08)
        return raw.index

    feeder = Feeder(iter([RawRow(i, i + 1, {"prompt": "x"}) for i in range(24)]), build,
                    lookahead=64, workers=1)
    try:
        assert feeder.take(100, block=True, linger=0.03, timeout=5.0) == list(range(24))
    finally:
        feeder.close()


def test_an_idle_take_stops_lingering_at_its_cap():
    from batchrun.job.feeder import LINGER_CAP_S

    feeder = Feeder(paced_rows(400, 0.01), lambda raw: raw.index, lookahead=1000)
    try:
        start = time.monotonic()
        taken = feeder.take(1000, block=True, linger=0.1, timeout=5.0)
        assert 10 < len(taken) < 400 and time.monotonic() - start < LINGER_CAP_S + 1.0
    finally:
        feeder.close()


def test_rows_read_go_on_while_the_input_blocks():
    go = threading.Event()

    def rows():
        yield RawRow(0, 1, {"prompt": "x"})
        yield RawRow(1, 2, {"prompt": "x"})
        go.wait(10)  # a slow disk, a Parquet batch being read
        yield RawRow(2, 3, {"prompt": "x"})

    feeder = Feeder(rows(), lambda raw: raw.index, lookahead=64)
    try:
        start = time.monotonic()
        taken = feeder.take(10, block=True, linger=0.05, timeout=5.0)
        assert taken == [0, 1] and time.monotonic() - start < 2.0
        go.set()
        assert take_all(feeder, 1) == [2]
    finally:
        go.set()
        feeder.close()


def test_rows_in_chunks_keep_their_checks_errors_and_order():
    """Many rows in one chunk: each is checked in input order, each build's failure is its
    own, and every row comes out once."""
    def check(raw):
        return f"dup {raw.index}" if raw.index % 5 == 0 else None

    def build(raw):
        return RowError(raw.index, raw.line, str(raw.index), "bad", "x") if raw.index % 5 == 1 \
            else raw.index

    feeder = Feeder(iter([RawRow(i, i + 1, {"prompt": "x"}) for i in range(100)]), build,
                    lookahead=1000, check=check, workers=3)
    try:
        items = take_all(feeder, 100)
        assert feeder.take(1, block=True) == [] and feeder.exhausted
    finally:
        feeder.close()
    assert sorted(x for x in items if isinstance(x, int)) == [
        i for i in range(100) if i % 5 not in (0, 1)]
    assert sorted(x.index for x in items if isinstance(x, RowError)) == [
        i for i in range(100) if i % 5 == 1]
    assert sorted(int(x.split()[1]) for x in items if isinstance(x, str)) == list(range(0, 100, 5))


# -- End to end: the CLI on the tiny vision model ---------------------------------------------

def user(text: str, url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_media_root_and_timeout_options(tmp_path, folders, monkeypatch):
    inside, outside = folders
    rows = write_rows(inside / "rows.jsonl", [
        {"custom_id": "in", "messages": user("Look", "ok.png"), "max_tokens": 3},
        {"custom_id": "out", "messages": user("Look", str(outside / "pic.png")),
         "max_tokens": 3}])
    run(rows, "--model", MODEL, "--job-dir", tmp_path / "strict")
    (error,) = jsonl(tmp_path / "strict" / "errors.jsonl")
    assert error["custom_id"] == "out" and error["error"]["code"] == "image_path_not_allowed"
    monkeypatch.chdir(tmp_path)  # a relative --media-root starts from the current folder
    run(rows, "--model", MODEL, "--job-dir", tmp_path / "rooted", "--media-root", "elsewhere")
    assert [r["custom_id"] for r in jsonl(tmp_path / "rooted" / "results.jsonl")] == \
        ["in", "out"]
    job_file = tmp_path / "jobs" / "pics.toml"
    job_file.parent.mkdir()
    job_file.write_text(f'input = "../input/rows.jsonl"\nmodel = "{MODEL}"\n'
                        'media_root = ["../elsewhere"]\nmedia_timeout = 5\n')
    run(job_file)
    assert len(jsonl(tmp_path / "jobs" / "pics" / "results.jsonl")) == 2
    result = run(rows, "--media-timeout", "0", code=2)
    assert "--media-timeout" in result.output
    job = batchrun.Job(rows, job_dir=tmp_path / "api", media_root="elsewhere", media_timeout=2)
    assert job.spec.rows.media_roots == (tmp_path / "elsewhere",)
    assert job.spec.rows.media_timeout == 2.0 and not job.spec.rows.allow_private_urls
    with pytest.raises(UsageError, match="--media-timeout"):
        batchrun.Job(rows, job_dir=tmp_path / "api", media_timeout=-1)


def start_job(rows: Path, job: Path, *extra) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    return subprocess.Popen(
        [sys.executable, "-m", "batchrun", "run", str(rows), "--model", str(MODEL),
         "--job-dir", str(job), "--quiet", "--allow-private-urls", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def rows_done(job: Path) -> int:
    try:
        return orjson.loads((job / "report.json").read_bytes())["rows_done"]
    except (FileNotFoundError, orjson.JSONDecodeError, KeyError):
        return 0


def test_text_rows_finish_long_before_a_hanging_image(tmp_path, serve):
    def hang_then_fail(conn, request, server):
        server.release.wait(60)
        answer(f"500 {SECRET}", SECRET.encode())(conn, request, server)

    server = serve(hang_then_fail)
    rows = write_rows(tmp_path / "rows.jsonl", [
        {"custom_id": "img", "messages": user("Look", f"http://127.0.0.1:{server.port}/x.png"),
         "max_tokens": 3},
        *({"custom_id": f"t{i}", "prompt": f"Text row {i}", "max_tokens": 3} for i in range(6))])
    job = tmp_path / "job"
    proc = start_job(rows, job, "--media-timeout", "30")
    try:
        assert server.arrived.wait(60), proc.stderr.read() if proc.poll() is not None else ""
        fetch_started = time.monotonic()
        while rows_done(job) < 6 and proc.poll() is None and \
                time.monotonic() - fetch_started < 10:
            time.sleep(0.05)
        assert rows_done(job) == 6, "text rows waited on the image"
        assert time.monotonic() - fetch_started < 10  # the image's deadline is 30 s
        assert proc.poll() is None  # the image row is still fetching
        server.release.set()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        proc.kill()
    assert sorted(r["custom_id"] for r in jsonl(job / "results.jsonl")) == \
        [f"t{i}" for i in range(6)]
    (error,) = jsonl(job / "errors.jsonl")
    assert error["custom_id"] == "img" and error["error"]["code"] == "image_unreachable"
    assert "HTTP 500" in error["error"]["message"]
    assert SECRET not in (job / "errors.jsonl").read_text()


def test_ctrl_c_interrupts_a_hanging_fetch(tmp_path, serve):
    server = serve(lambda conn, request, server: server.release.wait(120))
    rows = write_rows(tmp_path / "rows.jsonl", [
        {"custom_id": "t0", "prompt": "before", "max_tokens": 2},
        {"custom_id": "img", "messages": user("Look", f"http://127.0.0.1:{server.port}/x.png")},
        {"custom_id": "t1", "prompt": "after", "max_tokens": 2}])
    job = tmp_path / "job"
    proc = start_job(rows, job, "--media-timeout", "120")
    try:
        assert server.arrived.wait(60)
        time.sleep(0.5)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
        assert time.monotonic() - start < 5
        assert proc.returncode == 130, err
        assert "resume with: batchrun run" in err
    finally:
        proc.kill()
    report = orjson.loads((job / "report.json").read_bytes())
    assert report["runs"][-1]["status"] == "interrupted"
