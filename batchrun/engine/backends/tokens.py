"""Tokenize once the long start that templated rows share.

A labeling job's rows render to texts that begin alike (the system instruction, the template's
markers): tokenizing that start again for every row costs ~2 ms a row for a 1,700-token
instruction, as much as the H200 spends computing the row. A tokenizer matches its special
tokens (`<|im_end|>`, `<|im_start|>`) before its model runs, so a text cut right after one
tokenizes as its two parts' tokens end to end. `SharedStarts` keeps the tokens of such cut
points once a second row has shown them to be shared, and tokenizes a row that starts with one
from there on.

A tokenizer that breaks the rule (a special token that strips the space after it, a
pre-tokenizer that adds one at a text's start) is caught: the first uses of each kept start are
checked against tokenizing the whole text, and one mismatch turns the cache off for good.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

MIN_CHARS = 256  # shorter starts are not worth keeping
KEPT = 16  # distinct starts kept (least recently used dropped)
CHECKS = 4  # uses of each kept start checked against whole-text tokenization
SEEN_LIMIT = 1 << 14  # cut points remembered while waiting for a second row


class SharedStarts:
    def __init__(self, encode: Callable[[str], list[int]], special: list[str]):
        self.encode = encode
        self.on = bool(special)
        self._pattern = re.compile("|".join(
            re.escape(s) for s in sorted(set(special), key=len, reverse=True))) if special \
            else None
        self._seen: set[int] = set()
        self._kept: OrderedDict[str, list] = OrderedDict()  # start -> [tokens, checks left]
        self._lock = threading.Lock()

    def __call__(self, text: str) -> list[int]:
        if not self.on:
            return self.encode(text)
        cuts = [m.end() for m in self._pattern.finditer(text) if MIN_CHARS <= m.end() < len(text)]
        for cut in reversed(cuts):
            with self._lock:
                kept = self._kept.get(text[:cut])
                if kept is not None:
                    self._kept.move_to_end(text[:cut])
            if kept is not None:
                return self._from(kept, text, cut)
        for cut in cuts:
            self._note(text[:cut])
        return self.encode(text)

    def _from(self, kept: list, text: str, cut: int) -> list[int]:
        ids = kept[0] + self.encode(text[cut:])
        if kept[1] > 0:
            kept[1] -= 1
            whole = self.encode(text)
            if whole != ids:
                self.on = False  # this tokenizer does not split cleanly at special tokens
                return whole
        return ids

    def _note(self, start: str) -> None:
        """A row began with `start`: the second row that does makes it kept."""
        key = hash(start)
        with self._lock:
            if key not in self._seen:
                if len(self._seen) >= SEEN_LIMIT:
                    self._seen.clear()
                self._seen.add(key)
                return
            if start in self._kept:
                return
        tokens = self.encode(start)
        with self._lock:
            self._kept[start] = [tokens, CHECKS]
            while len(self._kept) > KEPT:
                self._kept.popitem(last=False)


DIRECT_CHECKS = 8  # first uses of the Rust tokenizer's encode checked against transformers'


class Encoder:
    """`tokenizer.encode(text, add_special_tokens=...)` as a list, through the Rust tokenizer's
    own single-text encode where transformers' would give the same ids.

    transformers encodes one text through the Rust tokenizer's batch call, which lets go of the
    GIL. On a build thread, while the engine's thread runs Python, each let-go waits out the
    interpreter's switch interval (5 ms) to get the GIL back: 512 rows' encodes took 2.7 s
    instead of 26 ms on this project's CPU (benchmarks/history/scripts/probe_feeder_gil.py). The
    single-text call keeps the GIL.

    The direct call is taken only for transformers' plain fast tokenizer (a class that encodes its
    own way, such as mlx-lm's newline tokenizer, keeps transformers' path), on a private copy of
    the Rust tokenizer set as transformers sets its own before each call, and its first uses for
    each `add_special_tokens` are checked against transformers' result: one mismatch turns it
    off for good.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._direct = _plain_backend(tokenizer)
        self._checks = {False: DIRECT_CHECKS, True: DIRECT_CHECKS}
        self._lock = threading.Lock()

    @property
    def direct(self) -> bool:
        return self._direct is not None

    def __call__(self, text: str, add_special_tokens: bool = False) -> list[int]:
        direct = self._direct
        if direct is None:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        with self._lock:
            check = self._checks[add_special_tokens] > 0
            if check:
                self._checks[add_special_tokens] -= 1
        if check:
            expected = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
            if direct.encode(text, add_special_tokens=add_special_tokens).ids != expected:
                self._direct = None
            return expected
        return direct.encode(text, add_special_tokens=add_special_tokens).ids


def _plain_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a tokenizer whose `encode` is transformers' own, or
    None."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep its own path
        return None
    encode = getattr(tokenizer, "encode", None)
    owner = getattr(encode, "__self__", None)
    if (getattr(encode, "__func__", None) is not PreTrainedTokenizerBase.encode
            or not isinstance(owner, TokenizersBackend)
            or type(owner)._encode_plus is not TokenizersBackend._encode_plus):
        return None
    backend = getattr(owner, "backend_tokenizer", None)
    if backend is None:
        return None
    # A copy of its own, set as transformers' encode sets the shared one on every call: another
    # caller's truncation, padding or special-token splitting left on the shared one would
    # otherwise change every prompt after it.
    private = type(backend).from_str(backend.to_str())
    private.no_truncation()
    private.no_padding()
    private.encode_special_tokens = bool(getattr(owner, "split_special_tokens", False))
    return private


def common_length(prompts: list[list[int]]) -> int:
    """Tokens all `prompts` start with, leaving each at least one of its own."""
    n = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    return max(0, n)
