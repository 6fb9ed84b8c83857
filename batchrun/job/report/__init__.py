"""report.json (figures for the whole job and for each start of it) and a self-contained
report.html: plots of throughput and batch size over time and, in the final report, what the
committed records hold (labels, row errors, prompt and completion lengths).

report.json keeps raw machine numbers (bytes, seconds, tokens per second); the page and
`summary_text` put them in units a person reads (`human_bytes`, `human_seconds`, `human_rate`).

The parts: figures.py (report.json's figures for the job and each run, and writing the report),
tally.py (what the committed records hold), summary.py (the figures in words) and html.py
(the page). What the rest of batchrun uses is here.
"""

from batchrun.job.report.figures import (
    build_report,
    previous_runs,
    run_entry,
    speculation_settings,
    well_formed,
    write_report,
)
from batchrun.job.report.html import render_html
from batchrun.job.report.summary import (
    accuracy_text,
    human_bytes,
    human_rate,
    human_seconds,
    summary_text,
)
from batchrun.job.report.tally import HISTOGRAM_BINS, LOW_CONFIDENCE, RecordTally, record_figures

__all__ = ["HISTOGRAM_BINS", "LOW_CONFIDENCE", "RecordTally", "accuracy_text", "build_report",
           "human_bytes", "human_rate", "human_seconds", "previous_runs", "record_figures",
           "render_html", "run_entry", "speculation_settings", "summary_text", "well_formed",
           "write_report"]
