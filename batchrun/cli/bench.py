"""`batchrun bench`: batchrun's throughput beside sequential mlx-lm and batch_generate."""

from __future__ import annotations

from pathlib import Path

import click

from batchrun.models.families import QUANTIZATIONS
from batchrun.paths import default_cache_dir


@click.command()
@click.option("--model", default=None, envvar="BATCHRUN_MODEL",
              help="mlx-lm model folder or Hugging Face id [env BATCHRUN_MODEL]")
@click.option("--shape", default=None, help="random-weight model of a named shape: "
              "demo, 150m, llama-1b (built once into the cache folder)")
@click.option("--quantize", type=click.Choice(QUANTIZATIONS), default="none",
              show_default=True, help="with --shape: its quantized twin (as mlx-lm's converter "
              "makes it)")
@click.option("--weights", type=click.Choice(["auto", "quantized", "dequantized"]),
              default="auto", show_default=True,
              help="how batchrun holds a quantized model (run's --weights); the mlx-lm "
                   "systems run it as loaded")
@click.option("--workload", type=click.Choice(["short", "mixed", "mixed512", "labeling"]),
              default="mixed", show_default=True,
              help="short: 16-32 prompt tokens; mixed: 8-1,500 prompt and 16-256 new tokens; "
                   "mixed512: 8-512 prompt tokens; labeling: a shared 1,000-token prefix")
@click.option("--rows", type=click.IntRange(min=1), default=64, show_default=True,
              help="rows in the workload")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="new tokens a row (workloads without their own)")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=64, show_default=True,
              help="rows decoded together, for every system")
@click.option("--systems", default="sequential,batch_generate,batchrun,prefix",
              show_default=True,
              help="comma-separated: sequential, batch_generate, hand_cached (batch_generate "
                   "with the common prefix prefilled once and copied to every row), batchrun, "
                   "prefix (batchrun with a cold, then a warm prefix cache), prefix_copies (the "
                   "same, each row holding its own copy of the prefix)")
@click.option("--prefill-batch-size", type=click.IntRange(min=1), default=None,
              help="batchrun's prefill batch (default: the engine's)")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None,
              help="also write the figures to this JSON file")
def bench(model: str | None, shape: str | None, quantize: str, weights: str, workload: str,
          rows: int, max_tokens: int, max_concurrency: int, systems: str,
          prefill_batch_size: int | None, json_out: Path | None) -> None:
    """Side-by-side throughput: sequential mlx-lm, batch_generate and batchrun."""
    import orjson

    from batchrun import bench as b

    names = [s.strip() for s in systems.split(",") if s.strip()]
    unknown = set(names) - set(b.SYSTEMS)
    if unknown:
        raise click.BadParameter(f"unknown systems: {', '.join(sorted(unknown))}",
                                 param_hint="--systems")
    if prefill_batch_size:
        b.ENGINE_OPTIONS["prefill_batch_size"] = prefill_batch_size
    if quantize != "none" and not shape:
        raise click.BadParameter("takes a --shape", param_hint="--quantize")
    b.ENGINE_OPTIONS["weights"] = weights
    lm = b.model_for(model, shape, default_cache_dir(), quantize)
    w = b.make_workload(lm.tokenizer, workload, rows, max_tokens)
    name = (f"{shape}" + ("" if quantize == "none" else f" {quantize}")) if shape else \
        (model or "demo")
    max_tokens_text = (f"{min(w.max_tokens)}-{max(w.max_tokens)}"
                       if len(set(w.max_tokens)) > 1 else str(max_tokens))
    info = b.machine()
    click.echo(f"{info['date']} · {info['device']} {info['device_name']} · {info['cpus']} cpus · "
               f"BLAS {info['blas']}\nmodel {name}: {w.name} workload, "
               f"{rows} rows, {w.prompt_tokens:,} prompt tokens, {max_tokens_text} new tokens "
               f"each, concurrency {max_concurrency}")
    results = b.benchmark(lm, w, names, max_concurrency)
    click.echo(b.table(results))
    if any(n in ("batchrun", "prefix", "prefix_copies") for n in names):
        click.echo(f"batchrun's weights: {b.planned(lm)[1].describe()}")
    if json_out:
        from batchrun.io.files import write_atomic

        write_atomic(json_out, orjson.dumps({"machine": info, "model": name,
                                             "workload": w.name, "rows": rows,
                                             "max_tokens": max_tokens,
                                             "results": b.as_dict(results)},
                                            option=orjson.OPT_INDENT_2))
