"""Write result and error records in input order, holding out-of-order completions only until
the gap before them fills."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from batchrun.engine.request import Output
from batchrun.job.state import Progress


class OrderedSink:
    """Writes result and error records in input order, holding out-of-order ones until the gap
    before them fills; keeps the Progress that describes exactly what it has written."""

    def __init__(self, results: Path, errors: Path, progress: Progress):
        self.progress = dataclasses.replace(progress)
        # Held open for the sink's life; close() closes them.
        self._results = open(results, "ab")  # noqa: SIM115
        self._errors = open(errors, "ab")  # noqa: SIM115
        self._held: dict[int, tuple[bytes, bool, Output | None]] = {}

    def put(self, index: int, line: bytes, is_error: bool, outs: list[Output] = ()) -> None:
        """Hold row `index`'s line (with its outputs, one per sample) until it is next."""
        if index < self.progress.next_index or index in self._held:
            raise RuntimeError(f"row {index} would be written twice")
        self._held[index] = (line, is_error, outs)
        p = self.progress
        while p.next_index in self._held:
            line, is_error, outs = self._held.pop(p.next_index)
            if is_error:
                self._errors.write(line)
                p.errors_bytes += len(line)
                p.rows_failed += 1
            else:
                self._results.write(line)
                p.results_bytes += len(line)
                p.rows_done += 1
                p.prompt_tokens += outs[0].prompt_tokens
                p.cached_tokens += outs[0].cached_tokens
                p.completion_tokens += sum(o.completion_tokens for o in outs)
            p.next_index += 1

    @property
    def held(self) -> int:
        return len(self._held)

    def sync(self) -> Progress:
        """Flush and fsync both files; returns the progress that is now durable."""
        for f in (self._results, self._errors):
            f.flush()
            os.fsync(f.fileno())
        return dataclasses.replace(self.progress)

    def close(self) -> None:
        self._results.close()
        self._errors.close()
