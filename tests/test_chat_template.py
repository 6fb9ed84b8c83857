"""The demo model's chat template: ChatML with tools and enable_thinking, through mlx-lm."""

import pytest

from batchrun.engine.backends.prompt import PromptBuilder, PromptError
from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.types import SamplingParams

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"}]


def test_tools_are_listed_in_the_system_turn(demo):
    text = PromptBuilder(demo.tokenizer).render(MESSAGES, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.")
    assert '"name": "get_weather"' in text
    assert "<tool_call>" in text
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_enable_thinking_false_closes_an_empty_think_block(demo):
    builder = PromptBuilder(demo.tokenizer)
    thinking = builder.render(MESSAGES, enable_thinking=True)
    direct = builder.render(MESSAGES, enable_thinking=False)
    assert thinking.endswith("<|im_start|>assistant\n")
    assert direct.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # chat_template_kwargs is the other way to say it.
    assert builder.render(MESSAGES, chat_template_kwargs={"enable_thinking": False}) == direct


def test_tool_calls_and_tool_results_render(demo):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18C, sunny"},
    ]
    text = PromptBuilder(demo.tokenizer).render(history, tools=TOOLS)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<tool_response>18C, sunny</tool_response>" in text


def test_chat_requests_are_the_rendered_template_tokens(demo):
    engine = Engine(demo.model, demo.tokenizer, EngineConfig(), demo.context_length)
    builder = PromptBuilder(demo.tokenizer)
    rid = engine.add_request(messages=MESSAGES, tools=TOOLS, enable_thinking=False,
                             params=SamplingParams(max_tokens=4))
    (out,) = engine.run()
    expected = demo.tokenizer.encode(builder.render(MESSAGES, tools=TOOLS, enable_thinking=False),
                                     add_special_tokens=False)
    assert out.request_id == rid and out.prompt_tokens == len(expected)
    special = demo.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert expected[0] == special[0] and special[1] in expected  # real special tokens


def test_text_parts_are_flattened_and_images_refused(demo):
    builder = PromptBuilder(demo.tokenizer)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Weather "},
                                          {"type": "text", "text": "in Paris?"}]}]
    assert builder.render(parts) == builder.render([{"role": "user",
                                                     "content": "Weather in Paris?"}])
    image = [{"role": "user", "content": [{"type": "image_url",
                                           "image_url": {"url": "cat.png"}}]}]
    with pytest.raises(PromptError, match=r"messages\[0\].content\[0\].*vision"):
        builder.render(image)


@pytest.mark.parametrize("messages, field", [
    ([], "non-empty"),
    ([{"role": "wizard", "content": "hi"}], r"messages\[0\].role"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"role": "user"}], r"messages\[0\].content"),
])
def test_bad_messages_name_the_field(demo, messages, field):
    with pytest.raises(PromptError, match=field):
        PromptBuilder(demo.tokenizer).render(messages)


def test_a_replayed_tool_calls_json_arguments_reach_the_template_as_a_mapping():
    """OpenAI sends an earlier call's arguments as a JSON string; templates that write
    `arguments | tojson` need the mapping, or they render JSON inside a JSON string."""
    from batchrun.engine.backends.prompt import normalize_messages

    call = {"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    odd = {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "not json"}}
    listed = {"id": "c3", "type": "function", "function": {"name": "g", "arguments": "[1]"}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call, odd, listed]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    calls = normalize_messages(messages)[1]["tool_calls"]
    assert calls[0]["function"] == {"name": "weather", "arguments": {"city": "Paris"}}
    assert calls[0]["id"] == "c1" and calls[1] == odd and calls[2] == listed
    assert call["function"]["arguments"] == '{"city": "Paris"}'  # the row itself untouched
