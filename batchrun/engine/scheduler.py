"""Which sequences run: admission under the memory budget, and recovery from a failed step.

Invariants:
- a sequence is admitted only when the running batch's KV cache, with it, fits the memory
  budget, and at most `max_concurrency` run at once;
- with a prefix cache, a prefix that rows share is computed into the cache before the first of
  them starts (prefix_plan.py), and every one of them starts from the cache;
- after a failed step no row is lost: the running rows restart in two halves, each run on its
  own (`isolated`), halving again on failure; a row fails only when it fails alone. An
  out-of-memory error halves the concurrency instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from batchrun.cache.prefix import Block
from batchrun.engine.memory import MemoryBudget
from batchrun.engine.prefix_plan import PrefixNeeded, PrefixPlanner
from batchrun.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, memory: MemoryBudget, max_concurrency: int,
                 prefill_rows: int | None = None):
        self.memory = memory
        self.max_concurrency = max_concurrency
        self.prefill_rows = prefill_rows  # most rows started at once (None: no cap)
        self.planner: PrefixPlanner | None = None
        self.shares_prefix = False  # a row's cached prefix is shared: not in its own KV
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # by the backend's uid
        self._retry_groups: deque[list[Sequence]] = deque()  # rows to rerun after a fault
        self._isolated: set[int] = set()  # ids of the retry group now running on its own
        self.faults = 0

    def add(self, seq: Sequence) -> None:
        if self.planner is not None:
            self.planner.register(seq)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._retry_groups)

    def schedule(self, prefill_tokens: int
                 ) -> tuple[list[tuple[Sequence, list[Block]]], PrefixNeeded | None]:
        """The sequences to start now, each with the cached prefix blocks it starts from; and
        a shared prefix to compute before the next one can start, if one is needed. Their
        uncached prompt tokens, padded to the longest, and those of the rows still prefilling
        stay within `prefill_tokens` (one row always starts if none is prefilling)."""
        if self._isolated:
            return [], None  # a retry group runs on its own until it is done
        if self._retry_groups:
            group = self._retry_groups.popleft()
            self._isolated = {seq.id for seq in group}
            planned = [(seq, self._plan(seq, compute=False)) for seq in group]
            for seq, _ in planned:
                self._admit(seq)
            return planned, None
        prefilling = self._prefilling_tokens()
        prefill_room = prefill_tokens - prefilling
        batch: list[tuple[Sequence, list[Block]]] = []
        longest = 0
        while (self.waiting and len(self.running) + len(batch) < self.max_concurrency
               and (self.prefill_rows is None or len(batch) < self.prefill_rows)):
            head = self.waiting[0]
            plan = self._plan(head)
            if isinstance(plan, PrefixNeeded):
                return batch, plan
            longest = max(longest, len(head.prompt) - head.cached)
            over = (len(batch) + 1) * longest > prefill_room
            if over and (batch or prefilling):
                break
            if not self.memory.fits(self._kv_tokens(head)):
                break
            seq = self.waiting.popleft()
            self._admit(seq)
            batch.append((seq, plan))
        return batch, None

    def _prefilling_tokens(self) -> int:
        """Padded prompt tokens of the running rows that have not produced a token yet."""
        pending = [len(s.prompt) - s.cached for s in self.running.values() if s.ttft is None]
        return len(pending) * max(pending, default=0)

    def _admit(self, seq: Sequence) -> None:
        self.memory.add(seq.id, self._kv_tokens(seq))
        if self.planner is not None:
            self.planner.admitted(seq)

    def _kv_tokens(self, seq: Sequence) -> int:
        """The tokens of KV the row holds itself (a shared prefix is held once, elsewhere)."""
        return seq.length - (seq.cached if self.shares_prefix else 0)

    def _plan(self, seq: Sequence, compute: bool = True) -> list[Block] | PrefixNeeded:
        return [] if self.planner is None else self.planner.plan(seq, compute)

    def started(self, seq: Sequence, uid: int) -> None:
        seq.uid, seq.status = uid, Status.RUNNING
        self.running[uid] = seq

    def finish(self, seq: Sequence) -> None:
        """A running, waiting or not yet admitted sequence is done (its Output is made)."""
        self.memory.remove(seq.id)
        self._isolated.discard(seq.id)
        if seq.status is Status.RUNNING:
            del self.running[seq.uid]
        else:
            for queue in (self.waiting, *self._retry_groups):
                if seq in queue:
                    queue.remove(seq)
            self._retry_groups = deque(g for g in self._retry_groups if g)
        if self.planner is not None:
            self.planner.release(seq)
        seq.status = Status.FINISHED

    def find(self, request_id: int) -> Sequence | None:
        for seq in (*self.running.values(), *self.waiting, *(s for g in self._retry_groups
                                                               for s in g)):
            if seq.id == request_id:
                return seq
        return None

    def recover(self, out_of_memory: bool, restart: Callable[[Sequence], None]
                ) -> Sequence | None:
        """After a failed step: every running row goes back (restarted) to run again, in
        halves, or all at lower concurrency. Returns the row that failed alone, if one did
        (still to be finished)."""
        self.faults += 1
        rows = sorted(self.running.values(), key=lambda seq: seq.id)
        self.running.clear()
        self._isolated.clear()
        for seq in rows:
            self.memory.remove(seq.id)
            restart(seq)
        if out_of_memory and len(rows) > 1:
            self.max_concurrency = max(1, len(rows) // 2)
            self.waiting.extendleft(reversed(rows))
        elif len(rows) == 1:
            return rows[0]
        else:
            half = len(rows) // 2
            self._retry_groups.extendleft([rows[half:], rows[:half]])
        return None
