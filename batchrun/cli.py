"""The `batchrun` command line: a thin layer over the job runner."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

import batchrun
from batchrun.engine.request import EngineConfig, SamplingParams


def _fail(message: str, hint: str | None = None) -> click.ClickException:
    return click.ClickException(message + (f"\n  hint: {hint}" if hint else ""))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(batchrun.__version__, prog_name="batchrun")
def cli() -> None:
    """Offline batch jobs for LLM inference on MLX."""


@cli.command()
@click.argument("input_path", metavar="INPUT", type=click.Path(path_type=Path))
@click.option("--model", default=None, help="mlx-lm model folder or Hugging Face id "
              "[default: the bundled demo model]")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="results file [default: <job-dir>/results.jsonl]")
@click.option("--job-dir", type=click.Path(path_type=Path), default=None,
              help="job state folder [default: jobs/<input file stem>]")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None,
              help="most sequences decoding at once [default: chosen from memory]")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0,
              show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--min-p", type=click.FloatRange(0, 1, max_open=True), default=0.0,
              show_default=True)
@click.option("--seed", type=int, default=None, help="base seed: a sampled row without its own seed gets one from this and its position")
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--system", default=None, help="system message prepended to chat rows")
@click.option("--prompt-template", default=None,
              help='build a user message from row columns: "Classify: {review}"')
@click.option("--id-column", default=None, help="column that holds the row id")
@click.option("--memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=0.85,
              show_default=True, help="fraction of device memory for weights + KV caches")
@click.option("--prefill-batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--prefill-step-size", type=click.IntRange(min=1), default=2048, show_default=True)
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.option("--debug", is_flag=True, help="show tracebacks")
def run(input_path: Path, model: str | None, output: Path | None, job_dir: Path | None,
        max_concurrency: int | None, max_tokens: int, temperature: float, top_p: float,
        top_k: int, min_p: float, seed: int | None, stop: tuple[str, ...], system: str | None,
        prompt_template: str | None, id_column: str | None, memory_utilization: float,
        prefill_batch_size: int, prefill_step_size: int, quiet: bool, debug: bool) -> None:
    """Process a .jsonl / .jsonl.gz file of prompts."""
    from batchrun.job.rows import RowOptions
    from batchrun.job.runner import JobPaths, JobRunner

    if not input_path.is_file():
        raise _fail(f"input file not found: {input_path}")
    defaults = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              top_k=top_k, min_p=min_p, seed=seed, stop=stop)
    config = EngineConfig(max_concurrency=max_concurrency, prefill_batch_size=prefill_batch_size,
                          prefill_step_size=prefill_step_size,
                          memory_utilization=memory_utilization)
    engine = _load_engine(model, config, debug)
    click.echo(describe_runtime(engine, model), err=True)
    paths = JobPaths.for_input(input_path, job_dir, output)
    runner = JobRunner(engine, input_path, paths,
                       RowOptions(defaults, system, prompt_template, id_column), quiet=quiet)
    summary = runner.run()
    stats = engine.stats
    wall = max(summary.wall_s, 1e-9)
    click.echo(
        f"done: {summary.rows_done} rows, {summary.rows_failed} failed, "
        f"{summary.completion_tokens:,} tokens in {summary.wall_s:.1f}s "
        f"({summary.completion_tokens / wall:,.0f} tok/s, {summary.rows_done / wall:.1f} rows/s, "
        f"mean batch {stats.mean_batch_size:.1f})\n"
        f"results: {paths.output}" + (f"\nerrors:  {paths.errors}" if summary.rows_failed else ""),
        err=True,
    )


def _load_engine(model: str | None, config: EngineConfig, debug: bool):
    from batchrun.engine.engine import Engine

    try:
        return Engine.load(model, config)
    except Exception as e:
        if debug:
            raise
        raise _fail(f"could not load model {model!r}: {e}",
                    "pass an mlx-lm model folder or a Hugging Face id with --model") from e


def describe_runtime(engine, model: str | None) -> str:
    import mlx.core as mx

    from batchrun import blas
    from batchrun.models import resolve

    device = mx.default_device()
    name = mx.device_info().get("device_name", "")
    where = f"{device.type.name}" + (f" ({name}, {os.cpu_count()} cores)"
                                    if device == mx.cpu else f" ({name})")
    lines = [f"model:  {model or 'demo'} ({resolve(model)})", f"device: {where}"]
    if device == mx.cpu:
        lines.append(f"BLAS:   {blas.verify().describe()}")
    lines.append(f"batch:  up to {engine.max_concurrency} sequences, KV budget "
                 f"{engine.memory.budget / 2**30:.1f} GiB")
    return "\n".join(lines)


def main() -> None:
    try:
        cli(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)
