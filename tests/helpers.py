"""Small helpers the job-level tests share: run the CLI in-process, write and read JSONL."""

import time
from pathlib import Path

import orjson
from click.testing import CliRunner

from batchrun.cli import cli


def jsonl(path) -> list:
    return [orjson.loads(x) for x in Path(path).read_bytes().splitlines() if x.strip()]


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def run(*args, code=0):
    """`batchrun run ARGS --quiet`, asserting its exit code."""
    result = CliRunner().invoke(cli, ["run", *map(str, args), "--quiet"])
    assert result.exit_code == code, result.output
    return result


def committed_rows(job: Path) -> int:
    """Rows with a record that the job's state.json records (0 before the first commit)."""
    try:
        state = orjson.loads((job / "state.json").read_bytes())
    except (OSError, ValueError):
        return 0
    return state["rows_done"] + state["rows_failed"]


def wait_until(condition, proc, timeout: float = 60.0) -> None:
    """Wait for `condition()` while the process `proc` runs; fails if it ends or time runs
    out first."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, "the job ended before the condition held"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def choice_logprob(lm, prompt: str, choice: str) -> float:
    """A choice's log-probability after a prompt, from one uncached forward of the model over
    both: the sum of its tokens' log-probabilities (what choices.py reports)."""
    import mlx.core as mx

    ids = lm.tokenizer.encode(prompt)
    tokens = lm.tokenizer.encode(choice, add_special_tokens=False)
    logits = lm.model(mx.array(ids + tokens)[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sum(logprobs[len(ids) - 1 + i, t].item() for i, t in enumerate(tokens))
