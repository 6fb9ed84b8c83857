"""What the engine core needs from a model backend: a continuous batch it can insert rows into,
step, and remove rows from. Two implement it: text models through mlx-lm (text.py) and
vision-language models through mlx-vlm (vision.py). The core (engine.py) owns everything
else: scheduling, prefix planning, recovery, stops, log-probabilities, choices and outputs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from batchrun.cache.prefix import Block
from batchrun.engine.config import EngineConfig
from batchrun.engine.postprocess import Step
from batchrun.engine.sequence import Sequence
from batchrun.engine.types import SamplingParams


class Backend(Protocol):
    model: Any  # the model as loaded
    kv_model: Any  # the module whose KV cache the memory budget measures
    tokenizer: Any  # decode(), encode(); detokenizer() gives a streaming one
    prompts: Any  # renders and tokenizes prompts (encode, encode_chat)
    eos: tuple[int, ...]
    vocab_size: int
    accepts_images: bool  # rows may carry images (add_tokens' `inputs`)
    scores_choices: bool  # choices rows are scored from the prompt's KV (choices.py)
    prefix_cache: bool  # rows can start from cached prefix blocks
    windowed_prefixes: bool  # ... of a model with sliding-window layers too
    stateful_prefixes: bool  # ... of a model with recurrent layers too (state snapshots)

    def start(self, max_concurrency: int, config: EngineConfig) -> None:
        """A fresh, empty batch (dropping the old one, after a fault)."""

    def share_prefixes(self, on: bool) -> bool:
        """Rows starting from cached blocks attend one shared copy of them (else each row holds
        a copy); whether they now share."""

    def detokenizer(self) -> Any:
        """A new streaming detokenizer (add_token, text)."""

    def reject(self, params: SamplingParams) -> str | None:
        """Why this backend cannot serve a request with these parameters, if it cannot."""

    def prepare(self, seq: Sequence) -> str | None:
        """Work a row needs before it joins the batch; why it cannot join, if it cannot."""

    def insert(self, seqs: list[Sequence], blocks: list[list[Block]],
               upcoming: Iterable[Sequence] = ()) -> list[int]:
        """Add rows (their prompts past `seq.cached`, the blocks before it); their uids.
        `upcoming`: rows still waiting, which may share more of their prompts with these."""

    def next(self) -> tuple[bool, list[Step]]:
        """One step: (whether it ran prompt work, each running row's new token)."""

    def remove(self, uid: int, in_batch: bool) -> None:
        """A row is finished; `in_batch`: the batch has not dropped it itself."""

    def leave(self, uids: list[int]) -> None:
        """Rows leave the batch at once (one filter of its caches, not one a row); each is
        then removed with `in_batch` False."""

    def compute_prefix(self, seq: Sequence, upto: int, blocks: list[Block]) -> list[tuple]:
        """Prefill `seq.prompt[:upto]` for the row alone, after `blocks` (cached already): each
        layer's (keys, values) over all of them, for the prefix cache."""

    def score_choices(self, rows: list[tuple[Sequence, Step]]) -> list[list[list[float]]]:
        """For choices rows that finished their prompt this step: each row's per-token
        log-probabilities of each of its choices (choices.py)."""

    def close(self) -> None: ...
