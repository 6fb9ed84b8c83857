"""report.html: one self-contained page (inline SVG and CSS, nothing fetched) with plots of
throughput and batch size over time and, in the final report, what the committed records
hold (labels, row errors, prompt and completion lengths).
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from batchrun.job.report.summary import (
    accuracy_text,
    dominant_text,
    human_bytes,
    human_rate,
    human_seconds,
)

LABELS_SHOWN = 40  # rows of the page's label table (report.json has them all)
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
    return (f'<h2>Accuracy</h2><p>{html.escape(accuracy_text(expected))}</p>'
            + _confusion(expected.get("confusion") or [], expected.get("confusion_axes"))
            + _rows_table("Rows whose answer is not the expected one",
                          expected.get("disagreeing") or [], expected=True))


def _confusion(cells: list[dict], axes: dict | None = None) -> str:
    """Expected labels down, answers across: rows of each pair (the most common of each)."""
    if not cells:
        return ""
    truths = (axes or {}).get("expected") or list(dict.fromkeys(c["expected"] for c in cells))
    answers = (axes or {}).get("answer") or list(dict.fromkeys(c["answer"] for c in cells))
    count = {(c["expected"], c["answer"]): c["rows"] for c in cells}
    head = "".join(f'<th class="num">{html.escape(a)}</th>' for a in answers)
    body = "".join(
        f'<tr><td class="label">{html.escape(t)}</td>'
        + "".join(f'<td class="num">{_cell(count.get((t, a)), t == a)}</td>' for a in answers)
        + "</tr>" for t in truths)
    return ('<p class="note">Expected (down) against answered (across), rows:</p>'
            f'<table><tr><th></th>{head}</tr>{body}</table>')


def _cell(n: int | None, diagonal: bool) -> str:
    n = n or 0
    return f"<b>{n:,}</b>" if diagonal else f"{n:,}"


def _rows_table(title: str, rows: list[dict], expected: bool = False) -> str:
    """A few rows with their answer and its probability (where the row was scored)."""
    if not rows:
        return ""
    head = "<th>row</th>" + ("<th>expected</th>" if expected else "") + \
        '<th>answer</th><th class="num">prob</th>'
    body = "".join(
        f"<tr><td>{html.escape(_where(r))}</td>"
        + (f'<td class="label">{html.escape(str(r.get("expected")))}</td>' if expected else "")
        + f'<td class="label">{html.escape(str(r.get("answer") or ""))}</td>'
        + f'<td class="num">{_prob(r.get("prob"))}</td></tr>'
        for r in rows)
    return f'<h3>{html.escape(title)}</h3><table><tr>{head}</tr>{body}</table>'


def _prob(p: float | None) -> str:
    return "" if p is None else f"{p:.2f}"


def _prompt_section(runs: list[dict]) -> str:
    """The first row's prompt as the model saw it (the newest run's)."""
    first = next((r["first_prompt"] for r in reversed(runs) if r.get("first_prompt")), None)
    if not first:
        return ""
    text = first["text"]
    cut = len(text) > PROMPT_SHOWN
    return (f'<h2>The prompt</h2><p class="note">Row {first["index"] + 1:,}\'s, as the model '
            f'sees it (after the chat template){", its start" if cut else ""}:</p>'
            f'<pre class="prompt">{html.escape(text[:PROMPT_SHOWN])}{"…" if cut else ""}</pre>')


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
    warn = (f'<p class="warn">{html.escape(dominant_text(labels["dominant"]))}.</p>'
            if labels.get("dominant") else "")
    return (f'<h2>Labels</h2>{warn}<p>{"; ".join(notes)}.</p>'
            '<table><tr><th>label</th><th class="num">rows</th><th class="num">share</th>'
            '<th></th><th class="num">mean prob</th><th class="num">unsure</th></tr>'
            f'{"".join(rows)}</table>{legend}'
            + _rows_table("The first rows", labels.get("samples") or [])
            + _rows_table("The least sure rows", labels.get("least_sure") or []))


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
    have = "row has" if rows_failed == 1 else "rows have"
    return (f"<h2>Row errors</h2><p>{rows_failed:,} {have} an error record "
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


def _sources(sources: dict) -> str:
    return (f"{_count(sources['computed'])} computed, {_count(sources['memory'])} from the "
            f"cache in memory, {_count(sources['disk'])} from its disk")


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
    ("prompt_sources", "where prompt tokens came from", _sources),
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


PROMPT_SHOWN = 4000  # characters of the first row's prompt the report shows

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
p.warn { color: #a04000; font-weight: 600; } h3 { font-size: 14px; margin-top: 18px; }
pre.prompt { background: #f6f6f6; padding: 8px; white-space: pre-wrap; word-break: break-word;
             max-height: 24em; overflow: auto; }
"""


def _over_time(runs: list[dict]) -> str:
    rate, batch, starts = _series(runs)
    if not rate and not batch:
        return '<p class="empty">No samples: no row reached the engine.</p>'
    return (_svg_chart(rate, "Generated tokens per second", "tok/s", "#1f77b4", starts)
            + _svg_chart(batch, "Running sequences", "batch size", "#d62728", starts))


def _all_failed(report: dict) -> str:
    """A job whose every row failed says so first: its figures measure nothing."""
    if report["rows_done"] or not report["rows_failed"]:
        return ""
    return ('<p class="warn">Every row failed: no row has a result. The row errors below say '
            'why; fix the input or the flags and run the job again with --restart.</p>')


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
{_all_failed(report)}<div class="cards">
<div><div class="big">{report['rows_done']:,} / {report['rows_total']:,}</div>rows done{
    f" ({failed:,} failed)" if failed else ""}</div>
</div>
{_prompt_section(runs)}
{_labels_section(report.get('labels'))}{_expected_section(report.get('expected'))}
{_errors_section(report.get('error_codes'), failed)}
<h2>Throughput</h2>
<div class="cards">
<div><div class="big">{human_rate(report['completion_tokens_per_s'])}</div>generated tokens/s
</div>
<div><div class="big">{human_rate(report['requests_per_s'])}</div>rows/s</div>
<div><div class="big">{human_seconds(report['wall_s'])}</div>wall time</div>
<div><div class="big">{human_bytes(report['peak_memory_bytes'])}</div>peak memory</div>
</div>
{_lengths_section(report.get('token_lengths'))}
<h2>Over time</h2>
{_over_time(report["runs"])}
<h2>Runs</h2>
{_runs_table(runs)}
<h2>All figures</h2>
{_figures_table(report)}
</body></html>
"""
