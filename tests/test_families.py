"""Model families beyond full attention: sliding-window layers (Gemma 3; gpt-oss, with attention
sinks and experts) and recurrent ones (Qwen3.5's gated delta, Granite 4's Mamba-2, beside full
attention) start rows
from cached prefix blocks (a recurrent model's from a block's state snapshot), in memory and from
disk, and give mlx-lm's own greedy tokens: alone and batched, cold, warm and with a damaged
cache entry, with the shared instruction longer and shorter than the window."""

import json
import random

import mlx.core as mx
import orjson
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from batchrun.cache import layer_kinds
from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.types import Constraint, SamplingParams
from batchrun.models.families import build_family
from batchrun.models.random_model import review
from tests.helpers import run, write_rows

KINDS = {  # name: (family, window override)
    "gemma3": ("gemma3", None),  # window 64 of a ~250-token prompt
    "gemma3-wide": ("gemma3", 1024),  # the whole prompt inside the window
    "gpt-oss": ("gpt_oss", None),  # window 128, attention sinks, experts
    "qwen3_5": ("qwen3_5", None),  # gated delta, full attention every 4th layer
    "granite": ("granite_hybrid", None),  # Mamba-2 layers beside attention
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, (family, window) in KINDS.items():
        path = build_family(root / name, family, "tiny", "none")
        if window is not None:
            config = json.loads((path / "config.json").read_text())
            config["sliding_window"] = window
            (path / "config.json").write_text(json.dumps(config))
        out[name] = str(path)
    return out


def labeling_rows(n: int, instruction_reviews: int = 12) -> list[list[dict]]:
    rng = random.Random(7)
    system = " ".join(review(rng)[1] for _ in range(instruction_reviews))
    return [[{"role": "system", "content": system}, {"role": "user", "content": review(rng)[1]}]
            for _ in range(n)]


def mlx_lm_greedy(path: str, rows: list[list[dict]], max_tokens: int) -> list[list[int]]:
    model, tokenizer = load(path)
    outs = []
    for row in rows:
        ids = tokenizer.apply_chat_template(row, add_generation_prompt=True)
        tokens = []
        for token, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens):
            if int(token) in tokenizer.eos_token_ids:
                break
            tokens.append(int(token))
        outs.append(tokens)
    return outs


@pytest.mark.parametrize("kind", list(KINDS))
def test_rows_start_from_cached_blocks_with_mlx_lms_tokens(models, kind, tmp_path):
    path = models[kind]
    model, _ = load(path)
    kinds = layer_kinds(model)
    # sliding (a window) or recurrent (a state) layers beside full ones
    assert any(k is not None for k in kinds) and None in kinds
    rows = labeling_rows(10)
    expected = mlx_lm_greedy(path, rows, 8)
    for concurrency in (1, 32):
        cache_dir = tmp_path / str(concurrency)
        for run_ in ("cold", "warm", "damaged"):
            engine = Engine.load(path, EngineConfig(max_concurrency=concurrency,
                                                    cache_dir=str(cache_dir)))
            # full-attention layers attend one shared copy; sliding ones a window a row
            assert engine.backend.shares_prefix
            outs = engine.generate(rows, SamplingParams(max_tokens=8))
            stats = engine.get_cache_stats()
            disk = engine.prefix_cache.disk
            engine.close()
            assert [o.token_ids for o in outs] == expected, (kind, concurrency, run_)
            prompt = sum(o.prompt_tokens for o in outs)
            cached = sum(o.cached_tokens for o in outs)
            # the instruction is computed once, before any row: every row starts after it
            assert all(o.cached_tokens > 0 for o in outs)
            assert cached >= 0.7 * prompt
            if run_ == "cold":
                files = sorted(p for p in disk.folder.glob("*.safetensors")
                               if not p.name.startswith("."))
                assert files
            elif run_ == "warm":
                assert stats["disk_loaded_blocks"] > 0
                files[0].write_bytes(files[0].read_bytes()[:100])  # the next run finds it cut
            else:
                assert disk.skipped >= 1
    # each row holding its own copy of the prefix in every layer (--no-shared-prefix)
    engine = Engine.load(path, EngineConfig(max_concurrency=32, shared_prefix=False))
    outs = engine.generate(rows, SamplingParams(max_tokens=8))
    assert not engine.backend.shares_prefix and all(o.cached_tokens > 0 for o in outs)
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_5"])
def test_choices_score_what_mlx_lm_scores(models, kind, monkeypatch):
    """A choices row's log-probabilities are the model's: the prompt and each choice's tokens
    through mlx-lm's own forward (the window applied, the state carried), from a cached prefix
    or not."""
    path = models[kind]
    rows = labeling_rows(4)
    choices = ["positive review", "negative one here", "neutral"]
    model, tokenizer = load(path)
    from batchrun.engine.decoding import choices as scoring

    starts = []
    real = scoring.choice_logprobs
    monkeypatch.setattr(scoring, "choice_logprobs", lambda *a: starts.append(a[-1]) or real(*a))
    for prefix_cache in (False, True):
        starts.clear()
        engine = Engine.load(path, EngineConfig(max_concurrency=8, prefix_cache=prefix_cache))
        outs = engine.generate(rows, SamplingParams(max_tokens=8,
                                                    constraint=Constraint.choices(choices)))
        # from the row's cached blocks: only the rest of its prompt is computed again
        assert len(starts) == len(rows) and all((s > 0) == prefix_cache for s in starts)
        encode = engine.backend.tokenizer.encode
        engine.close()
        for row, out in zip(rows, outs, strict=True):
            assert out.error is None and (out.cached_tokens > 0) == prefix_cache
            ids = tokenizer.apply_chat_template(row, add_generation_prompt=True)
            for choice in choices:
                tokens = encode(choice, add_special_tokens=False)
                logits = model(mx.array(ids + tokens)[None])[0].astype(mx.float32)
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                want = sum(logprobs[len(ids) - 1 + i, t].item() for i, t in enumerate(tokens))
                assert out.choice_logprobs[choice] == pytest.approx(want, abs=1e-3)


@pytest.mark.parametrize("kind", ["gemma3", "gpt-oss", "qwen3_5"])
def test_a_warm_rerun_serves_most_prompt_tokens_from_the_cache(models, kind, tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", [{"custom_id": f"r{i}", "messages": m}
                                                for i, m in enumerate(labeling_rows(12))])
    cache = tmp_path / "cache"
    for job in ("cold", "warm"):
        run(rows, "--model", models[kind], "--max-tokens", 4, "--job-dir", tmp_path / job,
            "--cache-dir", cache)
    cold, warm = (orjson.loads((tmp_path / j / "report.json").read_bytes()) for j in
                  ("cold", "warm"))
    assert warm["cached_prompt_tokens"] >= 0.5 * warm["prompt_tokens"] > 0
    texts = [[orjson.loads(x)["text"] for x in (tmp_path / j / "results.jsonl").read_bytes()
              .splitlines()] for j in ("cold", "warm")]
    assert texts[0] == texts[1] and cold["cached_prompt_tokens"] > 0


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3"])
def test_a_longer_shared_prefix_is_computed_on_from_cached_blocks(models, kind, tmp_path):
    """A later job whose rows share more than the cache holds computes the rest from the
    cached blocks (a recurrent model from the snapshot at their end): mlx-lm's tokens."""
    path = models[kind]
    short = labeling_rows(4, instruction_reviews=8)
    rng = random.Random(3)
    extra = " ".join(review(rng)[1] for _ in range(6))
    longer = [[{"role": "system", "content": short[0][0]["content"] + " " + extra}, row[1]]
              for row in labeling_rows(6, instruction_reviews=8)]
    expected = mlx_lm_greedy(path, longer, 6)
    cache_dir = str(tmp_path / "cache")
    for rows in (short, longer):
        engine = Engine.load(path, EngineConfig(max_concurrency=8, cache_dir=cache_dir))
        outs = engine.generate(rows, SamplingParams(max_tokens=6))
        stats = engine.get_cache_stats()
        engine.close()
    assert stats["disk_loaded_blocks"] > 0  # the short instruction's blocks, read back
    assert stats["stored_blocks"] > 0  # and more computed on from them
    assert [o.token_ids for o in outs] == expected
    assert all(o.cached_tokens > 64 * stats["disk_loaded_blocks"] for o in outs)
