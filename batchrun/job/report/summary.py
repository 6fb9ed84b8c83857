"""The report in words: the text summary `status` and `report` print, and the units a
person reads (report.json keeps raw machine numbers: bytes, seconds, tokens per second).
"""

from __future__ import annotations

LABELS_SAID = 8  # labels the printed summary names


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
        f"tokens:     {report['prompt_tokens']:,} prompt ({_cached(report)}), "
        f"{report['completion_tokens']:,} completion",
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
        if labels.get("dominant"):
            lines.append("warning:    " + dominant_text(labels["dominant"]))
    expected = report.get("expected")
    if expected:
        lines.append(f"accuracy:   {accuracy_text(expected)}")
    if report.get("error_codes"):
        lines.append("row errors: " + ", ".join(f"{e['code']} {e['rows']:,}"
                                                for e in report["error_codes"]))
    return "\n".join(lines)


def dominant_text(dominant: dict) -> str:
    """A label that takes nearly every row, said with what to check."""
    return (f"{dominant['label']} is the answer on {dominant['share']:.0%} of the labeled rows: "
            "check the prompt and the model on a few rows whose answer you know")


def _cached(report: dict) -> str:
    """The cached prompt tokens, and how many of them came from disk where any did."""
    cached = report["cached_prompt_tokens"]
    disk = (report.get("prompt_sources") or {}).get("disk") or 0
    return f"{cached:,} cached, {disk:,} of them from disk" if disk else f"{cached:,} cached"
