"""The on-disk prefix cache in a hostile or broken folder: nothing is written through a link,
nothing but a regular file of the loading model's layout is read, no fault hangs, crashes or
changes an output, and each kind of fault is one warning."""

import errno
import itertools
import logging
import os
import re
import stat
import threading
from pathlib import Path

import mlx.core as mx
import orjson
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchrun.cache import block_layout, blockfile, make_prefix_cache
from batchrun.cache import folder as folder_module
from batchrun.cache.disk import FORMAT, DiskCache
from batchrun.cache.layout import DTYPES, BlockLayout
from batchrun.cache.prefix import Block, block_keys
from batchrun.cli import cli
from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.types import SamplingParams

FP = "ab" * 32
LAYOUT = BlockLayout(layers=2, kv_heads=2, head_dim=4, dtype="BF16")
BS = 4
INSTRUCTION = ("You label product reviews as positive, negative or neutral. "
               + " ".join(f"Example {i}: the kettle is sturdy and quiet, so it is positive."
                          for i in range(6)))


# -- helpers ---------------------------------------------------------------------------------

def open_disk(cache_dir, layout=LAYOUT, block_size=BS, fp=FP) -> DiskCache:
    disk = DiskCache.open(Path(cache_dir), fp, block_size, layout)
    assert disk is not None
    return disk


def make_block(tokens, layout=LAYOUT, seed=0, fp=FP) -> Block:
    parent = bytes.fromhex(fp)[:16]
    key = block_keys(list(tokens), len(tokens), parent)[0]
    mx.random.seed(seed)
    shape = layout.shape(len(tokens))
    arrays = [mx.random.normal(shape).astype(DTYPES[layout.dtype])
              for _ in range(2 * layout.layers)]
    mx.eval(arrays)
    return Block(key, parent, tuple(tokens), arrays[: layout.layers], arrays[layout.layers:])


def path_of(disk: DiskCache, key: bytes) -> Path:
    return disk.folder / f"{key.hex()}.safetensors"


def same_block(a: Block | None, b: Block) -> bool:
    return a is not None and (a.key, a.parent, a.tokens) == (b.key, b.parent, b.tokens) and all(
        x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item()
        for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True))


def cache_warnings(caplog, text: str = "") -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "batchrun.cache" and text in r.getMessage()]


def in_thread(fn, timeout: float = 30):
    """fn() run in another thread; fails the test if it has not returned within `timeout`."""
    out: dict = {}

    def target():
        try:
            with mx.stream(mx.new_stream(mx.default_device())):  # MLX streams are per thread
                out["value"] = fn()
        except BaseException as e:  # re-raised below, in the test's thread
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "hung"
    if "error" in out:
        raise out["error"]
    return out["value"]


def forge(disk: DiskCache, block: Block, arrays: list[mx.array], **meta) -> bytes:
    """A self-consistent file (checksum recomputed) for `block`'s key with other tensors or
    metadata: what anyone who can write the folder can make."""
    names = [f"k.{i}" for i in range(len(arrays) // 2)] + [f"v.{i}" for i in
                                                            range(len(arrays) // 2)]
    layout = disk.layout
    fields = {"format": FORMAT, "model": disk.model, "block_size": str(disk.block_size),
              "layers": str(layout.layers), "kv_heads": str(layout.kv_heads),
              "head_dim": str(layout.head_dim), "dtype": layout.dtype,
              "parent": block.parent.hex(), "tokens": orjson.dumps(list(block.tokens)).decode()}
    return blockfile.encode(dict(zip(names, arrays, strict=True)), fields | meta)


class FailingOs:
    """The os module as the cache's folder code sees it, with chosen calls failing the way a
    full, read-only or broken disk makes them fail."""

    def __init__(self, code: int, fails):
        self.code, self.fails = code, fails

    def __getattr__(self, name):
        real = getattr(os, name)

        def call(*args, **kwargs):
            if self.fails(name, args, kwargs):
                raise OSError(self.code, os.strerror(self.code))
            return real(*args, **kwargs)
        return call if callable(real) else real


def read_only(name, args, kwargs) -> bool:
    """Calls that fail on a read-only file system (making a folder that exists does not)."""
    if name in ("mkdir", "makedirs"):
        try:
            os.stat(args[0], dir_fd=kwargs.get("dir_fd"), follow_symlinks=False)
        except FileNotFoundError:
            return True
        return False
    creating = name == "open" and len(args) > 1 and args[1] & os.O_CREAT
    return bool(creating) or name in ("replace", "unlink", "rmdir", "utime")


def chat_rows(n_prefixes: int, per_prefix: int = 2) -> list[list[dict]]:
    return [[{"role": "system", "content": f"Task {p}. {INSTRUCTION}"},
             {"role": "user", "content": f"Review {i}: it is {'great' if i % 2 else 'awful'}"}]
            for p in range(n_prefixes) for i in range(per_prefix)]


def run_engine(demo, rows, cache=None) -> list[list[int]]:
    e = Engine(demo.model, demo.tokenizer, EngineConfig(max_concurrency=4), demo.context_length,
               prefix_cache=cache, model_fingerprint=demo.fingerprint)
    for messages in rows:
        e.add_request(messages=messages, params=SamplingParams(max_tokens=6))
    return [o.token_ids for o in e.run()]


def disk_backed(demo, cache_dir, block_size=32):
    return make_prefix_cache(demo.fingerprint, 1 << 30, cache_dir, block_size=block_size,
                             layout=block_layout(demo.model))


def write_rows(path: Path, rows) -> Path:
    path.write_bytes(b"".join(orjson.dumps({"custom_id": f"r{i}", "messages": m}) + b"\n"
                              for i, m in enumerate(rows)))
    return path


def cli_run(rows: Path, job: Path, *args):
    result = CliRunner().invoke(cli, ["run", str(rows), "--job-dir", str(job),
                                      "--max-tokens", "8", "--quiet", *map(str, args)])
    assert result.exit_code == 0 and result.exception is None, result.output
    assert "Traceback" not in result.output
    return result


def texts(job: Path) -> list[str]:
    return [orjson.loads(x)["text"] for x in (job / "results.jsonl").read_bytes().splitlines()]


# -- folders and writes ----------------------------------------------------------------------

def test_created_folders_and_files_are_private(tmp_path):
    root = tmp_path / "new" / "cache"
    disk = open_disk(root)
    disk.save([make_block(range(4))])
    for folder in (root, root / "prefix", disk.folder):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    names = {p.name for p in disk.folder.iterdir()}
    assert names == {f"{make_block(range(4)).key.hex()}.safetensors", "index.json", "index.lock"}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in disk.folder.iterdir())


def test_links_at_every_temporary_and_final_name_are_never_written_through(tmp_path,
                                                                           monkeypatch):
    disk = open_disk(tmp_path / "cache")
    block = make_block(range(4))
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    # The writer's next temporary names are known here; links wait at the first ones, at the
    # old predictable name, at the block's own name and at the index.
    planted = [f".planted{i}.tmp" for i in range(5)]
    names = itertools.chain(planted, (f".fresh{i}.tmp" for i in itertools.count()))
    monkeypatch.setattr(folder_module, "temp_name", lambda: next(names))
    final = path_of(disk, block.key)
    old_style = f".{block.key.hex()}.{os.getpid()}.tmp.safetensors"
    for name in [*planted, old_style, final.name, "index.json"]:
        (disk.folder / name).symlink_to(victim)

    disk.save([block])
    assert victim.read_bytes() == b"precious"
    assert final.is_file() and not final.is_symlink()
    assert not (disk.folder / "index.json").is_symlink()
    assert list(orjson.loads((disk.folder / "index.json").read_bytes())) == [block.key.hex()]
    assert same_block(disk.load(block.key), block)


def test_a_writer_that_finds_every_temporary_name_taken_gives_up_with_one_warning(
        tmp_path, monkeypatch, caplog):
    disk = open_disk(tmp_path / "cache")
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    (disk.folder / ".taken.tmp").symlink_to(victim)
    monkeypatch.setattr(folder_module, "temp_name", lambda: ".taken.tmp")
    disk.save([make_block(range(4)), make_block(range(8, 12))])
    assert victim.read_bytes() == b"precious"
    assert len(cache_warnings(caplog, "could not write")) == 1
    assert not list(disk.folder.glob("*.safetensors"))


# -- what is read ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "link to a valid block", "empty folder", "socket"])
def test_a_non_regular_file_named_like_a_block_is_skipped_removed_and_replaced(tmp_path, kind,
                                                                             caplog, monkeypatch):
    import socket

    disk = open_disk(tmp_path / "cache")
    block = make_block(range(4))
    path = path_of(disk, block.key)
    elsewhere = open_disk(tmp_path / "elsewhere")
    elsewhere.save([block])
    target = path_of(elsewhere, block.key)
    original = target.read_bytes()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to a valid block":  # even a valid block is not read through a link
        path.symlink_to(target)
    elif kind == "empty folder":
        path.mkdir()
    else:
        monkeypatch.chdir(disk.folder)  # a socket's path must be short
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path.name)
        sock.close()

    assert in_thread(lambda: disk.load(block.key)) is None
    assert not os.path.lexists(path) and disk.skipped == 1
    assert len(cache_warnings(caplog, "damaged")) == 1
    assert target.read_bytes() == original
    in_thread(lambda: disk.save([block]))
    assert path.is_file() and not path.is_symlink()
    assert same_block(disk.load(block.key), block)


@pytest.mark.parametrize("name", ["index.json", "index.lock"])
def test_a_fifo_in_place_of_the_index_or_its_lock_does_not_hang(tmp_path, name):
    disk = open_disk(tmp_path / "cache")
    os.mkfifo(disk.folder / name)
    block = make_block(range(4))
    in_thread(lambda: disk.save([block]))
    assert stat.S_ISREG((disk.folder / name).lstat().st_mode)
    assert list(orjson.loads((disk.folder / "index.json").read_bytes())) == [block.key.hex()]


@pytest.mark.parametrize("content", [
    lambda key: b"\x00\xff not json at all",
    lambda key: b"[1, 2, 3]",
    lambda key: b'"a string"',
    lambda key: orjson.dumps({key: {"bytes": "many", "tokens": None, "used": "yesterday"}}),
    lambda key: orjson.dumps({key: [1, 2], "zz-not-hex": {"bytes": 1, "tokens": 4, "used": 1}}),
    lambda key: orjson.dumps({key: {"bytes": True, "tokens": 4, "used": 1.0}}),
], ids=["garbage", "list", "string", "wrong-types", "not-a-dict-entry", "bool-for-int"])
def test_a_malformed_index_is_rebuilt_from_the_files(tmp_path, content, caplog):
    disk = open_disk(tmp_path / "cache")
    a, b = make_block(range(4)), make_block(range(10, 14), seed=1)
    disk.save([a])
    (disk.folder / "index.json").write_bytes(content(a.key.hex()))
    disk.save([b])
    index = orjson.loads((disk.folder / "index.json").read_bytes())
    assert set(index) == {a.key.hex(), b.key.hex()}
    assert index[a.key.hex()]["bytes"] == path_of(disk, a.key).stat().st_size
    assert all(type(e["bytes"]) is int and type(e["used"]) in (int, float)
               for e in index.values())
    assert len(cache_warnings(caplog, "index")) == 1
    assert same_block(disk.load(a.key), a) and same_block(disk.load(b.key), b)


# -- what is accepted ------------------------------------------------------------------------

@pytest.mark.parametrize("other", [
    BlockLayout(3, 2, 4, "BF16"), BlockLayout(1, 2, 4, "BF16"), BlockLayout(2, 1, 4, "BF16"),
    BlockLayout(2, 2, 8, "BF16"), BlockLayout(2, 2, 4, "F16"), BlockLayout(2, 2, 4, "F32"),
], ids=["more-layers", "fewer-layers", "kv-heads", "head-dim", "f16", "f32"])
def test_an_entry_of_another_layout_is_rejected_and_removed(tmp_path, other, caplog):
    disk = open_disk(tmp_path / "cache")
    wrong = make_block(range(4), layout=other)
    open_disk(tmp_path / "cache", layout=other).save([wrong])  # same tokens: the same key
    path = path_of(disk, wrong.key)
    assert path.is_file()
    assert disk.load(wrong.key) is None
    assert not path.exists() and disk.skipped == 1
    assert len(cache_warnings(caplog, "damaged")) == 1


def test_an_entry_of_another_block_size_is_rejected_and_removed(tmp_path):
    disk = open_disk(tmp_path / "cache")
    wide = open_disk(tmp_path / "cache", block_size=8)
    long = make_block(range(8))
    wide.save([long])
    key = make_block(range(4)).key
    path_of(wide, long.key).rename(path_of(disk, key))  # under the name a 4-token block has
    assert disk.load(key) is None and not path_of(disk, key).exists()


@pytest.mark.parametrize("lie", ["shape", "dtype", "model", "tokens", "values-only"])
def test_a_self_consistent_forged_file_that_does_not_fit_is_rejected(tmp_path, lie):
    """Checksums recomputed by the forger: the header checks, not the checksum, reject these."""
    disk = open_disk(tmp_path / "cache")
    block = make_block(range(4))
    arrays = block.keys + block.values
    meta = {}
    if lie == "shape":  # the metadata claims the right layout; the tensors are wider
        arrays = [mx.concatenate([a, a], axis=3) for a in arrays]
    elif lie == "dtype":
        arrays = [a.astype(mx.float16) for a in arrays]
    elif lie == "model":
        meta = {"model": "cd" * 32}
    elif lie == "tokens":  # tokens that do not hash to the file's key
        meta = {"tokens": "[9, 9, 9, 9]"}
    else:  # a forger with our layout changing only the values is not caught: stated limit
        arrays = [a + 1 for a in arrays]
    path_of(disk, block.key).write_bytes(forge(disk, block, arrays, **meta))
    loaded = disk.load(block.key)
    if lie == "values-only":
        assert loaded is not None and not same_block(loaded, block)
    else:
        assert loaded is None and not path_of(disk, block.key).exists()


def test_damaged_entries_are_warned_about_once_removed_and_written_again(tmp_path, caplog):
    disk = open_disk(tmp_path / "cache")
    blocks = [make_block(range(10 * i, 10 * i + 4), seed=i) for i in range(30)]
    disk.save(blocks)
    for i, block in enumerate(blocks):  # truncated, one bit flipped, emptied
        path = path_of(disk, block.key)
        data = path.read_bytes()
        path.write_bytes([data[: len(data) // 2], data[:-1] + bytes([data[-1] ^ 1]), b""][i % 3])

    fresh = open_disk(tmp_path / "cache")
    assert all(fresh.load(b.key) is None for b in blocks)
    assert fresh.skipped == 30 and len(cache_warnings(caplog, "damaged")) == 1
    assert not any(path_of(fresh, b.key).exists() for b in blocks)
    fresh.save(blocks)
    assert all(same_block(fresh.load(b.key), b) for b in blocks)


# -- which folders are trusted ---------------------------------------------------------------

@pytest.mark.parametrize("how", ["writable by others", "owned by another user"])
def test_a_shared_default_cache_folder_is_refused_with_one_warning(tmp_path, monkeypatch,
                                                                   caplog, how):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("BATCHRUN_CACHE_DIR")
    default = tmp_path / "home" / ".cache" / "batchrun"
    default.mkdir(parents=True)
    if how == "writable by others":
        default.chmod(0o777)
    else:
        os.chown(default, 4321, 4321)
    rows = write_rows(tmp_path / "rows.jsonl", chat_rows(2, 3))
    cli_run(rows, tmp_path / "job")
    warnings = cache_warnings(caplog)
    assert len(warnings) == 1 and str(default) in warnings[0]
    assert how.replace("writable by others", "writable by other users") in warnings[0]
    assert not (default / "prefix").exists()
    # The memory prefix cache still served the rows that share a prefix.
    results = [orjson.loads(x) for x in (tmp_path / "job" / "results.jsonl").read_bytes()
               .splitlines()]
    assert sum(r["usage"]["cached_tokens"] > 0 for r in results) >= 2


def test_an_explicit_shared_root_is_used_but_a_model_folder_others_can_write_is_not(
        tmp_path, caplog):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o1777)  # like /tmp: the user's choice
    disk = open_disk(root)
    assert stat.S_IMODE(disk.folder.stat().st_mode) == 0o700
    block = make_block(range(4))
    disk.save([block])

    disk.folder.chmod(0o775)
    assert DiskCache.open(root, FP, BS, LAYOUT) is None
    disk.folder.chmod(0o700)
    os.chown(disk.folder, 4321, 4321)
    assert DiskCache.open(root, FP, BS, LAYOUT) is None
    os.chown(disk.folder, os.geteuid(), os.getegid())
    assert same_block(open_disk(root).load(block.key), block)
    assert [w.split(" ", 3)[3] for w in cache_warnings(caplog)] == [
        "is writable by other users; the job runs without the disk prefix cache "
        "(make it yours with mode 700, or remove it)",
        "is owned by another user; the job runs without the disk prefix cache "
        "(make it yours with mode 700, or remove it)"]


@pytest.mark.parametrize("linked", ["prefix", "model folder"])
def test_a_linked_cache_folder_is_refused(tmp_path, caplog, linked):
    private = open_disk(tmp_path / "real")
    private.save([make_block(range(4))])
    root = tmp_path / "cache"
    if linked == "prefix":
        root.mkdir()
        (root / "prefix").symlink_to(tmp_path / "real" / "prefix")
    else:
        (root / "prefix").mkdir(parents=True)
        (root / "prefix" / FP[:32]).symlink_to(private.folder)
    assert DiskCache.open(root, FP, BS, LAYOUT) is None
    assert len(cache_warnings(caplog, "cannot open")) == 1


def test_a_cache_folder_that_cannot_be_made_is_one_warning_and_memory_only(demo, tmp_path,
                                                                          caplog):
    (tmp_path / "a-file").write_text("not a folder")
    cache = disk_backed(demo, tmp_path / "a-file" / "cache")
    assert cache.disk is None and len(cache_warnings(caplog, "cannot open")) == 1
    rows = chat_rows(1, 3)
    assert run_engine(demo, rows, cache) == run_engine(demo, rows)


def test_the_layout_is_measured_from_the_model_and_without_one_there_is_no_disk_cache(
        demo, tmp_path, caplog):
    layout = block_layout(demo.model)
    args = demo.model.args
    assert layout == BlockLayout(args.num_hidden_layers, args.num_key_value_heads,
                                 args.hidden_size // args.num_attention_heads, "F32")
    cache = make_prefix_cache(demo.fingerprint, 1 << 30, tmp_path / "cache")  # no layout
    assert cache.disk is None and len(cache_warnings(caplog, "no block layout")) == 1
    assert not (tmp_path / "cache").exists()


# -- I/O errors ------------------------------------------------------------------------------

def test_a_full_disk_is_one_warning_leaves_no_temporary_file_and_changes_no_output(
        demo, tmp_path, monkeypatch, caplog):
    rows = chat_rows(3)
    plain = run_engine(demo, rows)
    cache = disk_backed(demo, tmp_path / "cache")
    monkeypatch.setattr(folder_module, "os", FailingOs(errno.ENOSPC, lambda n, a, k: n == "write"))
    assert run_engine(demo, rows, cache) == plain
    assert len(cache.blocks) >= 3  # several blocks tried, one warning
    assert len(cache_warnings(caplog)) == 1
    assert "No space left on device" in cache_warnings(caplog)[0]
    assert not list(cache.disk.folder.iterdir())


def test_a_read_only_cache_still_serves_its_blocks_with_one_warning(demo, tmp_path,
                                                                   monkeypatch, caplog):
    rows, more = chat_rows(2), chat_rows(4)
    run_engine(demo, rows, disk_backed(demo, tmp_path / "cache"))  # fills the cache
    plain = run_engine(demo, more)
    monkeypatch.setattr(folder_module, "os", FailingOs(errno.EROFS, read_only))
    cache = disk_backed(demo, tmp_path / "cache")
    assert run_engine(demo, more, cache) == plain
    assert cache.stats.disk_loaded_blocks > 0  # the first two prefixes, from disk
    assert len(cache_warnings(caplog)) == 1 and "Read-only" in cache_warnings(caplog)[0]


@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES])
def test_unreadable_entries_are_one_warning_and_kept(demo, tmp_path, monkeypatch, caplog,
                                                     code):
    rows = chat_rows(3)
    first = run_engine(demo, rows, disk_backed(demo, tmp_path / "cache"))
    folder = next((tmp_path / "cache" / "prefix").iterdir())
    stored = sorted(p.name for p in folder.glob("*.safetensors"))
    monkeypatch.setattr(folder_module, "os", FailingOs(code, lambda n, a, k: n == "read"))
    cache = disk_backed(demo, tmp_path / "cache")
    assert run_engine(demo, rows, cache) == first
    assert cache.stats.disk_loaded_blocks == 0 and cache.disk.skipped == 0
    assert len(cache_warnings(caplog)) == 1 and os.strerror(code) in cache_warnings(caplog)[0]
    assert {p.name for p in folder.glob("*.safetensors")} >= set(stored)  # not "damaged"


# -- the cache commands ----------------------------------------------------------------------

def test_cache_commands_count_regular_files_only_and_never_follow_links(tmp_path):
    cache = tmp_path / "cache"
    disk = open_disk(cache)
    disk.save([make_block(range(4))])
    outside = tmp_path / "outside"
    outside.mkdir()
    keep = outside / ("0" * 32 + ".safetensors")
    keep.write_bytes(b"x" * 1000)
    os.mkfifo(disk.folder / ("1" * 32 + ".safetensors"))
    (disk.folder / ("2" * 32 + ".safetensors")).symlink_to(keep)
    (disk.folder / ("3" * 32 + ".safetensors")).mkdir()
    (cache / "prefix" / ("f" * 32)).symlink_to(outside)  # a linked model folder
    (cache / "prefix" / ("e" * 32)).mkdir()

    def invoke(*args):
        result = in_thread(lambda: CliRunner().invoke(cli, ["cache", *args, "--cache-dir",
                                                            str(cache)]))
        assert result.exit_code == 0 and result.exception is None, result.output
        return result.output

    listing = invoke("ls")
    assert re.findall(r"(\d+) blocks", listing) == ["1", "0"]
    assert "models: 2" in invoke("stats") and "blocks: 1" in invoke("stats")
    assert "cleared" in invoke("clear", "--yes")
    assert not (cache / "prefix").exists() and keep.read_bytes() == b"x" * 1000


def test_cache_clear_refuses_a_linked_prefix_folder(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep").write_text("x")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "prefix").symlink_to(precious)
    result = CliRunner().invoke(cli, ["cache", "clear", "--yes", "--cache-dir", str(cache)])
    assert result.exit_code == 1 and "not a folder" in result.output
    assert (precious / "keep").read_text() == "x"
    result = CliRunner().invoke(cli, ["cache", "ls", "--cache-dir", str(cache)])
    assert result.exit_code == 0 and "no prefix-cache entries" in result.output


# -- end to end ------------------------------------------------------------------------------

def _corrupt(kind: str, path: Path, disk: DiskCache, outside: Path, other: bytes) -> None:
    data = path.read_bytes()
    arrays, meta = blockfile.decode(data, disk.expected)
    block = Block(bytes.fromhex(path.name[:32]), bytes.fromhex(meta["parent"]),
                  tuple(orjson.loads(meta["tokens"])), [], [])
    tensors = list(arrays.values())
    path.unlink()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "bit flipped":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "wrong shape":
        path.write_bytes(forge(disk, block, [a[:, :1] for a in tensors]))
    elif kind == "wrong dtype":
        path.write_bytes(forge(disk, block, [a.astype(mx.float16) for a in tensors]))
    elif kind == "another model":
        path.write_bytes(forge(disk, block, tensors, model="cd" * 32))
    elif kind == "another block's file":
        path.write_bytes(other)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        copy = outside / path.name
        copy.write_bytes(data)
        path.symlink_to(copy)
    elif kind == "folder":
        path.mkdir()


CORRUPTIONS = ["truncated", "bit flipped", "empty", "wrong shape", "wrong dtype", "another model",
               "another block's file", "fifo", "link", "folder"]


def test_a_run_over_a_cache_damaged_every_way_matches_a_run_without_one(demo, tmp_path,
                                                                       caplog):
    rows = write_rows(tmp_path / "rows.jsonl", chat_rows(len(CORRUPTIONS)))
    cache = tmp_path / "cache"
    cli_run(rows, tmp_path / "fill", "--cache-dir", cache)
    cli_run(rows, tmp_path / "plain", "--no-prefix-cache")
    disk = DiskCache.open(cache, demo.fingerprint, 64, block_layout(demo.model))
    files = sorted(disk.folder.glob("*.safetensors"))
    heads = [p for p in files if blockfile.decode(p.read_bytes(), disk.expected)[1]["parent"]
             == demo.fingerprint[:32]]  # the first block of each prefix: always looked up
    assert len(heads) == len(CORRUPTIONS)
    other = next(p for p in files if p not in heads).read_bytes()
    outside = tmp_path / "outside"
    outside.mkdir()
    for kind, path in zip(CORRUPTIONS, heads, strict=True):
        _corrupt(kind, path, disk, outside, other)
    (disk.folder / "index.json").write_bytes(b"\x00 garbage")
    copies = {p: p.read_bytes() for p in outside.iterdir()}
    caplog.clear()

    in_thread(lambda: cli_run(rows, tmp_path / "damaged", "--cache-dir", cache), timeout=300)
    assert texts(tmp_path / "damaged") == texts(tmp_path / "plain")
    assert len(cache_warnings(caplog, "damaged")) == 1
    assert {p: p.read_bytes() for p in outside.iterdir()} == copies
    # Every damaged entry was replaced by the block the run computed again.
    for path in heads:
        assert stat.S_ISREG(path.lstat().st_mode)
        assert disk.load(bytes.fromhex(path.name[:32])) is not None


# -- fuzz ------------------------------------------------------------------------------------

ORIGINAL = make_block(range(100, 104), seed=7)
META_FIELDS = ["format", "model", "block_size", "layers", "kv_heads", "head_dim", "dtype",
               "parent", "tokens", "checksum", "extra"]
JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**40), st.floats(),
                        st.text(max_size=12), st.lists(st.integers(-2, 300), max_size=5))


def _edit_header(data: bytes, edit) -> bytes:
    n = int.from_bytes(data[:8], "little")
    header, body = orjson.loads(data[8: 8 + n]), data[8 + n:]
    what, name, field, value = edit
    if what == "meta":
        header["__metadata__"][field] = value
    elif what == "tensor":
        header.setdefault(name, {})[field] = value
    else:
        header.pop(name, None)
    new = orjson.dumps(header)
    return len(new).to_bytes(8, "little") + new + body


MUTATIONS = st.one_of(
    st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)),
                                        min_size=1, max_size=8)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("length"), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("header"), st.one_of(
        st.tuples(st.just("meta"), st.none(), st.sampled_from(META_FIELDS), JSON_VALUES),
        st.tuples(st.just("tensor"), st.sampled_from(["k.0", "v.1", "k.9"]),
                  st.sampled_from(["dtype", "shape", "data_offsets"]), JSON_VALUES),
        st.tuples(st.just("drop"), st.sampled_from(["__metadata__", "k.0", "v.1"]),
                  st.none(), st.none()))),
)


def _mutate(data: bytes, mutation) -> bytes:
    kind, arg = mutation
    if kind == "flip":
        out = bytearray(data)
        for at, mask in arg:
            out[at % len(out)] ^= mask
        return bytes(out)
    if kind == "truncate":
        return data[: arg % len(data)]
    if kind == "append":
        return data + arg
    if kind == "length":
        return arg.to_bytes(8, "little") + data[8:]
    return _edit_header(data, arg)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=MUTATIONS)
def test_fuzz_a_mutated_block_file_loads_as_the_original_or_not_at_all(tmp_path, mutation):
    disk = open_disk(tmp_path / "fuzz")
    path = path_of(disk, ORIGINAL.key)
    if not path.exists():
        disk.save([ORIGINAL])
    original = path.read_bytes()
    path.write_bytes(_mutate(original, mutation))
    loaded = disk.load(ORIGINAL.key)
    assert loaded is None or same_block(loaded, ORIGINAL)
    path.write_bytes(original)  # the next example starts from the valid file
    assert same_block(disk.load(ORIGINAL.key), ORIGINAL)



def test_blocks_fetched_together_make_the_files_each_block_makes_alone(monkeypatch):
    """Blocks' tensors come from the device in few transfers (prepare_many); every file is
    byte for byte the one its block makes alone, and reads back to its arrays."""
    blocks = []
    for i, dtype in enumerate([mx.bfloat16, mx.float32, mx.float16, mx.bfloat16]):
        full = mx.random.normal((1, 2, 9, 4), key=mx.random.key(i)).astype(dtype)
        arrays = {"k.0": full[:, :, 1:7, :], "v.0": mx.arange(48).reshape(1, 2, 6, 4)
                  .astype(dtype)}  # a strided slice and a plain array
        blocks.append((arrays, {"n": str(i)}))
    alone = [blockfile.encode(arrays, meta) for arrays, meta in blocks]
    for limit in (1 << 30, 1):  # all in one transfer; one block a transfer
        monkeypatch.setattr(blockfile, "TRANSFER_BYTES", limit)
        pending = blockfile.prepare_many(blocks)
        assert [blockfile.pack(p) for p in pending] == alone
        for p, (arrays, _) in zip(pending, blocks, strict=True):  # each tensor's own bytes
            assert p.body == b"".join(memoryview(mx.view(a, mx.uint8)).tobytes()
                                      for a in arrays.values())
    for data, (arrays, _) in zip(alone, blocks, strict=True):
        expect = {name: (tuple(a.shape), blockfile._NAMES[a.dtype]) for name, a in arrays.items()}
        decoded, meta = blockfile.decode(data, expect)
        for name, a in arrays.items():
            assert mx.array_equal(decoded[name], a).item(), name


def test_blocks_the_device_cannot_hand_over_are_kept_in_memory_with_a_warning(tmp_path,
                                                                             monkeypatch,
                                                                             caplog):
    disk = open_disk(tmp_path / "cache")

    def fail(blocks):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(blockfile, "prepare_many", fail)
    with caplog.at_level(logging.WARNING, logger="batchrun"):
        disk.save([make_block(range(4))])
        disk.save_later([make_block(range(8, 12))])
        disk.flush()
    assert not list(disk.folder.glob("*.safetensors"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "kept in memory only" in warnings[0]
