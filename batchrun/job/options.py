"""A job's options (`batchrun.Job`'s, `batchrun run`'s) as one object of small parts, a part a
topic, under the headings `run --help` lists them by: `opts.sampling.temperature`,
`opts.media.timeout`, `opts.ray.address`; the model, restart and quiet at the top.

FLAT is the one table of where each flat keyword goes (the `run` flag's name with `_`, a job
file's key): most keep their name in their part; a field that drops its part's prefix says its
flat name beside it (`media_timeout` is `media.timeout`). Only the standard library is imported
here: the command line may read it before any model code loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchrun.job.errors import UsageError

SLICE_ROWS = 64  # rows per slice handed to a Ray actor


def _flat(name: str, default: Any) -> Any:
    """A field whose flat keyword is `name` (not its own name)."""
    return field(default=default, metadata={"flat": name})


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Sampling defaults for rows that set none (None: the model's generation_config.json's,
    else SamplingParams' own; `Job.sampling_defaults` says which), and what each answer
    carries."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    max_thinking_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    # An OpenAI row whose body.model names none of these is that row's error (None: any).
    served_model_name: str | tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class LabelOptions:
    """How rows become prompts, and what every answer must be (at most one constraint)."""

    prompt_template: str | None = None
    system: str | None = None
    answer_prefix: str | None = None  # the assistant's answer begins so; results hold the rest
    choices: str | list[str] | None = None
    json_schema: Path | None = None
    regex: str | None = None
    expected_column: str | None = None  # each row's right answer: records and report accuracy


@dataclass(frozen=True, slots=True)
class IOOptions:
    """Where the rows come from and the results go."""

    output: Path | None = None
    job_dir: Path | None = None  # required for rows from stdin (input "-")
    format: str | None = None  # "jsonl" or "parquet" whatever the input's suffix
    id_column: str | None = None
    keep_columns: str | list[str] | None = None  # "a,b", ["a", "b"] or "all"


@dataclass(frozen=True, slots=True)
class MediaOptions:
    """Image rows: where their images may come from, and the vision backend."""

    image_column: str | None = None
    roots: tuple[Path, ...] = _flat("media_root", ())  # + the input's folder
    allow_private_urls: bool = False
    timeout: float = _flat("media_timeout", 30.0)  # seconds one image may take to fetch
    vision: bool = False


@dataclass(frozen=True, slots=True)
class CacheOptions:
    """The prefix cache: its folder, and whether rows share one copy of a cached prefix."""

    dir: Path | None = _flat("cache_dir", None)  # None: $BATCHRUN_CACHE_DIR or ~/.cache/batchrun
    no_prefix_cache: bool = False
    no_shared_prefix: bool = False


@dataclass(frozen=True, slots=True)
class SpeculationOptions:
    """Speculative decoding while few rows run."""

    method: str | None = _flat("speculate", None)  # off, ngram, draft; None: draft if a model
    draft_model: str | None = None
    # None: the method's default on this device (a number given without speculation: said)
    draft_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class RayOptions:
    """A job sharded over a Ray cluster (job/distributed.py): None address, this process."""

    address: str | None = _flat("ray_address", None)  # "local": a cluster in this process
    actors: int = _flat("ray_actors", 2)
    num_cpus: float = _flat("ray_num_cpus", 1.0)
    num_gpus: float = _flat("ray_num_gpus", 0.0)
    slice_rows: int = _flat("ray_slice_rows", SLICE_ROWS)


@dataclass(frozen=True, slots=True)
class LimitOptions:
    """The engine's limits and the rows' size limits."""

    max_concurrency: int | None = None
    memory_utilization: float = 0.85
    prefill_batch_size: int | None = None  # None: rows are bounded by tokens (the device's)
    prefill_step_size: int = 2048
    weights: str = "auto"  # how a quantized model is held: auto, quantized, dequantized
    # Row size limits as NAME=VALUE items or a mapping (job.limits.RowLimits; docs/limits.md).
    rows: tuple[str, ...] | dict | None = _flat("limit", None)


@dataclass(frozen=True, slots=True)
class RunOptions:
    """Every option of a job, in parts. `from_flat` builds one from `run`'s flat keywords."""

    model: str | None = None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    labels: LabelOptions = field(default_factory=LabelOptions)
    io: IOOptions = field(default_factory=IOOptions)
    media: MediaOptions = field(default_factory=MediaOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)
    ray: RayOptions = field(default_factory=RayOptions)
    limits: LimitOptions = field(default_factory=LimitOptions)
    restart: bool = False
    quiet: bool = True

    @classmethod
    def from_flat(cls, **options: Any) -> RunOptions:
        """The options from flat keywords (`temperature=`, `media_timeout=`, `ray_address=`:
        FLAT says where each goes) and whole parts (`sampling=SamplingOptions(...)`); a flat
        keyword wins over the same field of a part given whole. UsageError names an unknown
        keyword, or a part given as something else."""
        unknown = sorted(set(options) - set(FLAT) - set(PARTS))
        if unknown:
            raise UsageError(f"unknown options {', '.join(unknown)}; known: {', '.join(FLAT)}; "
                             f"or whole parts: {', '.join(PARTS)}")
        parts = {}
        for key, part in PARTS.items():
            given = options.get(key, part())
            if not isinstance(given, part):
                raise UsageError(f"{key} takes a {part.__name__} (or its fields as keywords), "
                                 f"got {given!r}")
            changes = {name: options[flat] for flat, (where, name) in FLAT.items()
                       if where == key and flat in options}
            parts[key] = dataclasses.replace(given, **changes)
        return cls(**{name: options[name] for name in TOP_LEVEL if name in options}, **parts)


# RunOptions' parts by attribute name, in the order `run --help` lists them.
PARTS: dict[str, type] = {"sampling": SamplingOptions, "labels": LabelOptions, "io": IOOptions,
                          "media": MediaOptions, "cache": CacheOptions,
                          "speculation": SpeculationOptions, "ray": RayOptions,
                          "limits": LimitOptions}
TOP_LEVEL = ("model", "restart", "quiet")


def _flat_names() -> dict[str, tuple[str | None, str]]:
    names: dict[str, tuple[str | None, str]] = {name: (None, name) for name in TOP_LEVEL}
    for key, part in PARTS.items():
        for f in dataclasses.fields(part):
            names[f.metadata.get("flat", f.name)] = (key, f.name)
    return names


# Each flat keyword -> (its part, None for RunOptions' own fields; the field's name there).
FLAT = _flat_names()
