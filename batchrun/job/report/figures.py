"""report.json's figures, for the whole job and for each start of it (`runs`), and writing it
(with the final report, the records' figures and report.html too).

What the figures mean. The job (top level):
- rows_done, rows_failed, rows_pending: rows with a committed result / error record, and the
  rest of rows_total (state.json's progress: what the output holds).
- prompt_tokens, cached_prompt_tokens, completion_tokens: the usage of those result records;
  prompt_sources: the prompt tokens computed, read from the prefix cache's blocks in memory
  (computed in the same run) and from disk (computed by a run before, any job's).
- wall_s: the runs' wall times added up (model loading not included).
- completion_tokens_per_s: tokens the engine generated per second of wall time (the runs'
  generated_tokens over their wall_s); requests_per_s: rows committed per second of wall time.
- prefill_tokens_per_s, decode_tokens_per_s: the engine's rates while it prefilled prompts
  (cached tokens excluded) and while it only decoded; mean_batch_size: running sequences per
  decode step; TTFT quantiles: the runs' weighted by their rows (an approximation).
- speculative_steps, speculative_proposed_tokens, speculative_accepted_tokens (also per run),
  speculative_acceptance: speculative decoding's verifying steps, the tokens rows guessed in
  them, the guesses kept (each one a token gained over a token a row a step) and their share.
- labels, error_codes, token_lengths: read from the records (tally.py) when the final
  report is written (or by `batchrun report`); absent from the reports written mid-run.
- expected: with --expected-column, the column, the results with an `expected` answer (rows),
  those whose answer (its label, else its text, both stripped) is it (agreeing_rows) and their
  share (accuracy); error records are not results and count in neither.

A run (one start of the job, in `runs`):
- speculation: the settings it ran with: method ("off", "ngram" or "draft"), draft_model and
  draft_tokens (the guesses a row); a resumed job's runs may differ.
- rows_done, rows_failed: the rows this run committed; prompt_tokens, cached_prompt_tokens,
  completion_tokens: those rows' usage (the job's tokens less the earlier runs').
- cached_disk_tokens: prompt tokens the engine's rows read from blocks loaded from disk.
- generated_tokens: what the engine generated in the run, rows it had not finished included (an
  interrupted run's lost work) and rows answered from an identical row left out;
  completion_tokens_per_s = generated_tokens / wall_s, its real rate however it ended.

So the job's rows and tokens are the sums of its runs'. A run killed (SIGKILL) between a commit
and that commit's report keeps the rows of its previous report, and the next run's tokens take
in the tokens of the rows it missed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import orjson

import batchrun
from batchrun.engine.stats import EngineStats
from batchrun.job.listing import run_problem
from batchrun.job.report.html import render_html
from batchrun.job.report.tally import record_figures
from batchrun.job.state import DamagedFile, Progress, read_json, write_atomic

log = logging.getLogger("batchrun")
MAX_TIMELINE_POINTS = 1500
SUM_FIELDS = ("wall_s", "rows_done", "rows_failed", "prompt_tokens", "cached_prompt_tokens",
              "completion_tokens", "prefill_time_s", "decode_time_s", "decode_tokens",
              "decode_steps", "speculative_steps", "speculative_proposed_tokens",
              "speculative_accepted_tokens")


def run_entry(started: float, status: str, stats: EngineStats, rows_done: int, rows_failed: int,
              max_concurrency: int, wall_s: float) -> dict:
    """The figures of one start of the job: its committed rows, and what the engine did (its
    committed tokens are added by `build_report`)."""
    wall = max(round(wall_s, 3), 1e-9)  # the wall_s written, so rates agree with the job's
    last_sample = stats.timeline[-1][2] if stats.timeline else 0
    generated = max(stats.completion_tokens, last_sample)  # finished rows' tokens + running's
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "status": status,
        "wall_s": round(wall_s, 3),
        "rows_done": rows_done,
        "rows_failed": rows_failed,
        "generated_tokens": generated,
        "cached_disk_tokens": stats.cached_disk_tokens,
        "prefill_time_s": round(stats.prefill_time, 3),
        "decode_time_s": round(stats.decode_time, 3),
        "decode_tokens": stats.decode_tokens,
        "decode_steps": stats.decode_steps,
        "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 2),
        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2),
        "completion_tokens_per_s": round(generated / wall, 2),
        "requests_per_s": round((rows_done + rows_failed) / wall, 3),
        "peak_memory_bytes": stats.peak_memory_bytes,
        "max_concurrency": max_concurrency,
        "mean_batch_size": round(stats.mean_batch_size, 2),
        "ttft_p50_s": _round(stats.ttft_quantile(0.5)),
        "ttft_p95_s": _round(stats.ttft_quantile(0.95)),
        # Speculative decoding (speculate.py): verifying steps, tokens the rows guessed, and of
        # them the ones kept (each a token gained over one a row a step).
        "speculative_steps": stats.speculation.steps,
        "speculative_proposed_tokens": stats.speculation.proposed,
        "speculative_accepted_tokens": stats.speculation.accepted,
        "timeline": _thin(stats.timeline),
    }


def speculation_settings(config) -> dict:
    """What a run was asked to speculate with (EngineConfig's settings): the method, the draft
    model (for "draft") and the guesses a row (unless "off"). Whether a step speculated is
    measured as the job runs; the run's speculative_* figures say what it did."""
    method = config.speculate
    return {"method": method,
            "draft_model": config.draft_model if method == "draft" else None,
            "draft_tokens": config.draft_tokens if method != "off" else None}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _thin(points: list) -> list:
    step = max(1, len(points) // MAX_TIMELINE_POINTS)
    return [list(p) for p in points[::step]]


def build_report(manifest: dict, progress: Progress, rows_total: int, runs: list[dict],
                 device: str) -> dict:
    """report.json's content; `runs` ends with the latest start (see the module's docstring
    for what each figure means)."""
    runs = _with_committed_tokens(runs, progress)
    totals = {k: sum(r.get(k) or 0 for r in runs) for k in SUM_FIELDS}
    wall = max(totals["wall_s"], 1e-9)
    rows = sum(r["rows_done"] + r["rows_failed"] for r in runs) or 1
    return {
        "rows_total": rows_total,
        "rows_done": progress.rows_done,
        "rows_failed": progress.rows_failed,
        "rows_pending": max(0, rows_total - progress.rows_done - progress.rows_failed),
        "prompt_tokens": progress.prompt_tokens,
        "cached_prompt_tokens": progress.cached_tokens,
        "prompt_sources": _sources(progress, runs),
        "completion_tokens": progress.completion_tokens,
        "wall_s": round(totals["wall_s"], 3),
        # A run's rate times its time gives back its computed prompt tokens.
        "prefill_tokens_per_s": round(sum(r["prefill_tokens_per_s"] * r["prefill_time_s"]
                                          for r in runs) / totals["prefill_time_s"], 2)
        if totals["prefill_time_s"] else 0.0,
        "decode_tokens_per_s": round(totals["decode_tokens"] / totals["decode_time_s"], 2)
        if totals["decode_time_s"] else 0.0,
        "completion_tokens_per_s": round(sum(_generated(r) for r in runs) / wall, 2),
        "requests_per_s": round((totals["rows_done"] + totals["rows_failed"]) / wall, 3),
        "peak_memory_bytes": max((r["peak_memory_bytes"] for r in runs), default=0),
        "max_concurrency": max((r["max_concurrency"] for r in runs), default=0),
        "mean_batch_size": round(sum(r["mean_batch_size"] * r["decode_steps"] for r in runs)
                                 / totals["decode_steps"], 2) if totals["decode_steps"] else 0.0,
        # Across starts: the starts' quantiles weighted by their rows (an approximation).
        "ttft_p50_s": _weighted(runs, "ttft_p50_s", rows),
        "ttft_p95_s": _weighted(runs, "ttft_p95_s", rows),
        "speculative_steps": totals["speculative_steps"],
        "speculative_proposed_tokens": totals["speculative_proposed_tokens"],
        "speculative_accepted_tokens": totals["speculative_accepted_tokens"],
        "speculative_acceptance": round(totals["speculative_accepted_tokens"]
                                        / totals["speculative_proposed_tokens"], 4)
        if totals["speculative_proposed_tokens"] else None,
        "model": manifest["model"]["name"],
        "model_path": manifest["model"]["path"],
        "device": device,
        "batchrun_version": batchrun.__version__,
        "input": manifest["input"]["path"],
        "output": manifest["output"],
        "runs": runs,
    }


def _sources(progress: Progress, runs: list[dict]) -> dict:
    """Where the results' prompt tokens came from: computed, read from blocks in memory (this
    run computed them: a shared instruction, an earlier row's prompt), or from blocks a run
    before wrote to disk. The disk's share is the engine's count (rows it admitted)."""
    disk = min(progress.cached_tokens, sum(r.get("cached_disk_tokens") or 0 for r in runs))
    return {"computed": progress.prompt_tokens - progress.cached_tokens,
            "memory": progress.cached_tokens - disk, "disk": disk}


def _with_committed_tokens(runs: list[dict], progress: Progress) -> list[dict]:
    """The latest run's tokens: the job's committed tokens less the earlier runs'. (The
    engine's own counts take in rows that were never committed and leave out rows answered
    from an identical row.)"""
    if not runs:
        return runs
    job = {"prompt_tokens": progress.prompt_tokens,
           "cached_prompt_tokens": progress.cached_tokens,
           "completion_tokens": progress.completion_tokens}
    earlier = runs[:-1]
    last = {**runs[-1], **{k: v - sum(r.get(k) or 0 for r in earlier) for k, v in job.items()}}
    return [*earlier, last]


def _generated(run: dict) -> int:
    """Tokens the engine generated in a run (reports before generated_tokens: its rows')."""
    return run.get("generated_tokens", run.get("completion_tokens") or 0)


def _weighted(runs: list[dict], key: str, rows: int) -> float | None:
    pairs = [(r[key], r["rows_done"] + r["rows_failed"]) for r in runs if r.get(key) is not None]
    if not pairs:
        return None
    weight = sum(w for _, w in pairs) or len(pairs)
    return round(sum(v * (w or 1) for v, w in pairs) / weight, 4)


def previous_runs(job_dir: Path) -> list[dict]:
    """The earlier starts' figures; a damaged report.json (it is only a summary) is replaced."""
    try:
        report = read_json(Path(job_dir) / "report.json")
    except DamagedFile as e:
        log.warning("%s; the figures of earlier runs are lost (the results are not)", e)
        return []
    runs = report.get("runs") if report else None
    if not isinstance(runs, list):
        return []
    problems = [p for r in runs if (p := run_problem(r)) is not None]
    if problems:
        log.warning("%s: %d earlier run(s) damaged (first: %s); their figures are dropped (the "
                    "results are not)", Path(job_dir) / "report.json", len(problems),
                    problems[0])
    return [r for r in runs if run_problem(r) is None]


_SUMMARY_NUMBERS = ("peak_memory_bytes", "rows_done", "rows_failed", "rows_pending", "rows_total",
                    "prompt_tokens", "cached_prompt_tokens", "completion_tokens",
                    "completion_tokens_per_s", "requests_per_s", "wall_s",
                    "prefill_tokens_per_s", "decode_tokens_per_s", "mean_batch_size",
                    "max_concurrency")


def well_formed(report: dict) -> bool:
    """Whether a report.json has what `status` and `report` print and rebuild from."""
    return (all(type(report.get(k)) in (int, float) for k in _SUMMARY_NUMBERS)
            and isinstance(report.get("runs"), list) and isinstance(report.get("device"), str)
            and type(report.get("ttft_p50_s")) in (int, float, type(None)))


def write_report(job_dir: Path, report: dict, html_too: bool = True) -> None:
    """Write report.json, and with `html_too` (the final report) first add the records'
    figures to `report` (read from the files: seconds for a large output) and write
    report.html."""
    job_dir = Path(job_dir)
    if html_too:
        report.update(record_figures(job_dir, report["output"]))
    write_atomic(job_dir / "report.json", orjson.dumps(report, option=orjson.OPT_INDENT_2))
    if html_too:
        write_atomic(job_dir / "report.html", render_html(report).encode())
