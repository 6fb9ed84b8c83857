"""The size limits every row is checked against before its expensive step.

A row is parsed, templated, tokenized, constrained and its images decoded; each step costs
memory in proportion to what the row holds, so one hostile row could exhaust the machine and
stop the job on every resume. Each limit is checked before its step, and a row over one is that
row's error, naming the limit and how to raise it (`--limit NAME=VALUE`, docs/limits.md).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from batchrun.io.jsonl import MAX_LINE_BYTES

CHARS_PER_TOKEN = 64  # far above any tokenizer's average: a prompt over it cannot fit
MIN_PROMPT_CHARS = 1 << 20
UNKNOWN_CONTEXT_PROMPT_CHARS = 16 << 20


@dataclass(frozen=True, slots=True)
class RowLimits:
    row_bytes: int = MAX_LINE_BYTES  # one input line (JSONL)
    # A prompt's text (its messages' text, or the rendered template); None: CHARS_PER_TOKEN
    # characters a token of the model's context.
    prompt_chars: int | None = None
    choices: int = 1024  # alternatives of one --choices / guided_choice
    choice_chars: int = 1024  # characters of one alternative
    # Characters of all alternatives together: choices are scored in one forward pass of
    # (alternatives x the longest one) tokens, which 1,024 x 1,024 characters took past 5 GB.
    choices_chars: int = 16384
    image_bytes: int | None = None  # one image's encoded bytes; None: io.media.MAX_BYTES

    def for_context(self, context_length: int | None) -> RowLimits:
        """These limits with the prompt's resolved for a model of `context_length` tokens."""
        if self.prompt_chars is not None:
            return self
        chars = (max(MIN_PROMPT_CHARS, CHARS_PER_TOKEN * context_length) if context_length
                 else UNKNOWN_CONTEXT_PROMPT_CHARS)
        return dataclasses.replace(self, prompt_chars=chars)


NAMES = {f.name.replace("_", "-"): f.name for f in dataclasses.fields(RowLimits)}
_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": 1 << 20, "mib": 1 << 20,
          "mb": 1000**2, "g": 1 << 30, "gib": 1 << 30, "gb": 1000**3}
_NUMBER = re.compile(r"\s*(\d+)\s*([a-z]*)\s*")


def parse_limits(given: Iterable[str] | Mapping[str, object] | None) -> RowLimits:
    """RowLimits from NAME=VALUE items (or a mapping: a job file's [limit] table); ValueError
    names a bad item. Sizes take K, M, G (binary) or KB, MB, GB suffixes."""
    if not given:
        return RowLimits()
    items = given.items() if isinstance(given, Mapping) else (_split(item) for item in given)
    values = {}
    for name, value in items:
        key = NAMES.get(str(name).strip().replace("_", "-"))
        if key is None:
            raise ValueError(f"--limit {name}: unknown limit; the limits are "
                             f"{', '.join(NAMES)}")
        values[key] = _size(name, value)
    return RowLimits(**values)


def _split(item: str) -> tuple[str, str]:
    name, sep, value = str(item).partition("=")
    if not sep:
        raise ValueError(f"--limit {item}: write NAME=VALUE, e.g. row-bytes=128M")
    return name, value


def _size(name: object, value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        match = _NUMBER.fullmatch(str(value).lower())
        if match is None or match.group(2) not in _UNITS:
            raise ValueError(f"--limit {name}={value}: the value must be a whole number, "
                             "optionally with K, M or G")
        number = int(match.group(1)) * _UNITS[match.group(2)]
    if not 1 <= number <= MAX_VALUE:
        raise ValueError(f"--limit {name}={value}: the value must be between 1 and "
                         f"{MAX_VALUE:,}")
    return number


MAX_VALUE = 1 << 50  # past any machine's memory; larger numbers overflow indexes


def image_cache(limits: RowLimits):
    """The decoded-image cache of a vision job, reading images up to the limit."""
    from batchrun.io.media import ImageCache

    return ImageCache() if limits.image_bytes is None else ImageCache(
        max_bytes=limits.image_bytes)
