"""A job's plan: the options of `batchrun.Job` and of `batchrun run` (job.options.RunOptions,
in parts) checked and turned into what runs: the job's spec (its
RowOptions), the engine's config and the job-wide constraint. The sampling defaults are the
flags', else the model's generation_config.json's, else batchrun's. A bad option is a
UsageError naming its flag, raised before the model loads."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchrun.engine.config import EngineConfig
from batchrun.engine.types import SamplingParams
from batchrun.job.errors import UsageError

if TYPE_CHECKING:
    from batchrun.job.limits import RowLimits
    from batchrun.job.options import IOOptions, LabelOptions, RunOptions

_SAMPLING = SamplingParams()
log = logging.getLogger("batchrun")
# The sampling defaults a model's generation_config.json may set (its key -> ours), applied as
# vLLM applies them: where neither the row nor a flag says otherwise.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                          "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                          "max_new_tokens": "max_tokens"}
STDIN = "-"  # the input name for rows read from stdin
INPUT_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".parquet", ".csv", ".tsv",
                  ".csv.gz", ".tsv.gz")
# https://, s3:// (a path option's value arrives with its // made one /): not a local path
URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:/")
# Output suffixes that promise a format batchrun does not write (anything else is JSONL).
OTHER_FORMATS = frozenset({".gz", ".bz2", ".xz", ".zst", ".zip", ".csv", ".tsv", ".json",
                           ".xlsx", ".arrow", ".feather"})


def generation_defaults(model: str | None) -> dict[str, Any]:
    """The sampling defaults the model's generation_config.json sets, under our names
    (max_new_tokens is max_tokens); {} when it has none or cannot be read."""
    config = _generation_config(model)
    return {ours: config[theirs] for theirs, ours in GENERATION_CONFIG_KEYS.items()
            if config.get(theirs) is not None}


def _generation_config(model: str | None) -> dict:
    """generation_config.json of the model: a local folder, or a Hugging Face id (from the
    local hub cache, else fetched alone: the model's files follow when it loads)."""
    from batchrun.models import resolve

    name = resolve(model)
    path = Path(name).expanduser()
    if path.is_dir():
        file = path / "generation_config.json"
        if not file.is_file():
            return {}
    elif path.is_absolute() or name.startswith((".", "~")):
        return {}  # a local folder that is not there: loading the model says so
    else:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        from batchrun.models import hub_unreachable

        # The cache alone: hf_hub_download(local_files_only=True) builds its request headers
        # first, which fetches the Hub's agent registry (huggingface_hub 2.4) over the network.
        try:
            cached = try_to_load_from_cache(name, "generation_config.json")
        except Exception:  # not a repository id the cache could hold
            return {}
        if isinstance(cached, str):
            file = Path(cached)
        elif cached is not None or hub_unreachable():  # the cache knows there is none; or
            return {}  # the Hub cannot be reached: loading the model says so, without retries
        else:
            try:
                file = Path(hf_hub_download(name, "generation_config.json"))
            except Exception:  # none, or unreachable: loading the model says why if it matters
                return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s cannot be read (%s); its sampling defaults are not used", file, e)
        return {}
    return config if isinstance(config, dict) else {}


def _sampling_defaults(o: RunOptions) -> tuple[dict[str, Any], dict[str, str]]:
    """The job's sampling defaults: the flags, else the model's generation_config.json, else
    batchrun's; and where each came from."""
    generation = generation_defaults(o.model)
    values, sources = {}, {}
    for name in GENERATION_CONFIG_KEYS.values():
        flag = getattr(o.sampling, name, None)  # repetition_penalty has none
        if flag is not None:
            values[name], sources[name] = flag, "flag"
        elif name in generation:
            values[name], sources[name] = generation[name], "generation_config.json"
        else:
            values[name], sources[name] = getattr(_SAMPLING, name), "batchrun"
    return values, sources


def served_names(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """--served-model-name NAME[,ALIAS...] as a tuple of names (empty: any name)."""
    if value is None:
        return ()
    parts = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(str(p).strip() for p in parts)
    if not names or not all(names):
        raise UsageError(f"--served-model-name takes names separated by commas, got {value!r}")
    return names


def _input_path(input_path: Path, o: IOOptions) -> Path:
    """The file the job reads: the input, or for stdin the spool in the job folder."""
    from batchrun.io.readers import FORMATS, declare_format

    if o.format is not None and o.format not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {o.format!r}")
    if str(input_path) == STDIN:
        if not o.job_dir:
            raise UsageError("rows from stdin (-) need --job-dir DIR: batchrun keeps them in "
                             "DIR/stdin.jsonl, so the job can resume")
        return Path(o.job_dir) / f"stdin.{o.format or 'jsonl'}"
    if not input_path.is_file():
        raise UsageError(f"input file not found: {input_path}")
    if o.format is not None:
        declare_format(input_path, o.format)
    elif not input_path.name.lower().endswith(INPUT_SUFFIXES):
        raise UsageError(f"{input_path}: batchrun reads JSONL (.jsonl, .ndjson, .gz), Parquet "
                         f"(.parquet), CSV (.csv) and TSV (.tsv), and job files (.toml); pass "
                         f"--format jsonl, parquet, csv or tsv to read it as one")
    return input_path


def plan(input_path: Path, o: RunOptions):
    """The job's spec, engine config, constraint and where its sampling defaults come from
    (UsageError if an option is bad)."""
    # The job's code loads with its spec, the engine and mlx-lm with it, before any check:
    # mlx-lm raises the open-file limit as it loads, so a limit too low is said first, and as
    # such (the command line's one line for it).
    import batchrun.job.runner  # noqa: F401
    from batchrun.engine.types import SamplingParams
    from batchrun.job.limits import parse_limits
    from batchrun.job.rows import RowOptions
    from batchrun.job.spec import JobSpec, default_job_dir
    from batchrun.paths import default_cache_dir

    from_stdin = str(input_path) == STDIN
    sp, media = o.speculation, o.media
    for flag, value in (("--model", o.model), ("--draft-model", sp.draft_model)):
        if value is not None and not str(value).strip():  # `--model "$UNSET"`: not the demo
            raise UsageError(f"{flag} is empty: pass a model folder or a Hugging Face id")
    input_path = _input_path(input_path, o.io)
    _check_template(o.labels.prompt_template)
    _check_image_column(o)
    try:
        limits = parse_limits(o.limits.rows)
    except ValueError as e:
        raise UsageError(str(e)) from None
    constraint = _constraint(o.labels, limits)
    sampling, sources = _sampling_defaults(o)
    try:
        defaults = SamplingParams(
            **sampling, seed=o.sampling.seed, stop=tuple(o.sampling.stop),
            logprobs=bool(o.sampling.logprobs or o.sampling.top_logprobs),
            top_logprobs=o.sampling.top_logprobs, constraint=constraint,
            max_thinking_tokens=o.sampling.max_thinking_tokens)
    except ValueError as e:
        given = [k for k, v in sources.items() if v == "generation_config.json"]
        why = (f" (the model's generation_config.json sets {', '.join(given)}; a flag "
               "overrides it)") if given else ""
        raise UsageError(f"{e}{why}") from None
    if sp.draft_model and sp.method in ("off", "ngram"):
        log.warning("--draft-model %s is not used: --speculate is %s", sp.draft_model, sp.method)
    method = sp.method or ("draft" if sp.draft_model else "off")
    if sp.draft_tokens is not None and method == "off":
        log.warning("--draft-tokens %s is not used: no speculation (pass --speculate ngram or "
                    "--draft-model)", sp.draft_tokens)
    if sp.method == "draft" and not sp.draft_model:
        raise UsageError("--speculate draft needs --draft-model (a small model made with the "
                         "same tokenizer as the model)")
    try:
        config = EngineConfig(max_concurrency=o.limits.max_concurrency,
                              prefill_batch_size=o.limits.prefill_batch_size,
                              prefill_step_size=o.limits.prefill_step_size,
                              memory_utilization=o.limits.memory_utilization,
                              weights=o.limits.weights,
                              prefix_cache=not o.cache.no_prefix_cache,
                              shared_prefix=not o.cache.no_shared_prefix,
                              speculate=method,
                              draft_model=str(sp.draft_model) if sp.draft_model else None,
                              draft_tokens=sp.draft_tokens,
                              cache_dir=str(o.cache.dir or default_cache_dir()))
    except ValueError as e:
        raise UsageError(str(e)) from None
    job_dir = Path(o.io.job_dir) if o.io.job_dir else default_job_dir(input_path)
    _check_job_dir_path(job_dir)
    if o.io.output is not None and URL_SCHEME.match(str(o.io.output)):
        raise UsageError(f"-o {o.io.output}: batchrun writes local files, not URLs; write a "
                         "local file and copy it from there")
    output = Path(o.io.output) if o.io.output else job_dir / "results.jsonl"
    if output.suffix.lower() in OTHER_FORMATS:
        raise UsageError(f"-o {output}: batchrun writes JSONL (.jsonl) or Parquet (.parquet), "
                         f"not {output.suffix}")
    roots = [media.roots] if isinstance(media.roots, str | Path) else list(media.roots)
    timeout = media.timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise UsageError(f"--media-timeout must be over 0 seconds, got {timeout!r}")
    rows = RowOptions(defaults, o.labels.system, o.labels.prompt_template, o.io.id_column,
                      o.sampling.n,
                      image_column=media.image_column,
                      media_roots=tuple(Path(root).absolute() for root in roots),
                      allow_private_urls=bool(media.allow_private_urls),
                      media_timeout=float(timeout),
                      served_model_names=served_names(o.sampling.served_model_name),
                      expected_column=o.labels.expected_column,
                      answer_prefix=_answer_prefix(o.labels.answer_prefix),
                      keep_columns=_keep_columns(o.io.keep_columns), limits=limits)
    if from_stdin:  # relative image paths in rows from stdin start at the current folder
        rows.base_dir = Path.cwd()
    spec = JobSpec(input_path, job_dir, output, o.model, rows, restart=o.restart, quiet=o.quiet)
    return spec, config, constraint, sources


def _answer_prefix(prefix: str | None) -> str | None:
    """--answer-prefix: a text (a shell's literal \\n warned of, as in --prompt-template)."""
    if prefix is None:
        return None
    if not isinstance(prefix, str) or not prefix:
        raise UsageError("--answer-prefix must not be empty")
    if "\\n" in prefix:
        log.warning("--answer-prefix holds a backslash and an n, not a line break (a shell "
                    "keeps them): write $'...\\n...' in bash, or a real line break")
    return prefix


def _check_job_dir_path(job_dir: Path) -> None:
    """--job-dir must name a folder, or a path where one can be made."""
    for path in (job_dir, *job_dir.parents):
        if os.path.lexists(path):
            if path.is_dir():
                return
            kind = "a symbolic link" if path.is_symlink() else "a file"
            what = f"is {kind}, not a folder" if path == job_dir else \
                f"cannot be a folder: {path} is {kind}"
            raise UsageError(f"--job-dir {job_dir} {what}: pass a folder's path (it is made if "
                             "absent)")


def _check_image_column(o: RunOptions) -> None:
    """--image-column needs a vision model: said before the model loads when its config is
    here to read (else loading it says so)."""
    if not o.media.image_column or o.media.vision or o.ray.address:
        return
    from batchrun.models import is_vision_config, read_config, resolve

    config = read_config(resolve(o.model))
    if config and not is_vision_config(config):
        raise UsageError(IMAGE_COLUMN_NEEDS_VISION)


IMAGE_COLUMN_NEEDS_VISION = ("--image-column needs a vision model (pass --model with one, or "
                             "--vision to force the vision path)")


def _constraint(o: LabelOptions, limits: RowLimits):
    """The job-wide constraint from json_schema, choices or regex (at most one), checked to
    compile as far as it can be without the model's tokenizer."""
    from batchrun.engine.types import Constraint, ConstraintError
    from batchrun.job.rows import RowRejected, check_choices

    given = [f"--{name.replace('_', '-')}" for name in ("json_schema", "choices", "regex")
             if getattr(o, name) is not None]
    if len(given) > 1:
        raise UsageError(f"give at most one of {', '.join(given)}")
    try:
        if o.json_schema is not None:
            path = Path(o.json_schema)
            if not path.is_file():
                raise UsageError(f"--json-schema: file not found: {path}")
            constraint = Constraint.json_schema(path.read_text())
        elif o.choices is not None:
            choices = o.choices
            if isinstance(choices, str):
                choices = [c.strip() for c in choices.split(",")]
            check_choices(list(choices), limits, "--choices")
            constraint = Constraint.choices(list(choices))
        elif o.regex is not None:
            constraint = Constraint.regex(o.regex)
        else:
            return None
    except ConstraintError as e:
        raise UsageError(f"{given[0]}: {e}") from None
    except RowRejected as e:
        raise UsageError(str(e)) from None
    problem = _grammar_problem(constraint)
    if problem:
        raise UsageError(f"{given[0]}: {constraint.describe()} does not compile: {problem}")
    return constraint


def _grammar_problem(constraint) -> str | None:
    """Why the constraint's grammar is invalid whatever the tokenizer (a bad regex, an
    unknown schema type), or None."""
    import llguidance

    try:
        error = llguidance.LLMatcher.validate_grammar(constraint.grammar())
    except ValueError as e:
        error = str(e)
    if not error or error.startswith("WARNING"):
        return None
    return " ".join(error.split())[:300]


def _check_template(template: str | None) -> None:
    """--prompt-template must be a format string (its columns are checked row by row)."""
    from batchrun.job.rows import template_fields

    if template is None:
        return
    if not template.strip():
        raise UsageError("--prompt-template must not be empty")
    if "\\n" in template:
        log.warning("--prompt-template holds a backslash and an n, not a line break (a shell "
                    "keeps \\n as it is): write $'...\\n...' in bash, or a real line break "
                    "inside the quotes; in a job file \\n is a line break")
    try:
        fields = template_fields(template)
    except ValueError as e:
        raise UsageError(f"--prompt-template {template!r}: {e} (write {{{{ and }}}} for "
                         "literal braces)") from None
    for name, column in fields:  # a column by name, or an item of one: {col} {col[key]}
        if not column or column.isdigit() or "." in name:
            raise UsageError(f"--prompt-template: {{{name}}} does not name a column: write "
                             "{column} or {column[key]} (no positions or attributes)")


def _keep_columns(value: str | list[str] | None) -> tuple[str, ...]:
    """--keep-columns: "a,b" or a job file's list; "all" for every column."""
    from batchrun.job.rows import ALL_COLUMNS

    if value is None:
        return ()
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else list(value)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise UsageError("--keep-columns takes column names separated by commas, or all")
    if names == ["all"]:
        return ALL_COLUMNS
    return tuple(dict.fromkeys(names))
