"""report.json (figures for the whole job and for each start of it) and a self-contained
report.html: plots of throughput and batch size over time and, in the final report, what the
committed records hold (labels, row errors, prompt and completion lengths).

report.json keeps raw machine numbers (bytes, seconds, tokens per second); the page and
`summary_text` put them in units a person reads (`human_bytes`, `human_seconds`, `human_rate`).

What the figures mean. The job (top level):
- rows_done, rows_failed, rows_pending: rows with a committed result / error record, and the
  rest of rows_total (state.json's progress: what the output holds).
- prompt_tokens, cached_prompt_tokens, completion_tokens: the usage of those result records.
- wall_s: the runs' wall times added up (model loading not included).
- completion_tokens_per_s: tokens the engine generated per second of wall time (the runs'
  generated_tokens over their wall_s); requests_per_s: rows committed per second of wall time.
- prefill_tokens_per_s, decode_tokens_per_s: the engine's rates while it prefilled prompts
  (cached tokens excluded) and while it only decoded; mean_batch_size: running sequences per
  decode step; TTFT quantiles: the runs' weighted by their rows (an approximation).
- speculative_steps, speculative_proposed_tokens, speculative_accepted_tokens (also per run),
  speculative_acceptance: speculative decoding's verifying steps, the tokens rows guessed in
  them, the guesses kept (each one a token gained over a token a row a step) and their share.
- labels, error_codes, token_lengths: read from the records (`record_figures`) when the final
  report is written (or by `batchrun report`); absent from the reports written mid-run.
- expected: with --expected-column, the column, the results with an `expected` answer (rows),
  those whose answer (its label, else its text, both stripped) is it (agreeing_rows) and their
  share (accuracy); error records are not results and count in neither.

A run (one start of the job, in `runs`):
- speculation: the settings it ran with: method ("off", "ngram" or "draft"), draft_model and
  draft_tokens (the guesses a row); a resumed job's runs may differ.
- rows_done, rows_failed: the rows this run committed; prompt_tokens, cached_prompt_tokens,
  completion_tokens: those rows' usage (the job's tokens less the earlier runs').
- generated_tokens: what the engine generated in the run, rows it had not finished included (an
  interrupted run's lost work) and rows answered from an identical row left out;
  completion_tokens_per_s = generated_tokens / wall_s, its real rate however it ended.

So the job's rows and tokens are the sums of its runs'. A run killed (SIGKILL) between a commit
and that commit's report keeps the rows of its previous report, and the next run's tokens take
in the tokens of the rows it missed.
"""

from __future__ import annotations

import html
import itertools
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

import batchrun
from batchrun.engine.request import EngineStats
from batchrun.job.listing import run_problem
from batchrun.job.sink import Record
from batchrun.job.state import DamagedFile, JobState, Progress, read_json, write_atomic

log = logging.getLogger("batchrun")
MAX_TIMELINE_POINTS = 1500
SUM_FIELDS = ("wall_s", "rows_done", "rows_failed", "prompt_tokens", "cached_prompt_tokens",
              "completion_tokens", "prefill_time_s", "decode_time_s", "decode_tokens",
              "decode_steps", "speculative_steps", "speculative_proposed_tokens",
              "speculative_accepted_tokens")
LOW_CONFIDENCE = 0.5  # a labeled row whose highest choice probability is below this is unsure
ERROR_EXAMPLES = 5  # rows listed for each error code
HISTOGRAM_BINS = 20  # at most, for token lengths
LABELS_SHOWN = 40  # rows of the page's label table (report.json has them all)
LABELS_SAID = 8  # labels the printed summary names


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


# -- what the records hold ---------------------------------------------------------------------

def record_figures(job_dir: Path, output: str) -> dict:
    """report.json's `labels`, `error_codes` and `token_lengths`, from the committed records:
    the ordered results and errors files up to the sizes state.json records, and the spilled
    rows past its frontier. Streamed: memory grows with the labels, error codes and distinct
    lengths, never with the rows. Unreadable job files give empty figures and a warning."""
    job_dir = Path(job_dir)
    try:
        manifest = read_json(job_dir / "job.json") or {}
        results, errors = record_paths(job_dir, manifest, output)
        state = JobState(job_dir, results, errors)
        progress = state.saved() or Progress()
        tally = RecordTally(*job_labels(manifest),
                            expected_column=manifest.get("options", {}).get("expected_column"))
        for line in committed_lines(results, progress.results_bytes):
            tally.add(line, is_error=False)
        for line in committed_lines(errors, progress.errors_bytes):
            tally.add(line, is_error=True)
        spilled: set[int] = set()  # the spill may still hold rows now in the ordered files
        for raw in committed_lines(state.spill_path, progress.spill_bytes):
            record = Record.from_spill(raw)
            if record.index >= progress.next_index and record.index not in spilled:
                spilled.add(record.index)
                tally.add(record.line, record.is_error)
    except (OSError, DamagedFile, ValueError, TypeError, KeyError, AttributeError) as e:
        # The report is only a summary: a surprise in a file never fails the job's last commit.
        log.warning("the report's record figures are left out: %s", e)
        tally = RecordTally()
    return tally.figures()


def record_paths(job_dir: Path, manifest: dict, output: str) -> tuple[Path, Path]:
    """The ordered results and errors files, where runner.JobSpec puts them: a JSONL output is
    the results file, a Parquet output keeps its records in the job folder. job.json's output
    is relative to the job folder (it follows a moved folder), `output` is the fallback."""
    saved = manifest.get("options", {}).get("output")
    out = Path(os.path.normpath(job_dir / saved)) if isinstance(saved, str) else Path(output)
    results = job_dir / "results.jsonl" if out.suffix.lower() == ".parquet" else out
    return results, job_dir / "errors.jsonl"


def committed_lines(path: Path, size: int) -> Iterator[bytes]:
    """The lines in the first `size` bytes of a file (what a commit made durable)."""
    if size <= 0:
        return
    with open(path, "rb") as f:
        left = size
        for line in f:
            yield line[:left]
            left -= len(line)
            if left <= 0:
                return


def job_labels(manifest: dict) -> tuple[list[str] | None, bool]:
    """The job's labels (`--choices`, or a JSON schema that is an enum) and whether answers
    are JSON (a schema's) rather than the bare choice."""
    constraint = manifest.get("options", {}).get("sampling", {}).get("constraint") or {}
    if constraint.get("kind") == "choices":
        return [str(c) for c in constraint["value"]], False
    if constraint.get("kind") == "json_schema":
        try:
            schema = orjson.loads(constraint["value"])
        except orjson.JSONDecodeError:
            return None, False
        if isinstance(schema, dict) and isinstance(schema.get("enum"), list):
            return [_label(v) for v in schema["enum"]], True
    return None, False


def _label(value: object) -> str:
    return value if isinstance(value, str) else orjson.dumps(value).decode()


def answer(record: dict) -> tuple[str | None, dict | None, dict]:
    """A result record's (first) answer text, its choice probabilities and its usage, for
    batchrun's own lines and OpenAI batch lines."""
    if "response" not in record:
        return record.get("text"), record.get("choice_probs"), record.get("usage") or {}
    body = (record.get("response") or {}).get("body") or {}
    first = (body.get("choices") or [{}])[0]
    text = (first.get("message") or {}).get("content", first.get("text"))
    return text, first.get("choice_probs"), body.get("usage") or {}


@dataclass(slots=True)
class RecordTally:
    """Counts made one record at a time."""

    labels: list[str] | None = None  # the job's declared labels, in their order
    json_answers: bool = False  # an enum schema's answers are JSON strings
    label_rows: Counter = field(default_factory=Counter)
    label_low: Counter = field(default_factory=Counter)  # rows with the label, unsure
    prob_sums: Counter = field(default_factory=Counter)  # label -> sum of its choice prob
    scored_rows: int = 0  # rows with choice probabilities
    expected_column: str | None = None  # --expected-column
    expected_rows: int = 0  # results with an `expected` answer
    agreeing_rows: int = 0  # of them, those whose answer (its label, or its text) is it
    unlabeled_rows: int = 0  # results of a labeling job whose answer is no label
    codes: dict = field(default_factory=dict)  # code -> [rows, examples sorted by index]
    prompt_lengths: Counter = field(default_factory=Counter)
    completion_lengths: Counter = field(default_factory=Counter)

    def add(self, line: bytes, is_error: bool) -> None:
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            return  # a committed line parses (recovery checks it); never fail a report on one
        if not isinstance(record, dict):
            return
        if is_error:
            self._add_error(record)
        else:
            self._add_result(record)

    def _add_result(self, record: dict) -> None:
        text, probs, usage = answer(record)
        self.prompt_lengths[int(usage.get("prompt_tokens") or 0)] += 1
        self.completion_lengths[int(usage.get("completion_tokens") or 0)] += 1
        label = self._label_of(text, probs)
        expected = record.get("expected")
        if isinstance(expected, str):
            given = label if label is not None else text
            self.expected_rows += 1
            self.agreeing_rows += given is not None and given.strip() == expected.strip()
        if label is None:
            if self.labels is not None:
                self.unlabeled_rows += 1
            return
        self.label_rows[label] += 1
        if probs:
            self.scored_rows += 1
            for choice, p in probs.items():
                self.prob_sums[choice] += p
            if max(probs.values()) < LOW_CONFIDENCE:
                self.label_low[label] += 1

    def _label_of(self, text: str | None, probs: dict | None) -> str | None:
        if text is None:
            return None
        if probs:  # a choices row (the job's choices or the row's own)
            return text
        if self.json_answers:
            try:
                label = _label(orjson.loads(text))
            except orjson.JSONDecodeError:
                return None
            return label if label in self.labels else None
        return text if self.labels is not None and text in self.labels else None

    def _add_error(self, record: dict) -> None:
        error = record.get("error") or {}
        code = str(error.get("code") or "unknown")
        entry = self.codes.setdefault(code, [0, []])
        entry[0] += 1
        examples = entry[1]
        index = record.get("index") if isinstance(record.get("index"), int) else math.inf
        if len(examples) == ERROR_EXAMPLES and index >= examples[-1][0]:
            return
        examples.append((index, {"line": record.get("line"), "index": record.get("index"),
                                 "custom_id": record.get("custom_id"),
                                 "message": error.get("message")}))
        examples.sort(key=lambda pair: pair[0])  # spilled rows come after the ordered ones
        del examples[ERROR_EXAMPLES:]

    def figures(self) -> dict:
        return {"labels": self._labels(), "error_codes": self._error_codes(),
                "token_lengths": {"prompt": histogram(self.prompt_lengths),
                                  "completion": histogram(self.completion_lengths)},
                "expected": self._expected()}

    def _expected(self) -> dict | None:
        """--expected-column: results with a right answer, and those whose answer is it."""
        if self.expected_column is None and not self.expected_rows:
            return None
        rows = self.expected_rows
        return {"column": self.expected_column, "rows": rows, "agreeing_rows": self.agreeing_rows,
                "accuracy": round(self.agreeing_rows / rows, 4) if rows else None}

    def _labels(self) -> dict | None:
        if self.labels is None and not self.label_rows:
            return None
        declared = self.labels or []
        others = [k for k, _ in self.label_rows.most_common() if k not in declared]
        scored = self.scored_rows
        return {
            "rows": sum(self.label_rows.values()),
            "unlabeled_rows": self.unlabeled_rows,
            "scored_rows": scored,
            "low_confidence_below": LOW_CONFIDENCE,
            "low_confidence_rows": sum(self.label_low.values()),
            "per_label": [{"label": label, "rows": self.label_rows[label],
                           "mean_prob": round(self.prob_sums[label] / scored, 4)
                           if scored else None,
                           "low_confidence_rows": self.label_low[label]}
                          for label in [*declared, *others]],
        }

    def _error_codes(self) -> list[dict]:
        ranked = sorted(self.codes.items(), key=lambda kv: (-kv[1][0], kv[0]))
        return [{"code": code, "rows": rows, "first": [example for _, example in examples]}
                for code, (rows, examples) in ranked]


def histogram(counts: Counter) -> dict:
    """Bins of whole token counts, `from` and `to` both included: 1, 2 or 5 × 10^k wide
    (at most HISTOGRAM_BINS of them), the first and last cut to the values seen; and the
    figures a reader asks for first."""
    if not counts:
        return {"rows": 0, "min": None, "max": None, "mean": None, "p50": None, "p95": None,
                "bins": []}
    lo, hi = min(counts), max(counts)
    width = next(w for w in (m * 10**k for k in itertools.count() for m in (1, 2, 5))
                 if (hi - lo + lo % w) // w < HISTOGRAM_BINS)
    start = lo - lo % width
    rows = [0] * ((hi - start) // width + 1)
    for value, n in counts.items():
        rows[(value - start) // width] += n
    total = sum(rows)
    return {
        "rows": total, "min": lo, "max": hi,
        "mean": round(sum(v * n for v, n in counts.items()) / total, 1),
        "p50": _quantile(counts, total, 0.5), "p95": _quantile(counts, total, 0.95),
        "bins": [{"from": max(lo, start + i * width),
                  "to": min(hi, start + (i + 1) * width - 1), "rows": n}
                 for i, n in enumerate(rows)],
    }


def _quantile(counts: Counter, total: int, q: float) -> int:
    """As EngineStats.ttft_quantile: the value at position int(q * n) of the sorted values."""
    position = min(total - 1, int(q * total))
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen > position:
            return value
    return max(counts)


# -- in words ----------------------------------------------------------------------------------

def human_bytes(n: float) -> str:
    """1,023 B; 29.4 MiB; 1.50 GiB."""
    if n < 1024:
        return f"{n:,.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1024 or unit == "PiB":
            return f"{n:.2f} {unit}" if n < 10 else f"{n:,.1f} {unit}"
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    """273 ms; 1.98 s; 46.1 s; 22 min 30 s; 3 h 05 min."""
    if s < 0.9995:
        return f"{s * 1000:.0f} ms"
    if s < 9.995:
        return f"{s:.2f} s"
    if s < 59.95:
        return f"{s:.1f} s"
    whole = round(s)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    minutes = round(s / 60)
    return f"{minutes // 60:,} h {minutes % 60:02d} min"


def human_rate(x: float) -> str:
    """A per-second figure with the precision it deserves: 4,047; 42.5; 0.52."""
    if x == 0:
        return "0"
    if x >= 99.95:
        return f"{x:,.0f}"
    if x >= 9.995:
        return f"{x:.1f}"
    if x >= 0.01:
        return f"{x:.2f}"
    return f"{x:.1e}"


def accuracy_text(expected: dict) -> str:
    column = f" ({expected['column']})" if expected.get("column") else ""
    if not expected["rows"]:
        return f"no result has an expected answer{column}: is the column there?"
    return (f"{expected['agreeing_rows']:,} of {expected['rows']:,} results are the expected "
            f"answer{column}: {expected['accuracy']:.1%}")


def _speculation_text(report: dict) -> str:
    """The summary's speculation line: what was asked (the runs' settings, or that they
    differ) and the guesses kept, over every run of the job."""
    asked = {tuple(r["speculation"].get(k) for k in ("method", "draft_model", "draft_tokens")):
             r["speculation"] for r in report.get("runs") or []
             if (r.get("speculation") or {}).get("method", "off") != "off"}
    how = " (the runs' settings differ: report.json's runs)" if len(asked) > 1 else ""
    if len(asked) == 1:
        (one,) = asked.values()
        how = {"draft": f" (draft model {one.get('draft_model')}, "
                        f"{one.get('draft_tokens')} guesses a row)",
               "ngram": f" (prompt lookup, {one.get('draft_tokens')} guesses a row)"}.get(
            one.get("method"), "")
    proposed = report["speculative_proposed_tokens"]
    kept, steps = report["speculative_accepted_tokens"], report["speculative_steps"]
    if not proposed:
        return (f"speculation{how}: nothing to guess in {steps:,} step"
                f"{'s' if steps != 1 else ''}")
    return (f"speculation{how}: {kept:,} of {proposed:,} guessed tokens kept "
            f"({kept / proposed:.0%}): {kept:,} tokens gained in {steps:,} steps")


def summary_text(report: dict) -> str:
    ttft = report["ttft_p50_s"]
    runs = len(report["runs"])
    lines = [
        f"rows:       {report['rows_done']:,} done, {report['rows_failed']:,} failed, "
        f"{report['rows_pending']:,} pending of {report['rows_total']:,}",
        f"tokens:     {report['prompt_tokens']:,} prompt ({report['cached_prompt_tokens']:,} "
        f"cached), {report['completion_tokens']:,} completion",
        f"throughput: {human_rate(report['completion_tokens_per_s'])} tok/s generated, "
        f"{human_rate(report['requests_per_s'])} rows/s over "
        f"{human_seconds(report['wall_s'])} in {runs} run{'s' if runs != 1 else ''}",
        f"engine:     prefill {human_rate(report['prefill_tokens_per_s'])} tok/s, decode "
        f"{human_rate(report['decode_tokens_per_s'])} tok/s, mean batch "
        f"{report['mean_batch_size']:.1f} (max {report['max_concurrency']:,}), peak memory "
        f"{human_bytes(report['peak_memory_bytes'])}"
        + (f", TTFT p50 {human_seconds(ttft)}" if ttft is not None else ""),
    ]
    if report.get("speculative_steps"):
        lines.append(_speculation_text(report))
    labels = report.get("labels")
    if labels and labels["rows"]:
        shares = ", ".join(f"{x['label']} {x['rows']:,} ({x['rows'] / labels['rows']:.0%})"
                           for x in labels["per_label"][:LABELS_SAID])
        more = len(labels["per_label"]) - LABELS_SAID
        lines.append(f"labels:     {shares}" + (f", {more:,} more" if more > 0 else "")
                     + (f"; {labels['low_confidence_rows']:,} unsure (top choice under "
                        f"{labels['low_confidence_below']:.0%})" if labels["scored_rows"] else ""))
    expected = report.get("expected")
    if expected:
        lines.append(f"accuracy:   {accuracy_text(expected)}")
    if report.get("error_codes"):
        lines.append("row errors: " + ", ".join(f"{e['code']} {e['rows']:,}"
                                                for e in report["error_codes"]))
    return "\n".join(lines)


# -- HTML ------------------------------------------------------------------------------------

W, H, LEFT, BOTTOM, TOP, RIGHT = 760, 200, 64, 30, 26, 14  # the time charts' frame (px)


def _series(runs: list[dict]) -> tuple[list[tuple[float, float]], list[tuple[float, float]],
                                       list[float]]:
    """(time, tokens/s) and (time, batch size) across all starts laid end to end, and the
    times where a start after the first begins."""
    rate, batch, starts = [], [], []
    offset = 0.0
    for run in runs:
        points = run.get("timeline") or []
        if offset:
            starts.append(offset)
        for (t0, _, c0, _), (t1, _, c1, b1) in zip(points, points[1:], strict=False):
            if t1 > t0:
                rate.append((offset + t1, (c1 - c0) / (t1 - t0)))
                batch.append((offset + t1, b1))
        offset += run.get("wall_s") or (points[-1][0] if points else 0)
    return rate, batch, starts


def _step(top: float, most: int) -> float:
    """A 1, 2, 2.5 or 5 × 10^k step that splits [0, top] in at most `most` parts."""
    top = max(top, 1e-9)
    scale = 10 ** math.floor(math.log10(top / most))
    return next(m * scale for m in (1, 2, 2.5, 5, 10) if top / (m * scale) <= most)


def _tick(v: float) -> str:
    return f"{v:,.0f}" if v == int(v) else f"{v:g}"


def _time_step(top: float) -> float:
    """A step for a time axis, in seconds, minutes or hours that a clock shows."""
    steps = (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200,
             10800, 21600)
    return next((s for s in steps if top / s <= 6), _step(top, 6))


def _time_tick(s: float) -> str:
    if s < 60:
        return f"{s:g} s"
    if s < 3600:
        return f"{s / 60:g} min"
    return f"{s / 3600:g} h"


def _svg_chart(points: list[tuple[float, float]], title: str, unit: str, color: str,
               starts: list[float]) -> str:
    if not points:
        return f'<p class="empty">{html.escape(title)}: no samples</p>'
    x_max = max(p[0] for p in points)
    x_step = _time_step(x_max)
    y_top = max(max(p[1] for p in points), 1)
    y_step = _step(y_top * 1.05, 5)
    y_max = y_step * math.ceil(y_top / y_step)
    sx = lambda x: LEFT + (W - LEFT - RIGHT) * x / x_max  # noqa: E731
    sy = lambda y: TOP + (H - TOP - BOTTOM) * (1 - y / y_max)  # noqa: E731
    parts = [f'<text x="{LEFT}" y="14" class="title">{html.escape(title)} '
             f'<tspan class="unit">({html.escape(unit)})</tspan></text>']
    for i in range(round(y_max / y_step) + 1):
        y = sy(i * y_step)
        parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'class="grid"/><text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{_tick(i * y_step)}</text>')
    for i in range(math.floor(x_max / x_step + 1e-9) + 1):
        parts.append(f'<text x="{sx(i * x_step):.1f}" y="{H - 10}" text-anchor="middle">'
                     f'{_time_tick(i * x_step)}</text>')
    for n, t in enumerate(starts, 2):
        parts.append(f'<line x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{TOP}" y2="{H - BOTTOM}" '
                     f'class="restart"/><text x="{sx(t) + 4:.1f}" y="{TOP + 10}" '
                     f'class="note">run {n}</text>')
    path = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}"
                    for i, (x, y) in enumerate(points))
    parts.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="1.8"/>')
    if len(points) < 4:
        parts.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>'
                     for x, y in points)
    return (f'<svg viewBox="0 0 {W} {H}" role="img" aria-label="{html.escape(title)}">'
            + "".join(parts) + "</svg>")


def _svg_histogram(hist: dict, title: str, color: str) -> str:
    """Bars of rows per length bin, the median and p95 in words above them."""
    w, h, left, bottom, top = 380, 190, 50, 34, 40
    if not hist["rows"]:
        return f'<p class="empty">{html.escape(title)}: no rows</p>'
    head = f'<text x="{left}" y="14" class="title">{html.escape(title)}</text>'
    if hist["min"] == hist["max"]:
        return (f'<svg viewBox="0 0 {w} 40" role="img" aria-label="{html.escape(title)}">'
                f'{head}<text x="{left}" y="32">every row: {hist["min"]:,} tokens</text></svg>')
    head += (f'<text x="{left}" y="30" class="note">median {hist["p50"]:,} · p95 '
             f'{hist["p95"]:,} · max {hist["max"]:,} tokens</text>')
    bins = hist["bins"]
    y_step = math.ceil(_step(max(b["rows"] for b in bins) * 1.05, 4))  # whole rows
    y_max = y_step * max(1, math.ceil(max(b["rows"] for b in bins) / y_step))
    slot = (w - left - 10) / len(bins)
    sy = lambda y: top + (h - top - bottom) * (1 - y / y_max)  # noqa: E731
    parts = [head]
    for i in range(round(y_max / y_step) + 1):
        y = sy(i * y_step)
        parts.append(f'<line x1="{left}" x2="{w - 10}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                     f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{_tick(i * y_step)}</text>')
    single = all(b["from"] == b["to"] for b in bins)
    every = math.ceil(len(bins) / 5)  # label about five bins, the last one among them
    labeled, last = list(range(0, len(bins), every)), len(bins) - 1
    if labeled[-1] != last:
        if last - labeled[-1] < every / 2:  # too close to the last bin's label
            labeled.pop()
        labeled.append(last)
    for i, b in enumerate(bins):
        x = left + i * slot
        parts.append(f'<rect x="{x + 1:.1f}" y="{sy(b["rows"]):.1f}" width="{slot - 2:.1f}" '
                     f'height="{sy(0) - sy(b["rows"]):.1f}" fill="{color}">'
                     f'<title>{_span(b)} tokens: {b["rows"]:,} rows</title></rect>')
        if i in labeled:  # a one-value bin under its bar, a wider one at its lower edge
            at = x + slot / 2 if single else x
            parts.append(f'<text x="{at:.1f}" y="{h - bottom + 14}" text-anchor="middle">'
                         f'{b["from"]:,}</text>')
    parts.append(f'<text x="{(left + w) / 2:.0f}" y="{h - 4}" text-anchor="middle" '
                 f'class="note">tokens per row</text>')
    return (f'<svg viewBox="0 0 {w} {h}" role="img" aria-label="{html.escape(title)}">'
            + "".join(parts) + "</svg>")


def _span(b: dict) -> str:
    return f"{b['from']:,}" if b["from"] == b["to"] else f"{b['from']:,}–{b['to']:,}"


def _bar(share: float, color: str = "#1f77b4") -> str:
    return (f'<svg class="bar" viewBox="0 0 160 12"><rect width="160" height="12" '
            f'fill="#f0f0f0"/><rect width="{160 * share:.1f}" height="12" fill="{color}"/></svg>')


def _expected_section(expected: dict | None) -> str:
    if not expected:
        return ""
    return f'<h2>Accuracy</h2><p>{html.escape(accuracy_text(expected))}</p>'


def _labels_section(labels: dict | None) -> str:
    if labels is None:
        return ""
    total, scored = labels["rows"], labels["scored_rows"]
    if not total:
        return '<h2>Labels</h2><p class="empty">No row has a label for an answer.</p>'
    threshold = f"{labels['low_confidence_below']:.0%}"
    rows = []
    for x in labels["per_label"][:LABELS_SHOWN]:
        share = x["rows"] / total
        mean = "" if x["mean_prob"] is None else f"{x['mean_prob']:.2f}"
        unsure = f"{x['low_confidence_rows']:,}" if scored else ""
        rows.append(f'<tr><td class="label">{html.escape(x["label"])}</td>'
                    f'<td class="num">{x["rows"]:,}</td><td class="num">{share:.1%}</td>'
                    f'<td>{_bar(share)}</td><td class="num">{mean}</td>'
                    f'<td class="num">{unsure}</td></tr>')
    more = len(labels["per_label"]) - LABELS_SHOWN
    if more > 0:
        rows.append(f'<tr><td colspan="6" class="note">and {more:,} more labels (in '
                    f'report.json)</td></tr>')
    notes = [f"{total:,} labeled rows"]
    low = labels["low_confidence_rows"]
    if scored:
        notes.append(f"{low:,} of them ({low / scored:.1%}) unsure" if low else "none unsure")
    if labels["unlabeled_rows"]:
        notes.append(f"{labels['unlabeled_rows']:,} results that are no label")
    legend = (f"<p class=\"note\">mean prob: the label's choice probability averaged over the "
              f"{scored:,} scored rows; unsure: rows of the label whose most likely choice has "
              f"less than {threshold}.</p>" if scored else "")
    return (f'<h2>Labels</h2><p>{"; ".join(notes)}.</p>'
            '<table><tr><th>label</th><th class="num">rows</th><th class="num">share</th>'
            '<th></th><th class="num">mean prob</th><th class="num">unsure</th></tr>'
            f'{"".join(rows)}</table>{legend}')


def _errors_section(codes: list[dict] | None, rows_failed: int) -> str:
    if codes is None:
        return ""
    if not codes:
        return "<h2>Row errors</h2><p>None: every row has a result.</p>"
    rows = []
    for e in codes:
        where = ", ".join(_where(x) for x in e["first"])
        if e["rows"] > len(e["first"]):
            where += ", …"
        message = next((x["message"] for x in e["first"] if x["message"]), "")
        rows.append(f'<tr><td><code>{html.escape(e["code"])}</code></td>'
                    f'<td class="num">{e["rows"]:,}</td><td>{html.escape(where)}</td>'
                    f'<td class="message">{html.escape(message)}</td></tr>')
    return (f"<h2>Row errors</h2><p>{rows_failed:,} rows have an error record "
            "(errors.jsonl).</p><table><tr><th>code</th><th class=\"num\">rows</th>"
            f"<th>first rows</th><th>first message</th></tr>{''.join(rows)}</table>")


def _where(example: dict) -> str:
    """Line 4 (rev-0003): where a person finds the row in the input."""
    at = (f"line {example['line']:,}" if isinstance(example.get("line"), int)
          else f"row {example['index'] + 1:,}" if isinstance(example.get("index"), int)
          else "row ?")
    custom_id = example.get("custom_id")
    if custom_id in (None, "", str(example.get("index"))):  # no id: the row's index stands in
        return at
    return f"{at} ({custom_id})"


def _lengths_section(lengths: dict | None) -> str:
    if lengths is None or not lengths["prompt"]["rows"]:
        return ""
    return ('<h2>Lengths</h2><div class="pair">'
            f'<div>{_svg_histogram(lengths["prompt"], "Prompt tokens", "#2ca02c")}</div>'
            f'<div>{_svg_histogram(lengths["completion"], "Completion tokens", "#9467bd")}'
            "</div></div>")


def _runs_table(runs: list[dict]) -> str:
    rows = []
    for i, r in enumerate(runs):
        status = r["status"]
        if status == "running" and i < len(runs) - 1:
            status = "killed"  # its last report was written mid-run
        rows.append(
            f'<tr><td>{i + 1}</td><td>{html.escape(r["started"][:19].replace("T", " "))}</td>'
            f'<td>{html.escape(status)}</td><td class="num">{r["rows_done"]:,}</td>'
            f'<td class="num">{r["rows_failed"]:,}</td>'
            f'<td class="num">{human_seconds(r["wall_s"])}</td>'
            f'<td class="num">{human_rate(r["completion_tokens_per_s"])}</td>'
            f'<td class="num">{human_rate(r["requests_per_s"])}</td>'
            f'<td class="num">{r["mean_batch_size"]:.1f}</td>'
            f'<td class="num">{human_bytes(r["peak_memory_bytes"])}</td>'
            f'{_speculation_cell(r)}</tr>')
    return ('<table class="runs"><tr><th>#</th><th>started</th><th>status</th>'
            '<th class="num">done</th><th class="num">failed</th><th class="num">wall</th>'
            '<th class="num" title="generated tokens per second">tok/s</th>'
            '<th class="num">rows/s</th><th class="num" title="mean batch size">batch</th>'
            '<th class="num" title="peak memory">memory</th>'
            '<th title="method, guesses a row, share of guesses kept">speculation</th></tr>'
            f'{"".join(rows)}</table>')


def _speculation_cell(run: dict) -> str:
    """A run's speculation settings and the share of its guesses kept (its draft model in the
    cell's title); a dash for runs of a batchrun that did not record them."""
    asked = run.get("speculation") or {}
    method = asked.get("method")
    if method in (None, "off"):
        return f"<td>{method or '–'}</td>"
    proposed = run.get("speculative_proposed_tokens") or 0
    kept = f", {run['speculative_accepted_tokens'] / proposed:.0%} kept" if proposed else ""
    title = f' title="{html.escape(str(asked.get("draft_model")))}"' if method == "draft" else ""
    text = f"{method} {asked.get('draft_tokens')}{kept}"
    return f"<td{title}>{html.escape(text)}</td>"


def _count(v) -> str:
    return f"{v:,}"


def _maybe_seconds(v) -> str:
    return "–" if v is None else human_seconds(v)


# report.json's figures as the page lists them: key, words, how to write the value.
FIGURES = (
    ("rows_total", "rows in the input", _count),
    ("rows_done", "rows with a result", _count),
    ("rows_failed", "rows with an error", _count),
    ("rows_pending", "rows still to run", _count),
    ("prompt_tokens", "prompt tokens (of the results)", _count),
    ("cached_prompt_tokens", "of which read from the prefix cache", _count),
    ("completion_tokens", "completion tokens (of the results)", _count),
    ("wall_s", "wall time (all runs)", human_seconds),
    ("completion_tokens_per_s", "generated tokens per second", human_rate),
    ("requests_per_s", "rows per second", human_rate),
    ("prefill_tokens_per_s", "prefill tokens per second (engine)", human_rate),
    ("decode_tokens_per_s", "decode tokens per second (engine)", human_rate),
    ("mean_batch_size", "mean batch size", lambda v: f"{v:.1f}"),
    ("max_concurrency", "largest batch allowed", _count),
    ("speculative_accepted_tokens", "tokens gained by speculative decoding", _count),
    ("speculative_acceptance", "share of guessed tokens kept",
     lambda v: "-" if v is None else f"{v:.0%}"),
    ("peak_memory_bytes", "peak memory", human_bytes),
    ("ttft_p50_s", "time to first token, median", _maybe_seconds),
    ("ttft_p95_s", "time to first token, p95", _maybe_seconds),
    ("model", "model", str),
    ("model_path", "model path", str),
    ("device", "device", str),
    ("batchrun_version", "batchrun version", str),
    ("input", "input", str),
    ("output", "output", str),
)


def _figures_table(report: dict) -> str:
    rows = "".join(
        f'<tr><td>{html.escape(words)} <span class="key">{key}</span></td>'
        f'<td>{html.escape(write(report[key]))}</td></tr>'
        for key, words, write in FIGURES if key in report)
    return f"<table>{rows}</table>"


STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 860px;
       padding: 0 16px; color: #222; }
h1 { font-size: 20px; margin-bottom: 2px; } h2 { font-size: 16px; margin-top: 30px; }
.sub { color: #666; margin: 0 0 18px; }
table { border-collapse: collapse; width: 100%; }
td, th { border-bottom: 1px solid #e4e4e4; padding: 3px 8px; text-align: left;
         vertical-align: top; }
th { font-weight: 600; } .num { text-align: right; font-variant-numeric: tabular-nums; }
td.label { font-weight: 600; word-break: break-word; } td.message { color: #555; }
svg { width: 100%; height: auto; font-size: 11px; fill: #555; }
svg.bar { width: 160px; height: 12px; vertical-align: middle; }
.grid { stroke: #eee; } .title { font-weight: 600; font-size: 12px; fill: #222; }
.unit, .note { fill: #777; font-weight: 400; } .restart { stroke: #999; stroke-dasharray: 4 3; }
p.note, td.note { color: #777; } .key { color: #999; font-size: 12px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px 32px; }
.big { font-size: 26px; font-weight: 600; font-variant-numeric: tabular-nums; }
.pair { display: flex; gap: 24px; } .pair > div { flex: 1; min-width: 0; }
p.empty { color: #777; } table.runs td { white-space: nowrap; }
"""


def _over_time(runs: list[dict]) -> str:
    rate, batch, starts = _series(runs)
    if not rate and not batch:
        return '<p class="empty">No samples: no row reached the engine.</p>'
    return (_svg_chart(rate, "Generated tokens per second", "tok/s", "#1f77b4", starts)
            + _svg_chart(batch, "Running sequences", "batch size", "#d62728", starts))


def render_html(report: dict) -> str:
    runs = report["runs"]
    last = runs[-1]["status"] if runs else "not run"
    failed = report["rows_failed"]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>batchrun report</title>
<style>{STYLE}</style></head><body>
<h1>batchrun report: {html.escape(Path(report['input']).name)}</h1>
<p class="sub">{html.escape(report['model'])} on {html.escape(report['device'])} ·
{len(runs)} run{'s' if len(runs) != 1 else ''}, the last {html.escape(last)} ·
batchrun {html.escape(report['batchrun_version'])}</p>
<div class="cards">
<div><div class="big">{report['rows_done']:,} / {report['rows_total']:,}</div>rows done{
    f" ({failed:,} failed)" if failed else ""}</div>
<div><div class="big">{human_rate(report['completion_tokens_per_s'])}</div>generated tokens/s
</div>
<div><div class="big">{human_rate(report['requests_per_s'])}</div>rows/s</div>
<div><div class="big">{human_seconds(report['wall_s'])}</div>wall time</div>
<div><div class="big">{human_bytes(report['peak_memory_bytes'])}</div>peak memory</div>
</div>
{_labels_section(report.get('labels'))}{_expected_section(report.get('expected'))}
{_errors_section(report.get('error_codes'), failed)}
{_lengths_section(report.get('token_lengths'))}
<h2>Over time</h2>
{_over_time(report["runs"])}
<h2>Runs</h2>
{_runs_table(runs)}
<h2>All figures</h2>
{_figures_table(report)}
</body></html>
"""
