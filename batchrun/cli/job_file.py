"""Job files: a TOML file of `run`'s options, merged under the command line's (a flag given wins).

A value is checked as its flag's would be, and a bad one is a usage error naming the file and
the key; paths in the file are relative to the file.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import click
from click.core import ParameterSource

from batchrun.cli.errors import fail
from batchrun.cli.options import STDIN

# Job-file keys (TOML) and the `run` parameters they set; paths are relative to the job file.
JOB_FILE_KEYS = ("input", "model", "output", "job_dir", "format", "max_concurrency",
                 "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "max_thinking_tokens", "served_model_name", "system", "answer_prefix",
                 "prompt_template", "id_column", "expected_column", "keep_columns",
                 "memory_utilization", "prefill_batch_size",
                 "prefill_step_size", "weights", "cache_dir", "no_prefix_cache", "no_shared_prefix",
                 "speculate", "draft_model", "draft_tokens", "json_schema", "choices",
                 "regex", "n", "logprobs", "top_logprobs", "image_column", "media_root",
                 "allow_private_urls", "media_timeout", "vision", "ray_address",
                 "ray_actors", "ray_num_cpus", "ray_num_gpus", "ray_slice_rows", "limit")
JOB_FILE_PATHS = ("input", "output", "job_dir", "cache_dir", "json_schema")


def merge_job_file(ctx: click.Context, path: Path, opts: dict) -> dict:
    """Job-file values for the options not given on the command line, checked as the flags'
    values are (a bad one is a usage error naming the file and the key)."""
    if not path.is_file():
        raise fail(f"job file not found: {path}", code=2)
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise click.UsageError(f"{path} is not valid TOML: {e}") from None
    except OSError as e:
        raise fail(f"{path} cannot be read: {e.strerror or e}", code=2) from None
    unknown = sorted(set(data) - set(JOB_FILE_KEYS))
    if unknown:
        raise click.UsageError(f"{path}: unknown keys {', '.join(unknown)}; known: "
                               f"{', '.join(JOB_FILE_KEYS)}")
    if not isinstance(data.get("input"), str):
        raise click.UsageError(f"{path}: the job file needs an 'input' key naming the input "
                               "file (relative to the job file)")
    params = {p.name: p for p in ctx.command.params}
    merged = dict(opts)
    given = {key for key in data if key != "input"
             and ctx.get_parameter_source(key) is ParameterSource.COMMANDLINE}
    for key, value in data.items():
        if key in given:
            continue  # the command line wins
        if key == "input":
            merged["input"] = Path(value) if value == STDIN else path.parent / value
            continue
        if key == "output" and value == STDIN:  # stdout, as with -o -
            merged["output"] = Path(STDIN)
            continue
        if key == "output" and ctx.get_parameter_source("job_dir") is ParameterSource.COMMANDLINE:
            # The job's state moves to another folder: so does its output, or two jobs would
            # write one file.
            merged["output"] = Path(opts["job_dir"]) / Path(_job_file_str(path, key,
                                                                         value)).name
            merged["_output_follows_job_dir"] = True
            continue
        if key in JOB_FILE_PATHS:
            value = path.parent / _job_file_str(path, key, value)
        elif key in ("model", "draft_model") and not _job_file_str(path, key, value).strip():
            raise click.UsageError(f"{path}: {key} is empty: name a model folder or a Hugging "
                                   "Face id, or leave the key out")
        elif key in ("model", "draft_model") and \
                (path.parent / _job_file_str(path, key, value)).exists():
            value = str(path.parent / value)
        elif key == "stop" and isinstance(value, str):
            value = (value,)
        elif key == "limit" and isinstance(value, dict):  # [limit] row-bytes = "128M"
            value = tuple(f"{name}={v}" for name, v in value.items())
        elif key == "media_root":  # one folder or a list, each relative to the job file
            value = tuple(path.parent / _job_file_str(path, key, v)
                          for v in ([value] if isinstance(value, str) else value))
        merged[key] = _job_file_value(ctx, params[key], path, key, value)
    return merged


def _job_file_str(path: Path, key: str, value) -> str:
    if not isinstance(value, str):
        raise click.UsageError(f"{path}: {key} must be a string (a path relative to the job "
                               f"file), got {value!r}")
    return value


def _job_file_value(ctx: click.Context, param: click.Parameter, path: Path, key: str, value):
    """A job file's value as its flag would give it (type and range checked)."""
    if key == "choices" and isinstance(value, list):  # a list: labels may hold commas
        if value and all(isinstance(v, str) for v in value):
            return value
        raise click.UsageError(f"{path}: choices must be a list of strings, got {value!r}")
    if isinstance(value, dict) or (isinstance(value, list) and not param.multiple):
        raise click.UsageError(f"{path}: {key} takes one value, got {value!r}")
    if param.multiple and not isinstance(value, list | tuple):
        value = (value,)
    is_flag = isinstance(param, click.Option) and param.is_flag
    for v in value if param.multiple else (value,):
        if isinstance(v, bool) and not is_flag:  # TOML true is not the number 1
            raise click.UsageError(f"{path}: {key} = {str(v).lower()}: a value is needed, "
                                   "not true or false")
        if isinstance(v, float) and isinstance(param.type, click.types.IntParamType):
            raise click.UsageError(f"{path}: {key} = {v!r}: {v!r} is not a valid integer")
    try:
        return param.type_cast_value(ctx, value)
    except click.BadParameter as e:
        raise click.UsageError(f"{path}: {key} = {value!r}: {e.message}") from None
