"""Prefix cache: shared prefixes computed once, reused from memory and from disk, and never a
different output because of it, even with a corrupted cache folder."""

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import orjson
import pytest
from click.testing import CliRunner

from batchrun.cache import block_layout, make_prefix_cache
from batchrun.cache.disk import DiskCache
from batchrun.cache.layout import BlockLayout
from batchrun.cache.prefix import Block, KeyMemo, PrefixCache, block_keys
from batchrun.cli import cli
from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.types import SamplingParams

INSTRUCTION = ("You label product reviews as positive, negative or neutral. "
               + " ".join(f"Example {i}: the kettle is sturdy and quiet, so it is positive."
                          for i in range(12)))
FP = "ab" * 32


def chat_rows(n):
    return [[{"role": "system", "content": INSTRUCTION},
             {"role": "user", "content": f"Review {i}: it is {'great' if i % 2 else 'awful'}"}]
            for i in range(n)]


def entry_files(folder: Path) -> list[Path]:
    return [p for p in folder.glob("*.safetensors") if not p.name.startswith(".")]


def engine(demo, cache=None, **config):
    return Engine(demo.model, demo.tokenizer, EngineConfig(**config), demo.context_length,
                  prefix_cache=cache, model_fingerprint=FP)


def run_chat(e, rows, max_tokens=8):
    for messages in rows:
        e.add_request(messages=messages, params=SamplingParams(max_tokens=max_tokens))
    return e.run()


def test_keys_chain_through_the_prefix():
    a = block_keys(list(range(8)), 4, b"root")
    b = block_keys([9, 9, 9, 9] + list(range(4, 8)), 4, b"root")
    assert len(a) == 2 and a[0] != b[0]
    assert a[1] != b[1]  # same tokens in block 2, different prefix: a different key
    assert block_keys(list(range(8)), 4, b"other-model") != a


def test_keys_are_the_ones_caches_already_on_disk_were_written_with():
    """A block's key: blake2b-128 of its parent key, its tokens as 4-byte little-endian
    integers, then its salt. Any other bytes would miss every block already stored."""
    import hashlib

    import numpy as np

    tokens = [0, 1, 2**32 - 1, 65_535] * 32  # two blocks of 64
    parent, expected = b"root", []
    for start in (0, 64):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(np.asarray(tokens[start:start + 64], dtype="<u4").tobytes())
        parent = h.digest()
        expected.append(parent)
    assert block_keys(tokens, 64, b"root") == expected


def test_keys_reused_from_the_last_prompt_are_the_keys_of_this_one():
    """The job loop reuses the last row's keys for the whole blocks a row shares with it:
    every prompt still gets exactly its own keys, whatever came before it."""
    import random

    rng = random.Random(5)
    memo = KeyMemo()
    base = [rng.randrange(1000) for _ in range(300)]
    image = ((70, "ab" * 32),)
    prompts = []
    for _ in range(200):
        cut = rng.randrange(len(base) + 1)
        tokens = base[:cut] + [rng.randrange(1000) for _ in range(rng.randrange(0, 90))]
        if tokens and rng.random() < 0.2:  # differ in one token anywhere
            tokens[rng.randrange(len(tokens))] = 1000
        prompts.append((tokens, rng.choice([8, 16]), rng.choice([b"a", b"b"]),
                        image if rng.random() < 0.2 else ()))
    for tokens, size, root, media in prompts + prompts[::-1]:
        assert memo.block_keys(tokens, size, root, media) == block_keys(tokens, size, root,
                                                                          media)


def test_shared_prefix_is_computed_once_and_outputs_do_not_change(demo):
    rows = chat_rows(12)
    plain = run_chat(engine(demo, max_concurrency=6), rows)
    cache = make_prefix_cache(FP, 1 << 30, None, block_size=32)
    cached_engine = engine(demo, cache, max_concurrency=6)
    outs = run_chat(cached_engine, rows)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    # The shared blocks were computed once, before the first row started; all 12 reused them
    # (and a tail past them where one pays: test_shared_prefix.py).
    shared = outs[0].cached_tokens
    blocks = cache.stats.stored_blocks * 32
    assert shared >= 0.8 * outs[0].prompt_tokens and blocks <= shared < blocks + 32
    assert all(o.cached_tokens == shared for o in outs)
    assert cache.stats.hits == 12 and cache.stats.misses == 0
    assert cached_engine.stats.cached_tokens == 12 * shared
    stats = cached_engine.get_cache_stats()
    # each row kept its own prompt's full blocks past the shared ones (in memory only)
    kept = sum((o.prompt_tokens - 1) // 32 for o in outs) - 12 * (blocks // 32)
    assert stats["kept_blocks"] == kept > 0
    assert stats["blocks"] == blocks // 32 + kept and stats["hit_tokens"] == 12 * blocks
    # A second pass is served from the cache, each row its own prompt's blocks too, with the
    # same outputs.
    again = run_chat(cached_engine, rows)
    assert [o.token_ids for o in again] == [o.token_ids for o in plain]
    assert all(o.cached_tokens == (o.prompt_tokens - 1) // 32 * 32 > shared for o in again)


def test_unique_prompts_are_kept_in_memory_and_written_to_disk_once_reused(demo, tmp_path):
    """A row's computed prompt stays in memory for a later row; it reaches the disk only when
    one reuses it (a job of unique prompts writes nothing there)."""
    cache = make_prefix_cache(FP, 1 << 30, tmp_path, block_size=16,
                              layout=block_layout(demo.model))
    e = engine(demo, cache, max_concurrency=2)
    prompts = [f"Row {i} " + "unique words here " * 10 for i in range(4)]
    plain = [o.token_ids for o in engine(demo, max_concurrency=2).generate(
        [*prompts, prompts[0] + " and more"], SamplingParams(max_tokens=3))]
    first = e.generate(prompts, SamplingParams(max_tokens=3))
    assert all(o.cached_tokens == 0 for o in first)
    cache.flush()
    assert cache.stats.kept_blocks == len(cache.blocks) > 0 and cache.stats.stored_blocks == 0
    assert entry_files(cache.disk.folder) == []  # nobody reused them yet
    later = e.generate([prompts[0] + " and more"], SamplingParams(max_tokens=3))[0]
    own = (len(demo.tokenizer.encode(prompts[0])) - 1) // 16 * 16
    assert later.cached_tokens >= own > 0
    assert [o.token_ids for o in first] + [later.token_ids] == plain
    cache.flush()
    assert len(entry_files(cache.disk.folder)) == own // 16  # written once reused


def test_prompts_are_not_kept_when_device_memory_nears_the_limit(demo):
    """Keeping a row's prompt is a bet on a later row: never at the cost of the running
    batch's memory. Near the limit nothing more is kept, and blocks kept but not reused are
    let go; the outputs stay the same."""
    cache = make_prefix_cache(FP, 1 << 30, None, block_size=16)
    e = engine(demo, cache, max_concurrency=2)
    prompts = [f"Row {i} " + "unique words here " * 10 for i in range(4)]
    params = SamplingParams(max_tokens=3)
    plain = [o.token_ids for o in engine(demo, max_concurrency=2).generate(prompts, params)]
    first = e.generate(prompts[:2], params)
    assert cache.stats.kept_blocks > 0 and len(cache.blocks) == cache.stats.kept_blocks
    e.memory_limit = 1  # as if the device were full
    later = e.generate(prompts[2:], params)
    assert [o.token_ids for o in first + later] == plain
    assert len(cache.blocks) == 0 and cache.nbytes == 0  # the unreused ones let go
    again = e.generate(prompts[2:3], params)[0]
    assert again.cached_tokens == 0 and again.token_ids == plain[2]


def test_kept_blocks_are_let_go_when_a_decode_step_nears_the_limit(demo):
    """A decoding batch's caches grow after its rows kept their prompts: a step that finds the
    device's memory past the line lets go of kept blocks no row reused."""
    cache = make_prefix_cache(FP, 1 << 30, None, block_size=16)
    e = engine(demo, cache, max_concurrency=2)
    params = SamplingParams(max_tokens=3)
    e.generate([f"Row {i} " + "unique words here " * 10 for i in range(2)], params)
    assert cache.stats.kept_blocks > 0 and len(cache.blocks) == cache.stats.kept_blocks
    e.memory_limit = 1  # as if the batch had grown to the limit
    e.generate(["Hi"], params)  # shorter than a block: nothing to keep, only steps
    assert len(cache.blocks) == 0 and cache.nbytes == 0


def test_rows_stop_keeping_prompts_no_row_reuses_and_try_again_later(demo, monkeypatch):
    """Keeping is a bet on later rows: after KEEP_PROBE_ROWS rows kept theirs and none was
    reused, the next KEEP_PAUSE_ROWS keep nothing (a job of unique prompts pays nothing for
    it), then rows keep theirs again; a reuse keeps it going. Outputs never change."""
    import batchrun.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "KEEP_PROBE_ROWS", 2)
    monkeypatch.setattr(engine_module, "KEEP_PAUSE_ROWS", 2)
    cache = make_prefix_cache(FP, 1 << 30, None, block_size=16)
    e = engine(demo, cache, max_concurrency=1)
    params = SamplingParams(max_tokens=2)
    prompts = [f"Row {i} " + "unique words here " * 10 for i in range(8)]
    plain = [o.token_ids for o in engine(demo, max_concurrency=1).generate(prompts, params)]
    got, kept = [], []
    for p in prompts[:7]:
        got.append(e.generate([p], params)[0].token_ids)
        kept.append(cache.stats.kept_blocks)
    each = kept[0]
    # rows 0-1 keep, 2-3 pause, 4-5 keep (a fresh probe), 6 pauses
    assert each > 0 and kept == [each, 2 * each, 2 * each, 2 * each, 3 * each, 4 * each,
                                 4 * each]
    # a row starts from row 0's kept blocks: keeping paid, so the probe starts afresh and the
    # next row keeps its prompt
    reuse = e.generate([prompts[0] + " and more"], params)[0]
    assert reuse.cached_tokens >= each * 16 and cache.stats.kept_reused == each
    before = cache.stats.kept_blocks
    got.append(e.generate([prompts[7]], params)[0].token_ids)
    assert cache.stats.kept_blocks == before + each
    assert got == plain


def test_lru_eviction_by_bytes():
    def block(i):
        k = mx.zeros((1, 2, 4, 8))
        return Block(bytes([i]) * 16, b"", (i,) * 4, [k], [k])

    size = block(0).nbytes
    cache = PrefixCache(root=b"r", budget_bytes=3 * size, block_size=4)
    for i in range(3):
        cache.put(block(i))
    cache._get(bytes([0]) * 16)  # touch 0: 1 is now the least recently used
    cache.put(block(3))
    assert set(cache.blocks) == {bytes([i]) * 16 for i in (0, 2, 3)}
    assert cache.nbytes == 3 * size and cache.stats.evicted_blocks == 1


def test_disk_round_trip_and_corrupt_entries_are_skipped(demo, tmp_path):
    rows = chat_rows(6)
    plain = run_chat(engine(demo, max_concurrency=3), rows)
    layout = block_layout(demo.model)
    first = make_prefix_cache(FP, 1 << 30, tmp_path, block_size=32, layout=layout)
    run_chat(engine(demo, first, max_concurrency=3), rows)
    files = sorted(entry_files(first.disk.folder))
    # the shared blocks; the rows' own prompt blocks stay in memory (nobody reused them)
    assert len(files) == first.stats.stored_blocks >= 4
    assert len(first.blocks) == len(files) + first.stats.kept_blocks

    # A fresh process's view: everything comes from disk, outputs unchanged.
    warm = make_prefix_cache(FP, 1 << 30, tmp_path, block_size=32, layout=layout)
    outs = run_chat(engine(demo, warm, max_concurrency=3), rows)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert warm.stats.disk_loaded_blocks == len(files) and outs[0].cached_tokens > 0

    # Corrupt the cache: truncate one entry, flip bytes in the tensors of another, plant a
    # foreign model's entry under a valid name.
    files[0].write_bytes(files[0].read_bytes()[:100])
    data = bytearray(files[1].read_bytes())
    data[-20:] = bytes(20)
    files[1].write_bytes(bytes(data))
    files[2].write_bytes(files[2].read_bytes().replace(FP.encode(), ("cd" * 32).encode()))

    damaged = make_prefix_cache(FP, 1 << 30, tmp_path, block_size=32, layout=layout)
    outs = run_chat(engine(demo, damaged, max_concurrency=3), rows)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert damaged.disk.skipped >= 1  # the first block is corrupt: nothing after it is used


def test_disk_cap_evicts_least_recently_used(tmp_path):
    disk = DiskCache.open(tmp_path, FP, 4, BlockLayout(1, 1, 2, "F32"), cap_bytes=1)
    k = mx.ones((1, 1, 4, 2))
    first = Block(block_keys([1, 2, 3, 4], 4, disk.root)[0], disk.root, (1, 2, 3, 4), [k], [k])
    disk.save([first])
    assert not entry_files(disk.folder)  # over the cap at once: evicted
    disk.cap_bytes = 10**9
    disk.save([first])
    assert disk.load(first.key).tokens == (1, 2, 3, 4)
    index = orjson.loads((disk.folder / "index.json").read_bytes())
    assert list(index) == [first.key.hex()]


def test_a_block_another_process_saves_is_found_after_the_listing_delay(tmp_path, monkeypatch):
    """Loads look entries up in a listing of the folder (misses cost no file open); a block that
    another job writes later is used once the listing is read again."""
    layout = BlockLayout(1, 1, 2, "F32")
    reader = DiskCache.open(tmp_path, FP, 4, layout)
    writer = DiskCache.open(tmp_path, FP, 4, layout)
    k = mx.ones((1, 1, 4, 2))
    block = Block(block_keys([1, 2, 3, 4], 4, reader.root)[0], reader.root, (1, 2, 3, 4), [k], [k])
    assert reader.load(block.key) is None  # the listing is taken now, without the block
    writer.save([block])
    assert writer.load(block.key).tokens == (1, 2, 3, 4)  # its own saves are listed at once
    monkeypatch.setattr("batchrun.cache.disk.LISTING_TTL_S", 0.0)
    assert reader.load(block.key).tokens == (1, 2, 3, 4)


def test_blocks_read_together_are_each_checked(tmp_path):
    """A prompt's blocks are read from disk on several threads; each is still verified on its
    own: a damaged one is dropped (and removed) without costing its neighbours."""
    disk = DiskCache.open(tmp_path, FP, 4, BlockLayout(1, 1, 2, "F32"))
    keys = block_keys(list(range(12)), 4, disk.root)
    parents = [disk.root, *keys[:-1]]
    blocks = [Block(keys[i], parents[i], tuple(range(4 * i, 4 * i + 4)),
                    [mx.full((1, 1, 4, 2), float(i))], [mx.full((1, 1, 4, 2), -float(i))])
              for i in range(3)]
    disk.save_later(blocks)
    disk.flush()
    middle = disk.folder / f"{keys[1].hex()}.safetensors"
    middle.write_bytes(middle.read_bytes()[:-8])
    absent = block_keys(list(range(16)), 4, disk.root)[3]
    found = DiskCache.open(tmp_path, FP, 4, BlockLayout(1, 1, 2, "F32")).load_many(
        [*keys, absent])
    assert found[keys[0]].tokens == (0, 1, 2, 3) and found[keys[2]].tokens == (8, 9, 10, 11)
    assert mx.array_equal(found[keys[2]].values[0], blocks[2].values[0])
    assert found[keys[1]] is None and found[absent] is None and not middle.exists()


def test_blocks_read_ahead_are_loaded_from_what_was_read_and_still_checked(tmp_path,
                                                                          monkeypatch):
    """A job's feeder asks for the first row's blocks while the engine warms up: their files
    are read then, not again when the row is admitted, and a damaged one is still dropped."""
    layout = BlockLayout(1, 1, 2, "F32")
    disk = DiskCache.open(tmp_path, FP, 4, layout)
    keys = block_keys(list(range(12)), 4, disk.root)
    parents = [disk.root, *keys[:-1]]
    blocks = [Block(keys[i], parents[i], tuple(range(4 * i, 4 * i + 4)),
                    [mx.full((1, 1, 4, 2), float(i))], [mx.full((1, 1, 4, 2), -float(i))])
              for i in range(3)]
    disk.save(blocks)
    middle = disk.folder / f"{keys[1].hex()}.safetensors"
    middle.write_bytes(middle.read_bytes()[:-8])
    cache = make_prefix_cache(FP, 1 << 30, tmp_path, block_size=4, layout=layout)
    reads = []
    real = cache.disk.files.read
    monkeypatch.setattr(cache.disk.files, "read", lambda name, *a: reads.append(name) or
                        real(name, *a))
    cache.read_ahead(list(range(13)))
    for read in list(cache.disk._ahead.values()):
        read.result()
    asked = len(reads)
    assert asked == 3
    found = cache.disk.load_many(keys)
    assert len(reads) == asked and cache.disk._ahead == {}
    assert found[keys[0]].tokens == (0, 1, 2, 3) and found[keys[2]].tokens == (8, 9, 10, 11)
    assert found[keys[1]] is None and not middle.exists()
    # Reads nobody asks for are not kept: past the first absent block, or after closing.
    cache.read_ahead(list(range(13)))
    cache.disk.load_many(keys[:1])
    assert cache.disk._ahead == {}
    cache.disk.close()
    cache.read_ahead(list(range(13)))  # a feeder thread may still ask: nothing happens
    assert cache.disk._ahead == {}


def test_a_job_reads_its_first_rows_blocks_ahead_once(tmp_path, monkeypatch):
    rows = write_rows(tmp_path / "rows.jsonl", 6)
    cache = tmp_path / "cache"
    cli_run(rows, "--job-dir", tmp_path / "a", "--cache-dir", cache)
    asked = []
    real = Engine.read_ahead
    monkeypatch.setattr(Engine, "read_ahead", lambda self, prompt: asked.append(prompt) or
                        real(self, prompt))
    cli_run(rows, "--job-dir", tmp_path / "b", "--cache-dir", cache)
    assert len(asked) == 1 and len(asked[0]) > 64  # the first row's prompt, once
    a, b = ([orjson.loads(x)["text"] for x in (tmp_path / j / "results.jsonl").read_bytes()
             .splitlines()] for j in "ab")
    assert a == b
    report = orjson.loads((tmp_path / "b" / "report.json").read_bytes())
    assert report["cached_prompt_tokens"] >= 0.8 * report["prompt_tokens"]


def test_blocks_asked_for_during_the_warm_up_are_read_then(demo, tmp_path, monkeypatch):
    """The warm-up sets the prefix cache aside (its rows must not reach it), yet the job's
    feeder asks for the first row's blocks exactly then: the reads start at once, and the row
    is served from them."""
    rows = chat_rows(2)
    first = engine(demo, make_prefix_cache(FP, 1 << 30, tmp_path, block_size=32,
                                           layout=block_layout(demo.model)))
    expected = run_chat(first, rows)
    first.prefix_cache.disk.close()
    e = engine(demo, make_prefix_cache(FP, 1 << 30, tmp_path, block_size=32,
                                       layout=block_layout(demo.model)))
    prompt = e.prompts.encode_chat(rows[0])
    started = []
    real_run = e.run

    def run_reading_ahead():  # the feeder's thread builds the first row meanwhile
        e.read_ahead(prompt)
        started.append(len(e.prefix_cache.disk._ahead) if e.prefix_cache else None)
        return real_run()

    monkeypatch.setattr(e, "run", run_reading_ahead)
    e.warm_up(cpu_too=True)
    assert started and started[0] is None  # the cache is set aside while the warm-up runs
    assert len(e.prefix_cache.disk._ahead) >= 2  # yet the first row's blocks are being read
    monkeypatch.setattr(e, "run", real_run)
    assert [o.text for o in run_chat(e, rows)] == [o.text for o in expected]
    assert e.prefix_cache.stats.disk_loaded_blocks >= 2


def write_rows(path: Path, n: int) -> Path:
    path.write_text("".join(orjson.dumps({"custom_id": f"r{i}", "messages": m,
                                          "max_tokens": 6}).decode() + "\n"
                            for i, m in enumerate(chat_rows(n))))
    return path


def cli_run(*args):
    result = CliRunner().invoke(cli, ["run", *map(str, args), "--quiet"])
    assert result.exit_code == 0, result.output
    return result


def test_cli_second_run_is_served_from_disk(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", 10)
    cache = tmp_path / "cache"
    cli_run(rows, "--job-dir", tmp_path / "a", "--cache-dir", cache)
    cli_run(rows, "--job-dir", tmp_path / "b", "--cache-dir", cache)
    cli_run(rows, "--job-dir", tmp_path / "c", "--no-prefix-cache", "--cache-dir",
            tmp_path / "unused")
    a, b, c = ([orjson.loads(x) for x in (tmp_path / j / "results.jsonl").read_bytes()
                .splitlines()] for j in "abc")
    assert [r["text"] for r in a] == [r["text"] for r in b] == [r["text"] for r in c]
    assert all(r["usage"]["cached_tokens"] > 0 for r in b)  # every row, the first too
    # The cold run computed the shared instruction once, before any row: every row reused it.
    assert all(r["usage"]["cached_tokens"] > 0 for r in a)
    assert all(r["usage"]["cached_tokens"] == 0 for r in c)
    assert not (tmp_path / "unused").exists()
    report = orjson.loads((tmp_path / "b" / "report.json").read_bytes())
    assert report["cached_prompt_tokens"] == sum(r["usage"]["cached_tokens"] for r in b)
    assert report["cached_prompt_tokens"] >= 0.8 * report["prompt_tokens"]
    # where they came from: the warm run read the instruction's blocks from disk, the cold
    # one computed them once and served them from memory
    cold = orjson.loads((tmp_path / "a" / "report.json").read_bytes())["prompt_sources"]
    warm = report["prompt_sources"]
    assert cold["disk"] == 0 < cold["memory"] and warm["disk"] > 0
    assert warm["computed"] + warm["memory"] + warm["disk"] == report["prompt_tokens"]
    assert warm["computed"] == report["prompt_tokens"] - report["cached_prompt_tokens"]

    out = CliRunner().invoke(cli, ["cache", "ls", "--cache-dir", str(cache)]).output
    assert "blocks" in out
    out = CliRunner().invoke(cli, ["cache", "stats", "--cache-dir", str(cache)]).output
    assert "models: 1" in out
    result = CliRunner().invoke(cli, ["cache", "clear", "--yes", "--cache-dir", str(cache)])
    assert result.exit_code == 0 and not (cache / "prefix").exists()


def test_two_processes_share_one_cache_folder(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", 12)
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-m", "batchrun", "run", str(rows), "--job-dir",
                               str(tmp_path / f"j{i}"), "--cache-dir", str(cache), "--quiet"],
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    texts = [[orjson.loads(x)["text"] for x in (tmp_path / f"j{i}" / "results.jsonl")
              .read_bytes().splitlines()] for i in range(2)]
    assert texts[0] == texts[1]
    folder = next((cache / "prefix").iterdir())
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    index = orjson.loads((folder / "index.json").read_bytes())
    assert set(index) == {p.stem for p in entry_files(folder)}


@pytest.mark.parametrize("budget", [0])
def test_a_zero_budget_cache_still_gives_the_same_outputs(demo, budget):
    rows = chat_rows(4)
    plain = run_chat(engine(demo), rows)
    tiny = make_prefix_cache(FP, budget, None, block_size=32)
    outs = run_chat(engine(demo, tiny), rows)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_seed_cache_api_counterparts(demo, tmp_path):
    rows = chat_rows(4)
    cache = make_prefix_cache(FP, 1 << 30, None, block_size=32)
    e = engine(demo, cache)
    run_chat(e, rows)
    n = e.get_cache_stats()["blocks"]
    assert n > 0
    assert e.save_cache_to_disk(tmp_path) == n  # save_cache_to_disk
    e.clear_prefix_cache()  # clear_prefix_cache
    assert e.get_cache_stats()["blocks"] == 0
    assert e.load_cache_from_disk(tmp_path) == n  # load_cache_from_disk
    outs = run_chat(e, rows)
    assert all(o.cached_tokens > 0 for o in outs)
    assert engine(demo).get_cache_stats() is None  # no cache, no stats


def test_a_later_turn_reads_the_earlier_rows_computed_prompt(tmp_path):
    """Row i + 24 repeats row i's system message and user turn and adds a turn; at concurrency
    2 (10 rows queued), row i finished long before: its computed prompt, kept, serves most of
    row i + 24's, with the same texts as without the cache."""
    rows = []
    for i in range(32):
        base = i % 24
        messages = [{"role": "system", "content": f"Case {base}. " + " ".join(
                         f"fact {base}-{j} holds" for j in range(25))},
                    {"role": "user", "content": f"Summarize case {base}."}]
        if i >= 24:
            messages += [{"role": "assistant", "content": "Done."},
                         {"role": "user", "content": "And its mood?"}]
        rows.append({"custom_id": f"r{i}", "messages": messages, "max_tokens": 4})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(orjson.dumps(r).decode() + "\n" for r in rows))
    cli_run(data, "--job-dir", tmp_path / "a", "--cache-dir", tmp_path / "cache",
            "--max-concurrency", "2")
    cli_run(data, "--job-dir", tmp_path / "b", "--no-prefix-cache", "--max-concurrency", "2")
    a, b = ([orjson.loads(x) for x in (tmp_path / j / "results.jsonl").read_bytes()
             .splitlines()] for j in "ab")
    assert [r["text"] for r in a] == [r["text"] for r in b]
    later = [r["usage"] for r in a[24:]]
    assert sum(u["cached_tokens"] for u in later) >= 0.8 * sum(u["prompt_tokens"] for u in later)
    report = orjson.loads((tmp_path / "a" / "report.json").read_bytes())
    assert report["prompt_sources"]["memory"] == report["cached_prompt_tokens"] > 0
