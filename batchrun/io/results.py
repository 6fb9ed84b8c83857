"""Write results in input order, holding out-of-order completions only until the gap fills."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO


class OrderedWriter:
    """Append records to a file in index order; `skip(i)` marks an index that has no record."""

    def __init__(self, path: str | Path, next_index: int = 0, mode: str = "ab"):
        self.path = Path(path)
        self.next_index = next_index
        self._held: dict[int, bytes | None] = {}
        self._file: BinaryIO = open(self.path, mode)

    def put(self, index: int, record: bytes | None) -> None:
        if index < self.next_index or index in self._held:
            raise ValueError(f"row {index} was already written")
        self._held[index] = record
        while self.next_index in self._held:
            line = self._held.pop(self.next_index)
            if line is not None:
                self._file.write(line)
            self.next_index += 1

    def skip(self, index: int) -> None:
        self.put(index, None)

    @property
    def held(self) -> int:
        return len(self._held)

    def flush(self, sync: bool = False) -> None:
        self._file.flush()
        if sync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self.flush(sync=True)
        self._file.close()
