"""Rows sharing a long templated start are tokenized from the shared start's kept tokens, and
always get exactly the tokens of their whole text."""

import copy
from types import SimpleNamespace

from batchrun.engine.backends.prompt import PromptBuilder
from batchrun.engine.backends.tokens import DIRECT_CHECKS, Encoder, SharedStarts

SYSTEM = "You label reviews. " + " ".join(f"Example {i}: good kettle -> positive."
                                         for i in range(60))


def chats(n: int) -> list[list[dict]]:
    return [[{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"Review {i}: the lid {'sticks' * (i % 3)}"}]
            for i in range(n)]


def test_rows_sharing_an_instruction_get_their_whole_texts_tokens(demo):
    prompts = PromptBuilder(demo.tokenizer)
    for messages in chats(12):
        whole = list(demo.tokenizer.encode(prompts.render(messages), add_special_tokens=False))
        assert prompts.encode_chat(messages) == whole
    starts = prompts._chat_tokens
    assert starts.on and len(starts._kept) >= 1  # the instruction is tokenized once, kept


def test_a_tokenizer_that_does_not_split_at_special_tokens_turns_the_cache_off():
    """A pre-tokenizer that marks every text's start (as a prefix space does): a part
    tokenized alone differs from the same characters inside the whole text."""
    def encode(text: str) -> list[int]:
        return [0] + [ord(c) for c in text]  # 0: the start marker

    starts = SharedStarts(encode, ["<end>"])
    head = "x" * 300 + "<end>"
    texts = [head + f"row {i}" for i in range(6)]
    assert [starts(t) for t in texts] == [encode(t) for t in texts]
    assert not starts.on


def test_without_special_tokens_every_text_is_tokenized_whole():
    calls = []

    def encode(text: str) -> list[int]:
        calls.append(text)
        return [len(text)]

    starts = SharedStarts(encode, [])
    assert starts("a" * 400) == [400] and calls == ["a" * 400]


# -- The Rust tokenizer's own encode, where it gives transformers' ids ---------------------------

TEXTS = ["", " ", "hello world", "  two  spaces\n\nand lines\t", "<|im_start|>user\nhi<|im_end|>",
         "naïve café — 東京 🙂", SYSTEM, "a" * 2000]


def test_the_direct_encode_gives_transformers_ids(demo):
    encode = Encoder(demo.tokenizer)
    assert encode.direct  # the demo's tokenizer is transformers' plain fast tokenizer
    for _ in range(2):  # past the checked first uses, too
        for special in (False, True):
            for text in TEXTS * 2:
                assert encode(text, add_special_tokens=special) == list(
                    demo.tokenizer.encode(text, add_special_tokens=special))
    assert encode.direct


def test_a_backend_left_truncating_does_not_cut_direct_encodes(demo):
    hf = copy.deepcopy(demo.tokenizer.encode.__self__)
    hf.backend_tokenizer.enable_truncation(max_length=3)  # as another caller may leave it
    encode = Encoder(hf)
    assert encode.direct
    for text in TEXTS * 3:
        assert encode(text) == list(hf.encode(text, add_special_tokens=False))
    assert len(encode(SYSTEM)) > 3
    assert encode.direct


def test_a_tokenizer_that_encodes_its_own_way_keeps_its_own_encode(demo):
    hf = copy.copy(demo.tokenizer.encode.__self__)

    class Newlines(type(hf)):  # as mlx-lm's newline tokenizer rewrites text before encoding
        def encode(self, text, **kwargs):
            return super().encode(text.replace("\n", " "), **kwargs)

    hf.__class__ = Newlines
    encode = Encoder(hf)
    assert not encode.direct
    assert encode("a\nb") == hf.encode("a b", add_special_tokens=False)


def test_a_direct_encode_that_differs_turns_it_off(demo):
    encode = Encoder(demo.tokenizer)

    class Wrong:
        def encode(self, text, add_special_tokens):
            return SimpleNamespace(ids=[1, 2, 3])

    encode._direct = Wrong()
    expected = list(demo.tokenizer.encode("hello world", add_special_tokens=False))
    assert encode("hello world") == expected  # a checked use: transformers' ids
    assert not encode.direct
    assert encode("hello world") == expected  # and from then on transformers' encode


def test_another_callers_settings_do_not_change_direct_encodes(demo):
    """transformers resets its Rust tokenizer's truncation, padding and special-token
    splitting on every call; a call that sets them must not change batchrun's prompts."""
    hf = copy.deepcopy(demo.tokenizer.encode.__self__)
    encode = Encoder(hf)
    texts = ["<|im_start|>user\\nhello there, how are you?<|im_end|>", SYSTEM]
    expected = [list(hf.encode(t, add_special_tokens=False)) for t in texts]
    for _ in range(DIRECT_CHECKS + 1):  # past the checked first uses
        encode(texts[0])
    hf(["x " * 50], truncation=True, max_length=5)
    hf(["x"], padding=True, pad_to_multiple_of=64)
    hf(["<|im_start|>"], split_special_tokens=True)
    assert [encode(t) for t in texts] == expected
    assert encode.direct
