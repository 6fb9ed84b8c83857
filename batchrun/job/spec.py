"""A job's spec: its input, job folder, output, model and row options, and the options that make
a resumed job the same job (job.json keeps them). Before any work (the model is not loaded yet),
`check_paths` refuses an output the job may not write, a folder that may not be its job folder,
job files that are not regular files, and a folder that holds another job (`job_changes` says
what differs, option by option, with the flag that sets it)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from batchrun.io.jsonl import InputError
from batchrun.io.readers import count_rows, input_format, read_rows
from batchrun.job import manifest as mf
from batchrun.job import ownership
from batchrun.job.errors import EmptyInput, InputMismatch, JobConflict, JobError
from batchrun.job.rows import ALL_COLUMNS, RowOptions, is_openai_line, template_fields
from batchrun.job.state import DamagedFile


@dataclass(slots=True)
class JobSpec:
    input: Path
    job_dir: Path
    output: Path
    model: str | None
    rows: RowOptions
    restart: bool = False
    quiet: bool = False
    _input_fingerprint: dict | None = None
    _rows_total: int | None = None

    @property
    def input_fingerprint(self) -> dict:
        """The input's size and hash (computed once: the file may be large)."""
        if self._input_fingerprint is None:
            self._input_fingerprint = mf.input_fingerprint(self.input)
        return self._input_fingerprint

    @property
    def rows_total(self) -> int:
        """How many rows the input holds (counted once); JobError if it is damaged or empty."""
        if self._rows_total is None:
            try:
                self._rows_total = count_rows(self.input, self.rows.limits.row_bytes)
            except InputError as e:
                raise JobError(str(e)) from None
            if self._rows_total == 0:
                header_only = input_format(self.input) in ("csv", "tsv")
                raise EmptyInput(f"{self.input} has no rows" + (
                    " under its header row (a JSONL file? pass --format jsonl)"
                    if header_only else ""))
        return self._rows_total

    @property
    def parquet_output(self) -> bool:
        return self.output.suffix.lower() == ".parquet"

    @property
    def results_path(self) -> Path:
        """Where ordered results are appended: the output itself, or a JSONL beside it."""
        return self.job_dir / "results.jsonl" if self.parquet_output else self.output

    @property
    def errors_path(self) -> Path:
        return self.job_dir / "errors.jsonl"

    def options(self) -> dict:
        """The options that change outputs: a resumed job must use the same ones."""
        r = self.rows
        sampling = dataclasses.asdict(r.defaults)
        # Added later, and recorded only when set, so that older job folders still match.
        del sampling["thinking"]  # a row's own request, never the job's
        if sampling["max_thinking_tokens"] is None:
            del sampling["max_thinking_tokens"]
        options = {"sampling": sampling, "system": r.system,
                   "prompt_template": r.prompt_template, "id_column": r.id_column, "n": r.n,
                   "image_column": r.image_column,
                   "output": _relative_output(self.output, self.job_dir)}
        if r.served_model_names:
            options["served_model_names"] = list(r.served_model_names)
        if r.expected_column:  # the records carry its values, the report counts against them
            options["expected_column"] = r.expected_column
        if r.keep_columns:  # the records carry them
            options["keep_columns"] = list(r.keep_columns)
        if r.answer_prefix is not None:  # the prompts end with it
            options["answer_prefix"] = r.answer_prefix
        return orjson.loads(orjson.dumps(options))  # as job.json stores it (tuples are lists)


def saved_manifest(job_dir: Path) -> dict | None:
    """The job folder's job.json, or None for a new job; JobError if it is damaged."""
    try:
        return mf.saved_manifest(job_dir)
    except DamagedFile as e:
        raise JobError(str(e)) from None


def saved_output(job_dir: Path) -> Path | None:
    """The output of the job in `job_dir` when it is not the folder's own results.jsonl
    (None: no job there, or that one); JobError if its job.json is damaged."""
    manifest = saved_manifest(job_dir)
    if manifest is None:
        return None
    output = _saved_output(manifest, job_dir)
    if output is None or output == ownership.full(Path(job_dir) / "results.jsonl"):
        return None
    return output


def check_paths(spec: JobSpec) -> None:
    """Refuse, before any work (the model is not loaded yet), an output this job may not
    write, a folder that may not be its job folder (job/ownership.py), job files that are not
    regular files, and a job folder that holds another input or options."""
    spec.rows_total  # noqa: B018  (a damaged or empty input is said before the model loads)
    check_template_columns(spec)
    manifest = saved_manifest(spec.job_dir)
    try:
        ownership.check_output_file(spec.output)  # before anything resolves it
        ownership.check_job_dir(spec.job_dir, manifest is not None)
        owned = manifest is not None and _saved_output(manifest, spec.job_dir) == \
            ownership.full(spec.output)
        ownership.check(spec.output, spec.input, spec.job_dir, owned)
    except ownership.OutputConflict as e:
        raise JobConflict(str(e)) from None
    # Files the job appends to must be plain files; state.json is only ever replaced whole
    # (whatever stands there, unless a folder).
    appended = [spec.errors_path, spec.job_dir / "spill.jsonl", spec.job_dir / "lock"]
    if spec.parquet_output:
        appended.append(spec.results_path)
    state = spec.job_dir / "state.json"
    try:
        for path in appended:
            ownership.check_job_file(path)
        if state.is_dir() and not state.is_symlink():
            ownership.check_job_file(state)
    except ownership.OutputConflict as e:
        raise JobError(str(e)) from None
    try:
        for path in (spec.results_path, spec.errors_path):
            ownership.check_records_file(path)
    except ownership.OutputConflict as e:
        raise JobConflict(str(e)) from None
    if manifest is not None and not spec.restart:
        check_same_job(spec, manifest, {"input": spec.input_fingerprint,
                                        "options": spec.options()})


def _relative_output(output: Path, job_dir: Path) -> str:
    """The output as job.json compares it: relative to the job folder, so that a job folder
    moved with its output inside it is still the same job."""
    return os.path.relpath(ownership.full(output), ownership.full(job_dir))


def _saved_output(manifest: dict, job_dir: Path) -> Path | None:
    saved = manifest["options"].get("output")
    if not isinstance(saved, str):
        return None
    return ownership.full(Path(job_dir) / saved)  # an older job.json's absolute path stays


def check_same_job(spec: JobSpec, old: dict, new: dict) -> None:
    saved = _saved_output(old, spec.job_dir)
    if saved is not None:  # compared as a place, whether job.json wrote it relative or not
        old = {**old, "options": {**old["options"],
                                  "output": _relative_output(saved, spec.job_dir)}}
    changed = mf.differences(old, new)
    if changed:
        raise JobConflict(f"{spec.job_dir} holds a different job: " + "; ".join(changed)
                          + ".\n  Pass --restart to run this job in its place (its progress "
                          "is discarded), or another --job-dir to keep both.")


def different_job(job_dir: Path, changes: list[str]) -> str:
    """The refusal of a job folder that holds another job: what differs, and what to do."""
    return (f"{job_dir} holds a different job, so it was not resumed:\n"
            + "".join(f"  {c}\n" for c in changes)
            + "To run this job in its place, pass --restart (the folder's progress is "
            "discarded); to keep both jobs, pass another --job-dir.")


def job_changes(old: dict, input_fp: dict, options: dict, model_fp: str | None,
                model: str | None, defaults_from: dict[str, str]) -> list[str]:
    """What differs between the job in a job folder (its job.json) and this one, one line
    each: the option (and its flag), the old and the new value."""
    changes = []
    if old["input"]["sha256"] != input_fp["sha256"]:
        changes.append(f"the input changed: {old['input']['path']} "
                       f"({old['input']['size']:,} bytes) -> {input_fp['path']} "
                       f"({input_fp['size']:,} bytes)")
    if model_fp is not None and old["model"]["fingerprint"] != model_fp:
        changes.append(f"the model changed: {old['model']['name']} "
                       f"({old['model']['path']}) -> {model or 'demo'} (other files)")
    before, after = _flat(old["options"]), _flat(options)
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if a != b:
            where = defaults_from.get(key)
            why = " (the model's generation_config.json)" if where == "generation_config.json" \
                else ""
            changes.append(f"{key} ({OPTION_FLAGS.get(key, 'option')}): {_shown(a)} -> "
                           f"{_shown(b)}{why}")
    return changes


# job.json's option names and the flags that set them.
OPTION_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature",
                "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p", "seed": "--seed",
                "stop": "--stop", "logprobs": "--logprobs", "top_logprobs": "--top-logprobs",
                "constraint": "--json-schema, --choices or --regex",
                "max_thinking_tokens": "--max-thinking-tokens", "system": "--system",
                "answer_prefix": "--answer-prefix",
                "prompt_template": "--prompt-template", "id_column": "--id-column", "n": "--n",
                "image_column": "--image-column", "output": "-o",
                "served_model_names": "--served-model-name",
                "expected_column": "--expected-column", "keep_columns": "--keep-columns",
                "repetition_penalty": "generation_config.json"}


def _flat(options: dict) -> dict:
    """job.json's options with the sampling defaults' fields at the top level."""
    flat = {k: v for k, v in options.items() if k != "sampling"}
    sampling = options.get("sampling")
    if isinstance(sampling, dict):
        flat.update(sampling)
    return flat


def _shown(value: Any, limit: int = 60) -> str:
    """An option's value in a message: short, JSON-like, `unset` for None."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int | float):
        return f"{value:g}" if isinstance(value, float) else str(value)
    text = json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def default_job_dir(input_path: Path) -> Path:
    return Path("jobs") / input_stem(input_path)


def input_stem(path: Path) -> str:
    name = path.name
    for suffix in (".jsonl.gz", ".ndjson.gz", ".csv.gz", ".tsv.gz", ".jsonl", ".ndjson",
                   ".parquet", ".csv", ".tsv", ".toml", ".json"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


TEMPLATE_SAMPLE = 100  # rows read to check --prompt-template's columns before the model loads


def input_is_openai(spec: JobSpec) -> bool:
    """Whether the input's first readable rows are lines of an OpenAI batch file."""
    try:
        for raw in itertools.islice(read_rows(spec.input, 0, spec.rows.limits.row_bytes),
                                    TEMPLATE_SAMPLE):
            if raw.error is None and isinstance(raw.value, dict):
                return is_openai_line(raw.value)
    except InputError:
        pass  # said as the input's own problem, elsewhere
    return False


def check_template_columns(spec: JobSpec) -> None:
    """Refuse (exit 2) what would fail every row, from the input's first rows (a Parquet
    file's schema, a JSONL file's first rows): a --prompt-template naming a column none of the
    rows it would fill has; and, without a template, rows none of which has a prompt or
    messages, where the rows read are all there are (or Parquet: one schema). The message
    lists the columns there are. A row with its own prompt or messages, or in the OpenAI batch
    shape, takes no template: the input is not refused."""
    template = spec.rows.prompt_template
    needed = list(dict.fromkeys(c for _, c in template_fields(template or "")))
    whole = spec.rows_total <= TEMPLATE_SAMPLE
    seen: dict[str, None] = {}
    filled = unreadable = 0
    has_prompts = False
    try:
        for raw in itertools.islice(read_rows(spec.input, 0, spec.rows.limits.row_bytes),
                                    TEMPLATE_SAMPLE):
            row = raw.value
            if raw.error is not None or not isinstance(row, dict):
                whole = False  # a row in error: not a question of columns
                unreadable += raw.code == "invalid_json"
                continue
            seen.update(dict.fromkeys(row))
            if is_openai_line(row) or "prompt" in row or "messages" in row:
                has_prompts = True
                continue
            filled += 1
    except InputError:
        return  # said as the input's own problem, elsewhere
    _check_not_delimited(spec, unreadable, filled or has_prompts)
    _check_named_columns(spec, seen, whole)
    if has_prompts:
        return
    there = _columns_there(seen)
    # A CSV header that is a JSON object: a JSONL file read as CSV
    looks_jsonl = input_format(spec.input) in ("csv", "tsv") and \
        any(str(c).lstrip().startswith("{") for c in seen)
    jsonl_hint = " (the file looks like JSONL: pass --format jsonl)" if looks_jsonl else ""
    if template is None:
        if filled and (whole or input_format(spec.input) != "jsonl"):  # or one schema
            raise InputMismatch(
                f"the input's rows have no 'prompt' or 'messages' column (columns there: "
                f"{there}): pass --prompt-template \"Classify: {{column}}\" to build each "
                f"row's prompt from its columns{jsonl_hint}")
        return
    missing = [c for c in needed if c not in seen]
    if not filled or not missing:
        return
    hint = ""
    if any(c.lstrip().startswith('"') for c in missing):
        hint = " (braces that are not a column, as in JSON, are written {{ and }})"
    rows = "input's only row does" if filled == 1 and whole else \
        f"input's {filled:,} rows do" if whole else f"input's first {filled:,} rows do"
    raise InputMismatch(
        f"--prompt-template names column{'s' if len(missing) > 1 else ''} "
        f"{', '.join(_column_name(c) for c in missing)}, which the {rows} not have; columns "
        f"there: {there or 'none'}{hint or jsonl_hint}")


def _check_not_delimited(spec: JobSpec, unreadable: int, readable: bool) -> None:
    """Rows read as JSONL none of which is JSON, the first line like a CSV or TSV header (rows
    piped to stdin carry no suffix): refused, naming --format."""
    if readable or not unreadable or input_format(spec.input) != "jsonl":
        return
    try:
        with open(spec.input, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return
    delimiter = "tsv" if b"\t" in first else "csv" if b"," in first else None
    if delimiter is None or first.lstrip().startswith((b"{", b"[")):
        return
    raise InputMismatch(f"the input's rows are not JSON; its first line reads like a "
                        f"{delimiter.upper()} header: pass --format {delimiter}")


def _check_named_columns(spec: JobSpec, seen: dict[str, None], whole: bool) -> None:
    """--keep-columns and --expected-column naming a column none of the first rows has
    (where any row had columns): refused, listing the columns there are."""
    if not seen:
        return
    named = [(flag, c) for flag, cols in (("--keep-columns", spec.rows.keep_columns),
                                          ("--expected-column", (spec.rows.expected_column,)))
             if cols != ALL_COLUMNS for c in cols if c]
    missing = [(flag, c) for flag, c in named if c not in seen]
    if not missing:
        return
    there = _columns_there(seen)
    rows = "input's rows" if whole else f"input's first {TEMPLATE_SAMPLE:,} rows"
    flag, column = missing[0]
    raise InputMismatch(f"{flag} names column {_column_name(column)}, which the {rows} do not "
                        f"have; columns there: {there}")


def _columns_there(seen: dict[str, None], most: int = 20) -> str:
    """The columns the rows read have, for a message: the first `most`, then how many more."""
    names = [_column_name(c) for c in seen]
    return ", ".join(names[:most]) + (f" and {len(names) - most} more"
                                      if len(names) > most else "")


def _column_name(name: str, limit: int = 40) -> str:
    """A column's name for a message: quoted, escaped, cut short."""
    text = name if len(name) <= limit else name[:limit] + "..."
    return repr(text)
