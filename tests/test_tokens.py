"""Rows sharing a long templated start are tokenized from the shared start's kept tokens, and
always get exactly the tokens of their whole text."""

from batchrun.engine.prompt import PromptBuilder
from batchrun.engine.tokens import SharedStarts

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
