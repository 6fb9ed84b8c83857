"""Fetching http(s) image URLs. A URL connects only to the public addresses its host resolved to
(checked again on every redirect, and dialled by address so a second lookup cannot answer
differently) unless private ones are allowed; one deadline bounds all of an image's network
work (name lookup, connect, every read, redirects); no message quotes a response's content.
"""

from __future__ import annotations

import base64
import http.client
import ipaddress
import os
import socket
import ssl
import threading
import time
import urllib.request
from http import HTTPStatus
from urllib.parse import unquote, urljoin, urlsplit

from batchrun.io.media.errors import MediaError, _too_large, read_bounded
from batchrun.io.media.policy import MediaPolicy

MAX_REDIRECTS = 5
_FETCH_FIX = "download the image and reference it by local path or data URI"
_REDIRECTS = (301, 302, 303, 307, 308)
# Networks that carry another address inside an IPv6 one: check the address inside.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT


def address_problem(address: str) -> str | None:
    """Why an image URL may not connect to `address` ("a loopback address", ...) unless
    private URLs are allowed; None for a public address."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return "an address that is not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in _NAT64:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF)
    checks = (("is_unspecified", "an unspecified"), ("is_loopback", "a loopback"),
              ("is_link_local", "a link-local"), ("is_multicast", "a multicast"),
              ("is_reserved", "a reserved"), ("is_private", "a private"))
    for attribute, kind in checks:
        if getattr(ip, attribute):
            return f"{kind} address"
    if ip.version == 4 and ip in _SHARED:
        return "a shared (carrier-grade NAT) address"
    if not ip.is_global:
        return "an address that is not public"
    return None


def _fetch(url: str, max_bytes: int, policy: MediaPolicy) -> bytes:
    """GET `url`, following at most MAX_REDIRECTS redirects, each hop checked like the first,
    all within the policy's deadline."""
    deadline = time.monotonic() + policy.timeout
    hop_url = url
    for hop in range(MAX_REDIRECTS + 1):
        body, location = _fetch_once(url, hop_url, hop, max_bytes, policy, deadline)
        if location is None:
            return body
        hop_url = location
    raise MediaError("image_unreachable", f"cannot fetch {url}: more than {MAX_REDIRECTS} "
                     f"redirects; {_FETCH_FIX}")


def _fetch_once(url: str, hop_url: str, hop: int, max_bytes: int, policy: MediaPolicy,
                deadline: float) -> tuple[bytes, str | None]:
    """One request: (body, None), or (b"", the absolute URL it redirects to). `url` is the
    row's URL, the only one messages quote (a redirect's target is the server's content)."""
    parts = urlsplit(hop_url)
    try:
        host, port = parts.hostname, parts.port
    except ValueError as e:
        host, port = None, e
    if parts.scheme not in ("http", "https") or not host or isinstance(port, ValueError):
        if hop:
            raise MediaError("image_url_not_allowed", f"cannot fetch {url}: it redirects to a "
                             "URL that is not http(s); image URLs may only lead to http(s)")
        raise MediaError("invalid_image_url", f"{url!r} is not a valid URL (no host or a bad "
                         "port)")
    port = port or (443 if parts.scheme == "https" else 80)
    where = url if not hop else f"{url} (after {hop} redirect{'s' * (hop > 1)})"
    proxy = _proxy(parts)
    if proxy is None or not policy.allow_private_urls:
        addresses = _resolve(host if not hop else None, host, port, deadline, policy, where)
        if not policy.allow_private_urls:
            _check_addresses(addresses, url, hop)
    if proxy is not None:  # connect to the proxy, not to the address checked above
        addresses = _resolve(proxy[0], proxy[0], proxy[1], deadline, policy, where)
    watch = _Watchdog(deadline)
    connection = _connection(parts, host, port, addresses, proxy, watch)
    try:
        host_header = _host_header(host, port, parts.scheme)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if proxy is not None and parts.scheme == "http":  # a proxy takes the absolute URL
            target = f"http://{host_header}{target}"
        connection.request("GET", target, headers={
            "Host": host_header, "User-Agent": "batchrun",
            "Accept": "image/*", **({"Proxy-Authorization": proxy[2]}
                                    if proxy and proxy[2] and parts.scheme == "http" else {})})
        response = connection.getresponse()
        if response.status in _REDIRECTS and response.getheader("Location"):
            return b"", urljoin(hop_url, response.getheader("Location"))
        if response.status != 200:
            raise MediaError("image_unreachable", f"cannot fetch {where}: HTTP "
                             f"{_status(response.status)}; check the URL or {_FETCH_FIX}")
        length = response.getheader("Content-Length", "")
        if length.isdigit() and int(length) > max_bytes:
            raise _too_large(int(length), max_bytes)
        body = _read_body(response, max_bytes)
        if watch.expired:  # the watchdog's shutdown reads as the end of the body
            raise TimeoutError("the deadline passed")
        if response.length:  # fewer bytes than Content-Length said
            raise http.client.IncompleteRead(b"", response.length)
        return body, None
    except MediaError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise _network_error(e, where, watch, policy) from None
    finally:
        watch.close()
        connection.close()


def _read_body(response: http.client.HTTPResponse, max_bytes: int) -> bytes:
    return read_bounded(lambda n: response.read1(min(1 << 16, n)), max_bytes)


def _network_error(e: BaseException, where: str, watch: _Watchdog,
                   policy: MediaPolicy) -> MediaError:
    """A failed request, in words that quote nothing the server sent."""
    if watch.expired or time.monotonic() >= watch.deadline:
        problem = f"no complete answer within the {policy.timeout:g} s deadline " \
                  "(--media-timeout)"
    elif isinstance(e, http.client.InvalidURL):
        problem = "the URL holds characters a request cannot carry"
    elif isinstance(e, http.client.HTTPException):
        problem = "the reply is not valid HTTP or ended early"
    elif isinstance(e, ssl.SSLError):
        problem = f"TLS failed ({e.reason or type(e).__name__})"
    elif isinstance(e, OSError):
        problem = e.strerror or str(e) or type(e).__name__
    else:
        problem = f"the request could not be made ({type(e).__name__})"
    return MediaError("image_unreachable", f"cannot fetch {where}: {problem}; {_FETCH_FIX}")


def _status(code: int) -> str:
    """The code and its standard phrase (never the server's own reason text)."""
    try:
        return f"{code} {HTTPStatus(code).phrase}"
    except ValueError:
        return str(code)


def _host_header(host: str, port: int, scheme: str) -> str:
    name = f"[{host}]" if ":" in host else host
    default = 443 if scheme == "https" else 80
    return name if port == default else f"{name}:{port}"


def _check_addresses(addresses: list[str], url: str, hop: int) -> None:
    for address in addresses:
        problem = address_problem(address)
        if problem is not None:
            where = "it redirects to a host that resolves" if hop else "its host resolves"
            raise MediaError("image_url_not_allowed", f"cannot fetch {url}: {where} to "
                             f"{problem}; image URLs may only reach public addresses (pass "
                             "--allow-private-urls to allow loopback, private and link-local "
                             "ones)")


def _proxy(parts) -> tuple[str, int, str | None] | None:
    """(host, port, Proxy-Authorization) of the environment's proxy for this URL, if any."""
    proxy = urllib.request.getproxies().get(parts.scheme)
    if not proxy or urllib.request.proxy_bypass(parts.hostname):
        return None
    found = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if not found.hostname:
        return None
    auth = None
    if found.username:
        secret = f"{unquote(found.username)}:{unquote(found.password or '')}".encode()
        auth = "Basic " + base64.b64encode(secret).decode()
    return found.hostname, found.port or 80, auth


def _resolve(named: str | None, host: str, port: int, deadline: float, policy: MediaPolicy,
             where: str) -> list[str]:
    """The addresses `host` resolves to, within the deadline. Name lookups ignore socket
    timeouts and can hang for many seconds offline, so they run on a thread we stop waiting
    for. `named` is the host as messages may name it (None: a redirect's, left unnamed)."""
    done = threading.Event()
    found: list[str] = []
    failure: list[str] = []

    def lookup() -> None:
        try:
            for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
                if sockaddr[0] not in found:
                    found.append(sockaddr[0])
        except Exception as e:  # OSError, UnicodeError; on this thread, nothing may escape
            failure.append(f"{type(e).__name__}" if named is None else f"{e}")
        finally:
            done.set()

    threading.Thread(target=lookup, name="batchrun-resolve", daemon=True).start()
    name = named or "the host it redirects to"
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise MediaError("image_unreachable", f"cannot fetch {where}: resolving {name} did not "
                         f"finish within the {policy.timeout:g} s deadline (is this machine "
                         f"offline?); {_FETCH_FIX}")
    if failure or not found:
        detail = f" ({failure[0]})" if failure else ""
        raise MediaError("image_unreachable", f"cannot fetch {where}: cannot resolve "
                         f"{name}{detail}; {_FETCH_FIX}")
    return found


class _Watchdog:
    """Shuts a request's socket down when the image's deadline passes, so no run of slow reads
    (a server that drips a byte a second, in its headers or its body) outlives the deadline."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.expired = False
        self._fd = -1
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        return left

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._fd = sock.fileno()
            if self.expired:
                sock.shutdown(socket.SHUT_RDWR)

    def _expire(self) -> None:
        with self._lock:  # the descriptor stays open while held: close() waits for the lock
            self.expired = True
            if self._fd < 0:
                return
            try:  # through a duplicate: the TLS layer may own the socket object
                with socket.socket(fileno=os.dup(self._fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Before the socket closes: its descriptor number may then name another file."""
        with self._lock:
            self._fd = -1
        self._timer.cancel()


def _connection(parts, host: str, port: int, addresses: list[str],
                proxy: tuple[str, int, str | None] | None,
                watch: _Watchdog) -> http.client.HTTPConnection:
    """A connection that dials one of `addresses` (checked, or the proxy's), never resolving
    the host again: a second lookup could answer differently (DNS rebinding). TLS still
    verifies the certificate against the URL's host name, which is also the SNI."""
    dial_port = proxy[1] if proxy is not None else port
    if parts.scheme == "https":
        connection = http.client.HTTPSConnection(host if proxy is None else proxy[0], dial_port,
                                                 context=ssl.create_default_context())
        if proxy is not None:
            connection.set_tunnel(host, port, headers={"Proxy-Authorization": proxy[2]}
                                  if proxy[2] else None)
    else:
        connection = http.client.HTTPConnection(host if proxy is None else proxy[0], dial_port)

    def dial(address, timeout=None, source_address=None) -> socket.socket:
        error: OSError | None = None
        for ip in addresses:
            try:
                sock = socket.create_connection((ip, dial_port), timeout=watch.left())
            except OSError as e:
                error = e
                continue
            watch.watch(sock)
            sock.settimeout(watch.left())
            return sock
        raise error or OSError("no address to connect to")

    connection._create_connection = dial  # http.client's hook for opening the socket
    return connection
