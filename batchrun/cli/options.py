"""The `run` command's options, bundled by topic: each bundle is a decorator that adds its
options, and its heading is the section they are listed under in `run --help`.

RUN_BUNDLES is the table of which option each bundle holds: the help is written from it and
docs/cli.md prints it. An option is the `batchrun.Job` keyword of the same name, and its bundle's
key is the part of job.options.RunOptions that holds it (job.options.FLAT; tests/test_cli.py
checks the two agree). Only click is imported here: `--help` must answer without loading the
model stack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click
from click.formatting import HelpFormatter, measure_table

MAX_SEED = 2**64 - 1  # engine.types.MAX_SEED (not imported: it loads MLX)
STDIN = "-"  # as INPUT: JSONL rows on stdin; as -o: results on stdout
HELP_COLUMN = 30  # the widest option column in --help (click's own width)

Spec = tuple[tuple[str, ...], dict]  # an option's click.option arguments


def option(*decls: str, **attrs) -> Spec:
    """One option of a bundle, in click.option's terms."""
    return decls, attrs


class BundledOption(click.Option):
    """A click option that knows the bundle it came in (for the help's sections)."""

    def __init__(self, *args, bundle: Bundle, **kwargs):
        super().__init__(*args, **kwargs)
        self.bundle = bundle


@dataclass(frozen=True, slots=True)
class Bundle:
    """Options of one topic. `key` names the part of job.options.RunOptions that holds them
    (--model, --restart and --quiet are RunOptions' own fields); `heading` is their section in
    --help; `cli_only` are those the Python API does not take (they steer the command, not the
    job)."""

    key: str
    heading: str
    options: tuple[Spec, ...]
    cli_only: tuple[str, ...] = ()

    def __call__(self, f: Callable) -> Callable:
        for decls, attrs in reversed(self.options):  # click lists the first decorator first
            f = click.option(*decls, cls=BundledOption, bundle=self, **attrs)(f)
        return f

    @property
    def names(self) -> tuple[str, ...]:
        """The parameter names, as `run` passes them and `batchrun.Job` takes them."""
        return tuple(click.Option(decls).name for decls, _ in self.options)


sampling_options = Bundle("sampling", "Model and sampling", (
    option("--model", default=None, envvar="BATCHRUN_MODEL",
           help="mlx-lm model folder or Hugging Face id [default: the bundled demo model; "
           "env BATCHRUN_MODEL]"),
    option("--max-tokens", type=click.IntRange(min=1), default=None,
           help="most tokens generated a row (a row's own max_tokens wins) [default: the "
                "model's generation_config.json max_new_tokens, else 256]"),
    option("--temperature", type=click.FloatRange(min=0), default=None,
           help="sampling temperature; 0 is greedy (a row's own wins) [default: the model's "
                "generation_config.json, else 0]"),
    option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=None,
           help="sample from the smallest set of tokens with this much probability; 1 is "
                "off [default: the model's generation_config.json, else 1]"),
    option("--top-k", type=click.IntRange(min=0), default=None,
           help="sample from the k likeliest tokens; 0 is off [default: the model's "
                "generation_config.json, else 0]"),
    option("--min-p", type=click.FloatRange(0, 1, max_open=True), default=None,
           help="drop tokens less likely than this times the likeliest; 0 is off "
                "[default: the model's generation_config.json, else 0]"),
    option("--seed", type=click.IntRange(0, MAX_SEED), default=None,
           help="base seed: a sampled row without its own seed gets one from this and its "
                "position"),
    option("--stop", multiple=True, help="stop string (repeatable)"),
    option("--n", "n", type=click.IntRange(1, 128), default=1, show_default=True,
           help="samples per row (rows may set their own `n`)"),
    option("--max-thinking-tokens", type=click.IntRange(min=0), default=None,
           help="most tokens a reasoning model may think before its answer (constraints "
                "apply after it) [default: unbounded]"),
    option("--logprobs", is_flag=True, help="log-probabilities of the generated tokens"),
    option("--top-logprobs", type=click.IntRange(0, 20), default=0, show_default=True,
           help="also the K most likely tokens at each position"),
    option("--served-model-name", default=None, metavar="NAME[,ALIAS...]",
           help="the model names OpenAI rows may ask for in body.model; a row naming "
                "another is that row's error [default: any name]"),
))

label_options = Bundle("labels", "Labels and constraints", (
    option("--prompt-template", default=None,
           help='build a user message from row columns: "Classify: {review}"'),
    option("--system", default=None, help="system message prepended to chat rows"),
    option("--answer-prefix", default=None,
           help='begin every chat answer with this text ("Sentiment:"): the model goes on '
                'from it, and results hold only what follows'),
    option("--choices", default=None,
           help="every answer is one of these comma-separated labels; each row also gets "
                "choice_probs"),
    option("--json-schema", type=click.Path(path_type=Path), default=None,
           help="every answer is JSON valid against this schema (a file)"),
    option("--regex", default=None, help="every answer matches this regex"),
    option("--expected-column", default=None,
           help="column that holds each row's right answer: copied into its record as "
                "`expected`; the report gives the share of labels that agree with it"),
))

io_options = Bundle("io", "Inputs and outputs", (
    option("-o", "--output", type=click.Path(path_type=Path), default=None,
           help="results file; a .parquet suffix writes Parquet "
                "[default: <job-dir>/results.jsonl]"),
    option("--job-dir", type=click.Path(path_type=Path), default=None,
           help="job state folder [default: jobs/<input file stem>; needed for rows from "
                "stdin, which are kept in it as stdin.jsonl]"),
    option("--format", "format", type=click.Choice(["jsonl", "parquet", "csv", "tsv"]),
           default=None,
           help="read the input as this format whatever its suffix [default: from the "
                "suffix; rows on stdin: JSONL, or Parquet by its first bytes]"),
    option("--id-column", default=None, help="column that holds the row id"),
    option("--keep-columns", default=None,
           help="input columns copied into each JSONL result as `columns` (comma-separated, "
                "or all); Parquet output keeps every column anyway"),
))

media_options = Bundle("media", "Images", (
    option("--image-column", default=None,
           help="column holding each row's image (bytes, a path or a URL): image rows"),
    option("--media-root", multiple=True, type=click.Path(path_type=Path, file_okay=False),
           help="a folder image paths may be read from (repeatable) [default: only the input "
                "file's folder]"),
    option("--allow-private-urls", is_flag=True,
           help="let image URLs reach loopback, private and link-local addresses"),
    option("--media-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0,
           show_default=True, help="seconds one image may take to fetch, redirects included"),
    option("--vision", is_flag=True,
           help="load the model as a vision-language model (mlx-vlm) even if its config "
                "does not say so"),
))

cache_options = Bundle("cache", "Prefix cache", (
    option("--cache-dir", type=click.Path(path_type=Path), default=None,
           envvar="BATCHRUN_CACHE_DIR",
           help="prefix-cache folder [default: $BATCHRUN_CACHE_DIR or ~/.cache/batchrun]"),
    option("--no-prefix-cache", is_flag=True, help="neither read nor write the prefix cache"),
    option("--no-shared-prefix", is_flag=True,
           help="each row holds its own copy of a cached prefix's KV (instead of all rows "
                "attending one shared copy)"),
))

speculation_options = Bundle("speculation", "Speculative decoding", (
    option("--speculate", type=click.Choice(["off", "ngram", "draft"]), default=None,
           help="speculative decoding while few rows run (the output does not change): "
                "ngram guesses from each row's own prompt (answers that copy it), draft "
                "from --draft-model [default: draft with --draft-model, else off]"),
    option("--draft-model", default=None,
           help="a small model sharing the model's tokenizer, guessing tokens for "
                "--speculate draft"),
    # default: engine.config.default_draft_tokens, written out (the CLI imports no engine
    # module before it must; a test checks they agree)
    option("--draft-tokens", type=click.IntRange(1, 16), default=None,
           help="tokens a row guesses ahead each speculative step [default: 6; on a GPU "
                "8 for a draft model, 12 for --speculate ngram]"),
))

ray_options = Bundle("ray", "Ray", (
    option("--ray", "ray_address", default=None, metavar="ADDRESS|local",
           help="shard the job over a Ray cluster (local: one started in this process)"),
    option("--ray-actors", type=click.IntRange(min=1), default=2, show_default=True,
           help="Ray actors, each loading the model once"),
    option("--ray-num-cpus", type=click.FloatRange(min=0), default=1.0, show_default=True,
           help="CPUs each Ray actor reserves"),
    option("--ray-num-gpus", type=click.FloatRange(min=0), default=0.0, show_default=True,
           help="GPUs each Ray actor reserves"),
    option("--ray-slice-rows", type=click.IntRange(min=1), default=64, show_default=True,
           help="rows per slice handed to an actor (an actor batches within a slice)"),
))

limit_options = Bundle("limits", "Engine and row limits", (
    option("--max-concurrency", type=click.IntRange(min=1), default=None,
           help="most sequences decoding at once [default: chosen from memory]"),
    option("--memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=0.85,
           show_default=True, help="fraction of device memory for weights + KV caches"),
    option("--prefill-batch-size", type=click.IntRange(min=1), default=None,
           help="most rows prefilled together (default: as many as fit the device's "
                "prefill token budget)"),
    option("--prefill-step-size", type=click.IntRange(min=1), default=2048, show_default=True,
           help="prompt tokens a row computes per forward pass while prefilling"),
    option("--weights", type=click.Choice(["auto", "quantized", "dequantized"]),
           default="auto", show_default=True,
           help="how a quantized model's weights are held: auto dequantizes them once where "
                "that is faster and fits (a GPU; a CPU holds every weight in float32), "
                "quantized keeps them as loaded [docs/cpu-and-gpu.md]"),
    option("--limit", multiple=True, metavar="NAME=VALUE",
           help="raise or lower a row size limit (repeatable): row-bytes, prompt-chars, "
                "choices, choice-chars, choices-chars, image-bytes; sizes take K, M, G "
                "[docs/limits.md]"),
))

control_options = Bundle("control", "Job control", (
    option("--dry-run", is_flag=True,
           help="count rows and prompt tokens, the share a prefix cache reuses, and "
                "estimate the time from a few rows; writes nothing"),
    option("--restart", is_flag=True, help="discard earlier progress of this job"),
    option("--fail-on-row-errors", is_flag=True,
           help="exit 3 when any row ended as an error record (every row still has one)"),
    option("--quiet", is_flag=True, help="no progress bar"),
    option("--debug", is_flag=True, help="show tracebacks"),
), cli_only=("dry_run", "fail_on_row_errors", "debug"))

# In the order `run --help` lists them: what most jobs set first, Ray and the engine's limits late.
RUN_BUNDLES = (sampling_options, label_options, io_options, media_options, cache_options,
               speculation_options, ray_options, limit_options, control_options)


def run_options(f: Callable) -> Callable:
    """Every bundle of `run`, in RUN_BUNDLES' order."""
    for bundle in reversed(RUN_BUNDLES):
        f = bundle(f)
    return f


class BundledCommand(click.Command):
    """A command whose --help lists its options under their bundles' headings (one column
    width for all), then its examples: (what it does, the command) pairs."""

    def __init__(self, *args, examples: tuple[tuple[str, str], ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.examples = examples

    def format_options(self, ctx: click.Context, formatter: HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and isinstance(param, click.Option):
                heading = param.bundle.heading if isinstance(param, BundledOption) \
                    else "Other options"
                sections.setdefault(heading, []).append(record)
        rows = [row for section in sections.values() for row in section]
        width = min(measure_table(rows)[0], HELP_COLUMN) if rows else 0
        for heading, section in sections.items():
            # click sizes a list's term column by its own terms: a first term padded to the
            # widest keeps every section's help text in one column.
            term, text = section[0]
            with formatter.section(heading):
                formatter.write_dl([(term.ljust(width), text), *section[1:]],
                                   col_max=HELP_COLUMN)

    def format_epilog(self, ctx: click.Context, formatter: HelpFormatter) -> None:
        super().format_epilog(ctx, formatter)
        if not self.examples:
            return
        with formatter.section("Examples"):
            for i, (what, command) in enumerate(self.examples):
                if i:
                    formatter.write_paragraph()
                formatter.write_text(what)
                for line in command.splitlines():  # as written: a command is not rewrapped
                    formatter.write(f"{'':>{formatter.current_indent + 2}}{line}\n")
