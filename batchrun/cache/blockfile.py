"""A prefix block's bytes on disk: the safetensors format, written and parsed in memory.

The file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and
byte range, plus string `__metadata__`), then the tensors' bytes. The metadata carries a checksum
of everything else: the other metadata, the tensor table and the tensor bytes.

`decode` trusts nothing: it raises `BlockFormatError` (a ValueError) unless the file holds
exactly the tensors the caller expects, with their shapes and dtype, tiling the data section,
and the checksum matches; only then are arrays built. Parsing from bytes the caller already read
means the file checked is the file used.
"""

from __future__ import annotations

import hashlib
import math

import mlx.core as mx
import numpy as np
import orjson

from batchrun.cache.layout import DTYPES

_NAMES = {v: k for k, v in DTYPES.items()}


class BlockFormatError(ValueError):
    """The bytes are not a whole, self-consistent block file of the expected layout."""


TRANSFER_BYTES = 256 << 20  # the most tensor bytes fetched from the device at once


class Pending:
    """A block file's parts, its tensors' bytes already fetched from the device: `pack` makes
    the file on any thread (the checksum hashes the whole data section)."""

    __slots__ = ("table", "body", "meta")

    def __init__(self, table: dict, body: bytes, meta: dict[str, str]):
        self.table, self.body, self.meta = table, body, meta


def encode(arrays: dict[str, mx.array], meta: dict[str, str]) -> bytes:
    """The file for `arrays` (in the given order) and `meta`, with its checksum added."""
    return pack(prepare_many([(arrays, meta)])[0])


def prepare_many(blocks: list[tuple[dict[str, mx.array], dict[str, str]]]) -> list[Pending]:
    """Each block's tensors' bytes, end to end, fetched from the device in as few transfers as
    TRANSFER_BYTES allows (on a GPU a transfer a tensor was a wait a tensor: 27 blocks of a 1B
    model are 864 tensors). MLX work: on the thread that computes."""
    out: list[Pending] = []
    group: list[tuple[dict[str, mx.array], dict[str, str]]] = []
    size = 0
    for arrays, meta in blocks:
        group.append((arrays, meta))
        size += sum(a.nbytes for a in arrays.values())
        if size >= TRANSFER_BYTES:
            out += _fetch(group)
            group, size = [], 0
    return out + _fetch(group) if group else out


def _fetch(blocks: list[tuple[dict[str, mx.array], dict[str, str]]]) -> list[Pending]:
    views = [mx.view(a, mx.uint8).reshape(-1) for arrays, _ in blocks for a in arrays.values()]
    data = memoryview(mx.concatenate(views) if len(views) > 1 else views[0])
    out, start = [], 0
    for arrays, meta in blocks:
        table, offset = {}, 0
        for name, a in arrays.items():
            table[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                           "data_offsets": [offset, offset + a.nbytes]}
            offset += a.nbytes
        out.append(Pending(table, data[start:start + offset].tobytes(), meta))
        start += offset
    return out


def pack(pending: Pending) -> bytes:
    """The file: header (the table and metadata, with the checksum) and data section."""
    meta = {**pending.meta, "checksum": _checksum(pending.meta, pending.table, pending.body)}
    header = orjson.dumps({"__metadata__": meta, **pending.table})
    header += b" " * (-len(header) % 8)  # tensors start 8-byte aligned, as safetensors does
    return len(header).to_bytes(8, "little") + header + pending.body


def decode(data: bytes, expect: dict[str, tuple[tuple[int, ...], str]]
           ) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The arrays and metadata of a block file holding exactly the tensors `expect` names, each
    with the given (shape, dtype); raises BlockFormatError otherwise."""
    return arrays_of(verify(data, expect))


def verify(data: bytes, expect: dict[str, tuple[tuple[int, ...], str]],
           *alternatives: dict[str, tuple[tuple[int, ...], str]]) -> Verified:
    """Check a block file (layout and checksum) without building arrays: plain bytes work that
    may run on any thread (hashing releases the GIL). The file holds exactly the tensors of
    `expect`, or of one of the `alternatives` (the one naming its tensors). Raises
    BlockFormatError."""
    if len(data) < 8:
        raise BlockFormatError("shorter than its header length")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise BlockFormatError("truncated header")
    try:
        header = orjson.loads(data[8: 8 + n])
    except orjson.JSONDecodeError as e:
        raise BlockFormatError("header is not JSON") from e
    if not isinstance(header, dict):
        raise BlockFormatError("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise BlockFormatError("metadata missing or not strings")
    body = memoryview(data)[8 + n:]
    expect = next((e for e in alternatives if set(e) == set(header)), expect)
    _check_table(header, expect, len(body))
    stored = dict(meta)
    if stored.pop("checksum", None) != _checksum(stored, header, body):
        raise BlockFormatError("checksum mismatch")
    return Verified(header, meta, body)


class Verified:
    """A block file that passed `verify`: its tensor table, metadata and tensor bytes."""

    __slots__ = ("table", "meta", "body")

    def __init__(self, table: dict, meta: dict[str, str], body: memoryview):
        self.table, self.meta, self.body = table, meta, body


def arrays_of(block: Verified) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The arrays of a verified block file, and its metadata."""
    arrays = {}
    for name, entry in block.table.items():
        start, end = entry["data_offsets"]
        raw = mx.array(np.frombuffer(block.body[start:end], dtype=np.uint8))
        arrays[name] = mx.view(raw, DTYPES[entry["dtype"]]).reshape(entry["shape"])
    mx.eval(arrays)
    return arrays, block.meta


def _check_table(table: dict, expect: dict[str, tuple[tuple[int, ...], str]],
                 body_bytes: int) -> None:
    if set(table) != set(expect):
        raise BlockFormatError("tensors other than the expected ones")
    ranges = []
    for name, (shape, dtype) in expect.items():
        entry = table[name]
        if not isinstance(entry, dict) or entry.get("dtype") != dtype \
                or not _ints(entry.get("shape")) or entry["shape"] != list(shape):
            raise BlockFormatError(f"{name}: not {dtype} of shape {shape}")
        offsets = entry.get("data_offsets")
        if not (_ints(offsets) and len(offsets) == 2):
            raise BlockFormatError(f"{name}: bad data offsets")
        if offsets[1] - offsets[0] != math.prod(shape) * DTYPES[dtype].size:
            raise BlockFormatError(f"{name}: byte range does not fit its shape")
        ranges.append(offsets)
    ranges.sort()
    ends = [0] + [end for _, end in ranges]
    if [start for start, _ in ranges] != ends[:-1] or ends[-1] != body_bytes:
        raise BlockFormatError("tensor byte ranges do not tile the data section")


def _ints(value: object) -> bool:
    # JSON's 4.0 and true compare equal to 4 and 1 in Python: insist on real integers.
    return isinstance(value, list) and all(type(x) is int for x in value)


def _checksum(meta: dict, table: dict, body: bytes | memoryview) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(orjson.dumps(meta, option=orjson.OPT_SORT_KEYS))
    h.update(orjson.dumps(table, option=orjson.OPT_SORT_KEYS))
    h.update(body)
    return h.hexdigest()
