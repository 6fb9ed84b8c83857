"""Shared-prefix attention on the 150m shape (12 layers, 16 query heads over 4 KV heads, fp32,
random weights: the benchmark model, not the demo's 4 layers): the same greedy tokens as without
a prefix cache, one row at a time and batched, from a cold, a warm and a damaged disk cache,
with two instructions mixed in one batch."""

import pytest

from batchrun.models import load_model
from batchrun.models.random_model import build
from tests.test_shared_prefix import FIRST, SECOND, rows, run


@pytest.fixture(scope="module")
def m150(tmp_path_factory):
    return load_model(str(build(tmp_path_factory.mktemp("m150"), shape="150m")))


@pytest.fixture(scope="module")
def chats():
    return rows(FIRST, 4) + rows(SECOND, 3) + rows(FIRST, 2, start=4)


@pytest.fixture(scope="module")
def reference(m150, chats):
    return run(m150, chats, prefix=False)[0]


def test_the_150m_shape_gives_the_same_greedy_tokens_batched_or_alone(m150, chats, reference):
    batched, engine = run(m150, chats, concurrency=64)
    assert engine.scheduler.shares_prefix and engine.faults == 0
    assert engine.get_cache_stats()["hit_tokens"] > 0
    alone, _ = run(m150, chats, concurrency=1)
    assert batched == alone == reference


def test_the_150m_shape_gives_the_same_tokens_from_cold_warm_and_damaged_caches(
        m150, chats, reference, tmp_path):
    folder = tmp_path / "cache"
    cold, _ = run(m150, chats, folder, concurrency=64)
    warm, engine = run(m150, chats, folder, concurrency=64)
    assert engine.get_cache_stats()["disk_loaded_blocks"] > 0
    for entry in folder.rglob("*.safetensors"):
        data = bytearray(entry.read_bytes())
        data[len(data) // 2] ^= 0xFF
        entry.write_bytes(bytes(data))
    damaged, engine = run(m150, chats, folder, concurrency=64)
    assert engine.get_cache_stats()["disk_skipped"] > 0
    assert cold == warm == damaged == reference
