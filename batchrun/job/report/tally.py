"""What the committed records hold, for the final report: report.json's `labels`,
`error_codes`, `token_lengths` and `expected`, counted one record at a time (memory grows
with the labels, error codes and distinct lengths, never with the rows).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from batchrun.io.jsonl import record_line
from batchrun.job.sink import Record
from batchrun.job.state import DamagedFile, JobState, Progress, read_json

log = logging.getLogger("batchrun")


ROWS_SHOWN = 5  # sample, least sure and disagreeing rows the report lists
CONFUSION_LABELS = 8  # expected labels and answers the confusion matrix has (the most rows)
LOW_CONFIDENCE = 0.5  # a labeled row whose highest choice probability is below this is unsure
# One label on at least this share of the labeled rows (of at least DOMINANT_MIN_ROWS, with two
# labels or more to choose from) is said: a prompt or model that answers one label whatever the
# row looks like a job that went well.
DOMINANT_SHARE = 0.9
DOMINANT_MIN_ROWS = 20
ERROR_EXAMPLES = 5  # rows listed for each error code
HISTOGRAM_BINS = 20  # at most, for token lengths


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
    """The ordered results and errors files, where spec.JobSpec puts them: a JSONL output is
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
    samples: list = field(default_factory=list)  # (index, row): the first labeled rows
    least_sure: list = field(default_factory=list)  # (top prob, index, row): the least sure
    disagreeing: list = field(default_factory=list)  # (index, row): answers not the expected
    confusion: Counter = field(default_factory=Counter)  # (expected, answer) -> rows
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
        index = record.get("index") if isinstance(record.get("index"), int) else math.inf
        top = max(probs.values()) if probs else None
        row = {"index": record.get("index"), "custom_id": record.get("custom_id"),
               "answer": label if label is not None else _short(text), "prob": top}
        expected = record.get("expected")
        if isinstance(expected, str):
            given = label if label is not None else text
            self.expected_rows += 1
            agrees = given is not None and given.strip() == expected.strip()
            self.agreeing_rows += agrees
            self.confusion[(expected.strip(), _short(given.strip()) if given else "")] += 1
            if not agrees:
                _keep_first(self.disagreeing, (index, {**row, "expected": expected}))
        if label is None:
            if self.labels is not None:
                self.unlabeled_rows += 1
            return
        self.label_rows[label] += 1
        _keep_first(self.samples, (index, row))
        if probs:
            self.scored_rows += 1
            for choice, p in probs.items():
                self.prob_sums[choice] += p
            if top < LOW_CONFIDENCE:
                self.label_low[label] += 1
            _keep_first(self.least_sure, (top, index, row))

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
        examples.append((index, {"line": record_line(record), "index": record.get("index"),
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
        answers, truths = Counter(), Counter()
        for (truth, given), n in self.confusion.items():
            answers[given] += n
            truths[truth] += n
        declared = list(self.labels or [])
        # The job's labels first (one never answered is a column of zeros), then the rest by
        # rows; the eight first of each.
        answer_axis = [*declared, *(a for a, _ in answers.most_common() if a not in declared)]
        truth_axis = [*(t for t in declared if t in truths),
                      *(t for t, _ in truths.most_common() if t not in declared)]
        answer_axis, truth_axis = answer_axis[:CONFUSION_LABELS], truth_axis[:CONFUSION_LABELS]
        return {"column": self.expected_column, "rows": rows, "agreeing_rows": self.agreeing_rows,
                "accuracy": round(self.agreeing_rows / rows, 4) if rows else None,
                "disagreeing": [r for _, r in self.disagreeing],
                "confusion_axes": {"expected": truth_axis, "answer": answer_axis},
                "confusion": [{"expected": truth, "answer": given, "rows": n}
                              for (truth, given), n in sorted(self.confusion.items())
                              if given in answer_axis and truth in truth_axis]}

    def _labels(self) -> dict | None:
        if self.labels is None and not self.label_rows:
            return None
        declared = self.labels or []
        others = [k for k, _ in self.label_rows.most_common() if k not in declared]
        scored = self.scored_rows
        total = sum(self.label_rows.values())
        dominant = None
        if self.label_rows and total >= DOMINANT_MIN_ROWS and len({*declared, *others}) >= 2:
            label, rows = self.label_rows.most_common(1)[0]
            if rows >= DOMINANT_SHARE * total:
                dominant = {"label": label, "rows": rows, "share": round(rows / total, 4)}
        return {
            "rows": total,
            "dominant": dominant,
            "unlabeled_rows": self.unlabeled_rows,
            "scored_rows": scored,
            "low_confidence_below": LOW_CONFIDENCE,
            "low_confidence_rows": sum(self.label_low.values()),
            "samples": [r for _, r in self.samples],
            "least_sure": [r for _, _, r in self.least_sure],
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


def _keep_first(kept: list, item: tuple, most: int = None) -> None:
    """Keep the `most` smallest items (by their leading keys) of those seen."""
    most = ROWS_SHOWN if most is None else most
    if len(kept) == most and item[:-1] >= kept[-1][:-1]:
        return
    kept.append(item)
    kept.sort(key=lambda x: x[:-1])
    del kept[most:]


def _short(text: str | None, most: int = 80) -> str | None:
    """An answer as the report shows it: one line, cut short."""
    if text is None:
        return None
    line = " ".join(text.split())
    return line if len(line) <= most else line[: most - 1] + "…"


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
