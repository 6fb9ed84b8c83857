"""report.json (figures per start of the job and for the whole job) and a self-contained
report.html with plots of throughput and batch size over time."""

from __future__ import annotations

import html
import logging
import time
from pathlib import Path

import orjson

import batchrun
from batchrun.engine.request import EngineStats
from batchrun.job.state import DamagedFile, Progress, read_json, write_atomic

log = logging.getLogger("batchrun")
MAX_TIMELINE_POINTS = 1500
SUM_FIELDS = ("wall_s", "rows_done", "rows_failed", "prompt_tokens", "cached_prompt_tokens",
              "completion_tokens", "prefill_time_s", "decode_time_s", "decode_tokens",
              "decode_steps")


def run_entry(started: float, status: str, stats: EngineStats, rows_done: int, rows_failed: int,
              max_concurrency: int, wall_s: float) -> dict:
    """The figures of one start of the job (engine work, including rows not yet committed)."""
    wall = max(wall_s, 1e-9)
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "status": status,
        "wall_s": round(wall_s, 3),
        "rows_done": rows_done,
        "rows_failed": rows_failed,
        "prompt_tokens": stats.prompt_tokens,
        "cached_prompt_tokens": stats.cached_tokens,
        "completion_tokens": stats.completion_tokens,
        "prefill_time_s": round(stats.prefill_time, 3),
        "decode_time_s": round(stats.decode_time, 3),
        "decode_tokens": stats.decode_tokens,
        "decode_steps": stats.decode_steps,
        "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 2),
        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2),
        "completion_tokens_per_s": round(stats.completion_tokens / wall, 2),
        "requests_per_s": round((rows_done + rows_failed) / wall, 3),
        "peak_memory_bytes": stats.peak_memory_bytes,
        "max_concurrency": max_concurrency,
        "mean_batch_size": round(stats.mean_batch_size, 2),
        "ttft_p50_s": _round(stats.ttft_quantile(0.5)),
        "ttft_p95_s": _round(stats.ttft_quantile(0.95)),
        "timeline": _thin(stats.timeline),
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _thin(points: list) -> list:
    step = max(1, len(points) // MAX_TIMELINE_POINTS)
    return [list(p) for p in points[::step]]


def build_report(manifest: dict, progress: Progress, rows_total: int, runs: list[dict],
                 device: str) -> dict:
    totals = {k: sum(r.get(k) or 0 for r in runs) for k in SUM_FIELDS}
    wall = max(totals["wall_s"], 1e-9)
    computed = totals["prompt_tokens"] - totals["cached_prompt_tokens"]
    rows = sum(r["rows_done"] + r["rows_failed"] for r in runs) or 1
    return {
        "rows_total": rows_total,
        "rows_done": progress.rows_done,
        "rows_failed": progress.rows_failed,
        "rows_pending": max(0, rows_total - progress.rows_done - progress.rows_failed),
        # Token counts of the rows in the output (work lost to a crash is not counted here).
        "prompt_tokens": progress.prompt_tokens,
        "cached_prompt_tokens": progress.cached_tokens,
        "completion_tokens": progress.completion_tokens,
        "wall_s": round(totals["wall_s"], 3),
        "prefill_tokens_per_s": round(computed / totals["prefill_time_s"], 2)
        if totals["prefill_time_s"] else 0.0,
        "decode_tokens_per_s": round(totals["decode_tokens"] / totals["decode_time_s"], 2)
        if totals["decode_time_s"] else 0.0,
        "completion_tokens_per_s": round(totals["completion_tokens"] / wall, 2),
        "requests_per_s": round((totals["rows_done"] + totals["rows_failed"]) / wall, 3),
        "peak_memory_bytes": max((r["peak_memory_bytes"] for r in runs), default=0),
        "max_concurrency": max((r["max_concurrency"] for r in runs), default=0),
        "mean_batch_size": round(sum(r["mean_batch_size"] * r["decode_steps"] for r in runs)
                                 / totals["decode_steps"], 2) if totals["decode_steps"] else 0.0,
        # Across starts: the starts' quantiles weighted by their rows (an approximation).
        "ttft_p50_s": _weighted(runs, "ttft_p50_s", rows),
        "ttft_p95_s": _weighted(runs, "ttft_p95_s", rows),
        "model": manifest["model"]["name"],
        "model_path": manifest["model"]["path"],
        "device": device,
        "batchrun_version": batchrun.__version__,
        "input": manifest["input"]["path"],
        "output": manifest["output"],
        "runs": runs,
    }


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
    return [r for r in runs if _well_formed(r)] if isinstance(runs, list) else []


def _well_formed(run: object) -> bool:
    return isinstance(run, dict) and all(
        type(run.get(k)) in (int, float)
        for k in (*SUM_FIELDS, "peak_memory_bytes", "max_concurrency", "mean_batch_size"))


def write_report(job_dir: Path, report: dict, html_too: bool = True) -> None:
    job_dir = Path(job_dir)
    write_atomic(job_dir / "report.json", orjson.dumps(report, option=orjson.OPT_INDENT_2))
    if html_too:
        write_atomic(job_dir / "report.html", render_html(report).encode())


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


def summary_text(report: dict) -> str:
    gib = report["peak_memory_bytes"] / 2**30
    ttft = report["ttft_p50_s"]
    lines = [
        f"rows:       {report['rows_done']:,} done, {report['rows_failed']:,} failed, "
        f"{report['rows_pending']:,} pending of {report['rows_total']:,}",
        f"tokens:     {report['prompt_tokens']:,} prompt ({report['cached_prompt_tokens']:,} "
        f"cached), {report['completion_tokens']:,} generated",
        f"throughput: {report['completion_tokens_per_s']:,.1f} tok/s generated, "
        f"{report['requests_per_s']:,.2f} rows/s over {report['wall_s']:,.1f}s "
        f"in {len(report['runs'])} run(s)",
        f"engine:     prefill {report['prefill_tokens_per_s']:,.0f} tok/s, decode "
        f"{report['decode_tokens_per_s']:,.0f} tok/s, mean batch {report['mean_batch_size']:.1f} "
        f"(max {report['max_concurrency']}), peak memory {gib:.2f} GiB"
        + (f", TTFT p50 {ttft:.2f}s" if ttft is not None else ""),
    ]
    return "\n".join(lines)


# -- HTML ------------------------------------------------------------------------------------

def _series(runs: list[dict]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(time, tokens/s) and (time, batch size) across all starts, laid end to end."""
    rate, batch = [], []
    offset = 0.0
    for run in runs:
        points = run.get("timeline") or []
        for (t0, _, c0, _), (t1, _, c1, b1) in zip(points, points[1:], strict=False):
            if t1 > t0:
                rate.append((offset + t1, (c1 - c0) / (t1 - t0)))
                batch.append((offset + t1, b1))
        offset += run.get("wall_s") or (points[-1][0] if points else 0)
    return rate, batch


def _svg_chart(points: list[tuple[float, float]], title: str, unit: str, color: str) -> str:
    w, h, left, bottom, top = 760, 200, 60, 30, 24
    if not points:
        return f'<p class="empty">{html.escape(title)}: no samples yet</p>'
    x_max = max(p[0] for p in points) or 1
    y_max = max(p[1] for p in points) * 1.1 or 1
    sx = lambda x: left + (w - left - 10) * x / x_max  # noqa: E731
    sy = lambda y: top + (h - top - bottom) * (1 - y / y_max)  # noqa: E731
    path = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}"
                    for i, (x, y) in enumerate(points))
    grid = []
    y_fmt = ",.0f" if y_max >= 10 else ".2f"
    x_fmt = ",.0f" if x_max >= 10 else ".1f"
    for k in range(5):
        y = y_max * k / 4
        grid.append(f'<line x1="{left}" x2="{w - 10}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" '
                    f'class="grid"/><text x="{left - 6}" y="{sy(y) + 4:.1f}" '
                    f'text-anchor="end">{y:{y_fmt}}</text>')
        x = x_max * k / 4
        grid.append(f'<text x="{sx(x):.1f}" y="{h - 8}" text-anchor="middle">{x:{x_fmt}}s</text>')
    return (f'<svg viewBox="0 0 {w} {h}" role="img" aria-label="{html.escape(title)}">'
            f'<text x="{left}" y="14" class="title">{html.escape(title)} ({unit})</text>'
            + "".join(grid)
            + f'<path d="{path}" fill="none" stroke="{color}" stroke-width="1.8"/>'
            + "".join(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>'
                      for x, y in (points if len(points) < 4 else []))
            + "</svg>")


def render_html(report: dict) -> str:
    rate, batch = _series(report["runs"])
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(_fmt(v))}</td></tr>"
        for k, v in report.items() if k != "runs")
    run_rows = "".join(
        f"<tr><td>{i + 1}</td><td>{html.escape(r['started'])}</td><td>{r['status']}</td>"
        f"<td>{r['rows_done']:,}</td><td>{r['rows_failed']:,}</td><td>{r['wall_s']:,.1f}</td>"
        f"<td>{r['completion_tokens_per_s']:,.1f}</td><td>{r['mean_batch_size']:.1f}</td></tr>"
        for i, r in enumerate(report["runs"]))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>batchrun report</title>
<style>
body {{ font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 820px;
       color: #222; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 16px; margin-top: 28px; }}
table {{ border-collapse: collapse; width: 100%; }}
td, th {{ border-bottom: 1px solid #e4e4e4; padding: 3px 8px; text-align: left; }}
svg {{ width: 100%; height: auto; font-size: 11px; fill: #555; }}
.grid {{ stroke: #eee; }} .title {{ font-weight: 600; fill: #222; }}
.big {{ font-size: 26px; font-weight: 600; }} .card {{ display: inline-block;
       margin-right: 28px; }}
</style></head><body>
<h1>batchrun report: {html.escape(Path(report['input']).name)}</h1>
<div class="card"><div class="big">{report['rows_done']:,} / {report['rows_total']:,}</div>rows
done ({report['rows_failed']:,} failed)</div>
<div class="card"><div class="big">{report['completion_tokens_per_s']:,.0f}</div>generated
tokens/s</div>
<div class="card"><div class="big">{report['mean_batch_size']:.1f}</div>mean batch size</div>
<h2>Over time</h2>
{_svg_chart(rate, "Generated tokens per second", "tok/s", "#1f77b4")}
{_svg_chart(batch, "Running sequences", "batch size", "#d62728")}
<h2>Runs</h2>
<table><tr><th>#</th><th>started</th><th>status</th><th>rows done</th><th>failed</th>
<th>wall s</th><th>tok/s</th><th>mean batch</th></tr>{run_rows}</table>
<h2>Figures</h2><table>{rows}</table>
</body></html>
"""


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}"
    if isinstance(v, int):
        return f"{v:,}"
    return "" if v is None else str(v)
