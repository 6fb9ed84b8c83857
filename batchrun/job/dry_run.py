"""A dry run: every row read and its prompt tokens counted, the share of them a prefix cache would
reuse measured, and a few rows spread over the input timed through the engine to estimate the
job's time. It writes nothing: no job folder, no output, no prefix-cache entry."""

from __future__ import annotations

from dataclasses import dataclass

PROBE_ROWS = 8  # rows a dry run times through the engine


@dataclass(slots=True)
class DryRun:
    """What `Job.dry_run` found: rows, prompt tokens, the share a prefix cache would reuse, and
    a time estimate from a probe (None without a row to probe)."""

    rows: int
    row_errors: int
    first_error: str | None
    prompt_tokens: int
    shared_tokens: int  # prompt tokens in blocks an earlier row already has (computed once)
    sharing_rows: int  # rows that start with such blocks
    max_new_tokens: int  # the most tokens the rows may generate (their max_tokens, summed)
    max_concurrency: int = 0  # the engine's
    probe_rows: int = 0
    probe_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    mean_completion_tokens: float = 0.0
    estimate_s: float | None = None
    first_prompt: str | None = None  # the first row's prompt as the model sees it

    @property
    def shared_share(self) -> float:
        return self.shared_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def count_and_probe(engine, spec, probe_rows: int) -> DryRun:
    """Count every row's prompt tokens and the shared-prefix share, then probe."""
    from collections import OrderedDict

    from batchrun.cache.prefix import block_keys
    from batchrun.io.readers import read_rows
    from batchrun.job.rows import RowError, build_task, read_error

    total = spec.rows_total
    # Probe rows spread over the input: the first row at or after each of these.
    wanted = sorted({i * total // probe_rows for i in range(min(probe_rows, total))},
                    reverse=True)
    probe, seen = [], OrderedDict()
    block = engine.config.prefix_block_size
    found = DryRun(0, 0, None, 0, 0, 0, 0, engine.max_concurrency)
    for raw in read_rows(spec.input, 0, spec.rows.limits.row_bytes):
        found.rows += 1
        task = (read_error(raw, spec.rows.id_column) if raw.error is not None
                else build_task(raw.value, raw.index, raw.line, engine.prompts, spec.rows))
        if isinstance(task, RowError):
            found.row_errors += 1
            found.first_error = found.first_error or f"line {task.line}: {task.message}"
            continue
        ids = task.prompt_ids
        if found.first_prompt is None:
            found.first_prompt = engine.tokenizer.decode(ids)
        found.prompt_tokens += len(ids) + sum(map(len, task.more_prompts))
        found.max_new_tokens += task.params.max_tokens * task.samples
        shared = _shared_blocks(block_keys(ids, block, b""), seen)
        if shared:
            found.sharing_rows += 1
            found.shared_tokens += min(shared * block, len(ids) - 1)  # one token is computed
        if wanted and raw.index >= wanted[-1]:
            wanted.pop()
            probe.append(task)
    if probe:
        _probe(engine, probe, found)
    return found


SHARED_KEYS_KEPT = 1 << 18  # block keys a dry run remembers (a prefix cache is bounded too)


def _shared_blocks(keys: list[bytes], seen) -> int:
    """How many leading blocks of a prompt an earlier row already has; remembers its own."""
    shared = 0
    for key in keys:
        if key not in seen:
            break
        seen.move_to_end(key)
        shared += 1
    for key in keys[shared:]:
        seen[key] = None
    while len(seen) > SHARED_KEYS_KEPT:
        seen.popitem(last=False)
    return shared


def _probe(engine, tasks: list, found: DryRun) -> None:
    """Run `tasks` through the engine; extrapolate to every row from its prefill and decode
    rates (a probe batch is small: a full one decodes faster, so this leans long)."""
    import time

    start = time.perf_counter()
    for task in tasks:
        for params in task.sample_params():
            engine.add_tokens(task.prompt_ids, params, task.vision)
    completion = 0
    while engine.has_work():
        completion += sum(out.completion_tokens for out in engine.step())
    stats = engine.stats
    found.probe_rows = len(tasks)
    found.probe_s = time.perf_counter() - start
    found.prefill_tokens_per_s = stats.prefill_tokens_per_s
    found.decode_tokens_per_s = stats.decode_tokens_per_s
    found.mean_completion_tokens = completion / len(tasks)
    rows = found.rows - found.row_errors
    generated = min(found.mean_completion_tokens * rows, found.max_new_tokens)
    computed = found.prompt_tokens - found.shared_tokens
    per_row = found.probe_s / len(tasks)
    prefill = computed / found.prefill_tokens_per_s if found.prefill_tokens_per_s else 0.0
    decode = generated / found.decode_tokens_per_s if found.decode_tokens_per_s else 0.0
    found.estimate_s = prefill + decode if prefill + decode > 0 else per_row * rows
