"""Turn an input row into a Task for the engine, or a RowError that names the row and field.

Row shapes (SPEC.md): `prompt`; `messages` (+ `tools`, `chat_template_kwargs`); an OpenAI Batch
API line (`custom_id`, `url`, `body`); or any columns with `--prompt-template`. Per-row sampling
fields override the job's defaults. Row id: `custom_id`, else `id`, else `--id-column`, else the
0-based row index.

A row's answer may be constrained by OpenAI's `response_format` (json_object, json_schema) or
by vLLM's `guided_json`, `guided_regex`, `guided_choice`; else by the job's `--json-schema`,
`--regex` or `--choices`. `n` asks for several samples of one row.

Image loading may wait on the network (up to the media deadline): on a thread that called
defer_images() (the feeder's builder), a row that needs images raises ImagesPending instead, so
its images load elsewhere and the row is built again inside images_loaded().
"""

from __future__ import annotations

import dataclasses
import math
import re
import string
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from batchrun.engine.backends.prompt import PromptBuilder, PromptError
from batchrun.engine.decoding.constrain import response_format_constraint
from batchrun.engine.decoding.tool_grammar import tool_call_constraint
from batchrun.engine.types import Constraint, ConstraintError, SamplingParams
from batchrun.io.jsonl import RawRow
from batchrun.job.limits import RowLimits

OPENAI_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "logprobs", "top_logprobs", "stop_token_ids", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_tokens",
                   "max_thinking_tokens")
# OpenAI / vLLM request fields batchrun cannot honour: a row that sets one (to other than its
# no-op value) is that row's error, never silently answered as if it had not.
UNSUPPORTED = {
    "best_of": lambda v: v not in (None, 1),
    "echo": lambda v: v not in (None, False),
    "suffix": lambda v: v not in (None, ""),
    "stream": lambda v: v not in (None, False),
}
MAX_N = 128


@dataclass(slots=True)
class RowOptions:
    """How rows become prompts: the job's defaults and templating options."""

    defaults: SamplingParams = field(default_factory=SamplingParams)
    system: str | None = None
    prompt_template: str | None = None
    id_column: str | None = None
    n: int = 1  # samples per row unless the row sets its own
    # Raises ConstraintError if a constraint does not compile for the model (the engine's).
    check_constraint: Any = None
    # --answer-prefix: every chat row's answer begins with this text (the template renders it
    # as the start of the assistant's turn); results hold what the model wrote after it.
    answer_prefix: str | None = None
    # How the model writes a tool call, where a grammar can write one (tool_grammar.ToolForm):
    # `tool_choice` "required" or a named function constrains an answer to a call.
    tool_form: Any = None
    # Image rows (a vision model): decoded images cached by content, the folder relative
    # image paths start from, and the column that holds each row's image.
    images: Any = None  # io.media.ImageCache
    base_dir: Path = Path(".")
    image_column: str | None = None
    # What image references may reach (io.media.MediaPolicy): folders besides base_dir
    # (--media-root), loopback and private addresses, and seconds per image.
    media_roots: tuple[Path, ...] = ()
    allow_private_urls: bool = False
    media_timeout: float = 30.0  # io.media.MEDIA_TIMEOUT
    # --served-model-name: the names an OpenAI row's body.model may give (empty: any).
    served_model_names: tuple[str, ...] = ()
    # --expected-column: the column holding each row's right answer; its value goes into the
    # row's record as `expected`, and the report counts the labels that agree with it.
    expected_column: str | None = None
    # --keep-columns: input columns copied into each result record as `columns` (ALL: every
    # one; empty: none).
    keep_columns: tuple[str, ...] = ()
    limits: RowLimits = field(default_factory=RowLimits)  # resolved for the model's context


@dataclass(slots=True)
class Task:
    index: int
    line: int
    custom_id: str
    prompt_ids: list[int]
    params: SamplingParams
    openai: str | None = None  # "chat" or "completion" for OpenAI batch rows
    model: str | None = None  # the `body.model` of an OpenAI batch row
    n: int = 1  # samples; sample i > 0 samples with a seed derived from the row's (sample_params)
    vision: Any = None  # engine.backends.vision.VisionInputs for a row with images (a vision model)
    tools: list | None = None  # the tools the row offered (its tool calls are parsed)
    chat: bool = True  # a chat-templated prompt (a raw `prompt` is not): reasoning is parsed
    # A digest of the prompt's tokens and images (JobRunner._build_task, in a feeder thread):
    # identical requests are found by it without hashing the whole prompt in the job loop.
    prompt_digest: bytes = b""
    expected: str | None = None  # the row's --expected-column value
    columns: dict | None = None  # the row's --keep-columns values
    # An OpenAI completions row whose prompt is a list: the prompts after the first, each
    # sampled n times (choice prompt * n + sample, as OpenAI numbers them)
    more_prompts: tuple[list[int], ...] = ()

    @property
    def samples(self) -> int:
        return self.n * (1 + len(self.more_prompts))

    def sample_prompt(self, sample: int) -> list[int]:
        prompt = sample // self.n
        return self.prompt_ids if prompt == 0 else self.more_prompts[prompt - 1]

    def sample_params(self) -> list[SamplingParams]:
        """One SamplingParams per sample: sample 0 is the row's own, the others get distinct
        seeds derived from it (greedy samples are all alike); the same for each prompt."""
        out = [self.params]
        for i in range(1, self.n):
            seed = None if self.params.greedy else row_seed(i, self.params.seed or 0)
            out.append(dataclasses.replace(self.params, seed=seed))
        return out * (1 + len(self.more_prompts))


@dataclass(slots=True)
class RowError:
    index: int
    line: int
    custom_id: str
    code: str
    message: str
    # an OpenAI batch line: its record takes the batch error-file shape (None: a row nothing
    # of which could be read takes the shape of the input's rows)
    openai: bool | None = False


def is_openai_line(value: Any) -> bool:
    """A row shaped as a line of an OpenAI batch file (however malformed inside)."""
    return isinstance(value, dict) and ("body" in value or "url" in value)


class RowRejected(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class ImagesPending(Exception):
    """Raised by build_task on a thread that defers image loading: the row needs images.
    `load()` loads them (it may take the media deadline); build the row again inside
    `images_loaded(what load returned or raised)`."""

    def __init__(self, load: Callable[[], list]):
        super().__init__("the row's images are not loaded yet")
        self.load = load


_images = threading.local()  # .deferred: this thread defers; .loaded: the row's images


def defer_images() -> None:
    """From now on, build_task on this thread raises ImagesPending rather than load images."""
    _images.deferred = True


@contextmanager
def images_loaded(loaded: list | Exception) -> Iterator[None]:
    """Build a row with its images already loaded (or with the error loading them raised)."""
    _images.loaded = loaded
    try:
        yield
    finally:
        _images.loaded = None


def explicit_id(value: Any, id_column: str | None) -> str | None:
    """The row's own id: `custom_id`, else `id`, else the `--id-column` column."""
    if isinstance(value, dict):
        for key in ("custom_id", "id", id_column):
            if key and value.get(key) is not None:
                return str(value[key])
    return None


def row_id(value: Any, index: int, id_column: str | None) -> str:
    found = explicit_id(value, id_column)
    return str(index) if found is None else found


def read_error(raw: RawRow, id_column: str | None) -> RowError:
    """The error record of a row that could not be read (not JSON, too long, too deep)."""
    # a row with nothing readable (not JSON) is of the job's shape, whatever that is: None
    shape = is_openai_line(raw.value) if isinstance(raw.value, dict) else None
    return RowError(raw.index, raw.line, row_id(raw.value, raw.index, id_column), raw.code,
                    raw.error or "", shape)


def build_task(raw_value: Any, index: int, line: int, prompts: PromptBuilder,
               options: RowOptions) -> Task | RowError:
    custom_id = row_id(raw_value, index, options.id_column)
    openai = is_openai_line(raw_value)
    try:
        return _build(raw_value, index, line, custom_id, prompts, options)
    except RowRejected as e:
        return RowError(index, line, custom_id, e.code, str(e), openai)
    except PromptError as e:
        return RowError(index, line, custom_id, "invalid_prompt", str(e), openai)
    except RecursionError:
        return RowError(index, line, custom_id, "invalid_row",
                        "the row nests too deeply to be read", openai)
    except (TypeError, ValueError, AttributeError, KeyError) as e:
        # A shape no check above foresaw: still this row's error, never the job's.
        return RowError(index, line, custom_id, "invalid_row",
                        f"the row could not be read ({type(e).__name__}: {_short(e)})", openai)


def _build(value: Any, index: int, line: int, custom_id: str, prompts: PromptBuilder,
           options: RowOptions) -> Task:
    if not isinstance(value, dict):
        raise RowRejected("invalid_row", f"the row must be a JSON object, got {_kind(value)}")
    openai = None
    body = value
    if "body" in value or "url" in value:
        url = value.get("url")
        openai = OPENAI_URLS.get(url) if isinstance(url, str) else None
        if openai is None:
            raise RowRejected("unsupported_url", f"url must be one of {', '.join(OPENAI_URLS)}, "
                                                 f"got {url!r}")
        method = value.get("method", "POST")
        if method != "POST":
            raise RowRejected("invalid_field", f"method must be POST, got {method!r}")
        if value.get("custom_id") is None:
            # OpenAI's batch files need one: results are matched to requests by it
            raise RowRejected("missing_custom_id", "the line has no custom_id")
        body = value.get("body")
        if not isinstance(body, dict):
            raise RowRejected("invalid_row", "body must be an object")
    for name, unsupported in UNSUPPORTED.items():
        if unsupported(body.get(name)):
            raise RowRejected("unsupported_field", f"{name} = {body[name]!r} is not supported "
                                                   "by batchrun: remove it")
    params = sampling_params(body, options.defaults, openai == "completion")
    constraint = tool_choice_constraint(body, options) or row_constraint(body, options)
    if constraint is not params.constraint:
        params = dataclasses.replace(params, constraint=constraint)
    n = body.get("n", options.n)
    if n is None:
        n = options.n
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise RowRejected("invalid_field", f"n must be an integer in [1, {MAX_N}], got {n!r}")
    if body.get("seed") is None and not params.greedy:
        # A seed from the job's base seed and the row's position: the same row samples the
        # same text on every run, resumed or not, whatever else shares its batch.
        params = dataclasses.replace(params, seed=row_seed(index, options.defaults.seed or 0))
    raw_prompt = _is_raw_prompt(body, openai)
    if raw_prompt or _asks_thinking(body):  # a raw prompt's text is never read as reasoning
        params = dataclasses.replace(params, thinking=not raw_prompt)
    model = body.get("model") if openai else None
    if model is not None and not isinstance(model, str):
        raise RowRejected("invalid_field", "body.model must be a string")
    if model is not None and options.served_model_names \
            and model not in options.served_model_names:
        raise RowRejected("model_not_found",
                          f"body.model {model!r} is not served here: this job serves "
                          f"{', '.join(map(repr, options.served_model_names))}")
    ids, vision = _prompt_ids(body, openai, prompts, options, value)
    more: tuple[list[int], ...] = ()
    if ids and isinstance(ids[0], list):  # a list of prompts
        ids, more = ids[0], tuple(ids[1:])
    tools = body.get("tools") if body.get("tool_choice") != "none" else None
    return Task(index, line, custom_id, ids, params, openai, model, n, vision,
                tools if isinstance(tools, list) and tools else None, chat=not raw_prompt,
                more_prompts=more,
                expected=expected_value(value, options.expected_column),
                columns=kept_columns(value, options.keep_columns))


ALL_COLUMNS = ("*",)  # --keep-columns all


def kept_columns(row: dict, names: tuple[str, ...]) -> dict | None:
    """The row's --keep-columns values (a missing column is null), each as JSON holds it: a
    value JSON has no form for (Parquet bytes, a decimal, a date) as its text."""
    if not names:
        return None
    picked = dict(row) if names == ALL_COLUMNS else {n: row.get(n) for n in names}
    try:
        orjson.dumps(picked)
        return picked
    except TypeError:
        return orjson.loads(orjson.dumps(picked, default=_as_text))


def _as_text(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return bytes(value).hex()
    return str(value)


def expected_value(row: dict, column: str | None) -> str | None:
    """The row's right answer from --expected-column, as text: a string as it is, a number as
    its shortest form (3.0 is "3": an integer column with a missing value reads as floats), a
    boolean as true/false; none for a missing value, NaN, or a list or object."""
    value = row.get(column) if column else None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return None
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value) if isinstance(value, str | int) else None


def _is_raw_prompt(body: dict, openai: str | None) -> bool:
    """A `prompt` row or a /v1/completions body: its text goes to the model untemplated."""
    return openai == "completion" or (openai is None and "prompt" in body)


def _asks_thinking(body: dict) -> bool:
    """enable_thinking: true, at the top level (vLLM) or in chat_template_kwargs."""
    kwargs = body.get("chat_template_kwargs")
    return body.get("enable_thinking") is True or (
        isinstance(kwargs, dict) and kwargs.get("enable_thinking") is True)


GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")


def tool_choice_constraint(body: dict, options: RowOptions) -> Constraint | None:
    """`tool_choice` "required" (a call of one of the tools) or a named function (a call of
    that one): the answer constrained to a call in the model's markup. "auto" and "none"
    need no constraint."""
    choice = body.get("tool_choice")
    if choice in (None, "auto", "none"):
        return None
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        raise RowRejected("invalid_field", f"tool_choice {_short(repr(choice), 80)} needs tools")
    name = None  # "required": a call of any of them
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not any(isinstance(t, dict) and isinstance(t.get("function"), dict)
                   and t["function"].get("name") == name for t in tools):
            raise RowRejected("invalid_field", f"tool_choice names function "
                                               f"{_short(repr(name), 80)}, which tools do not "
                                               "offer")
    elif choice != "required":
        raise RowRejected("invalid_field", "tool_choice must be \"auto\", \"none\", "
                                           "\"required\" or {\"type\": \"function\", "
                                           "\"function\": {\"name\": ...}}")
    if any(body.get(name) is not None for name in GUIDED_FIELDS):
        raise RowRejected("invalid_field", "tool_choice and a response format or guided "
                                           "field cannot both constrain the answer")
    if options.tool_form is None:
        raise RowRejected("unsupported_field",
                          f"tool_choice {_short(repr(choice), 80)}: this model's tool-call "
                          "format cannot be constrained; use \"auto\"")
    try:
        constraint = tool_call_constraint(tools, options.tool_form, name)
        if options.check_constraint is not None:
            options.check_constraint(constraint)
    except ConstraintError as e:  # it may quote the tools (a name, the grammar): cut short
        raise RowRejected("invalid_constraint", f"tool_choice: {_short(e, 600)}") from None
    return constraint


def row_constraint(body: dict, options: RowOptions) -> Constraint | None:
    """The row's own constraint field (at most one), else the job's; checked to compile."""
    given = [name for name in GUIDED_FIELDS if body.get(name) is not None]
    if len(given) > 1:
        raise RowRejected("invalid_field", f"give at most one of {', '.join(given)}")
    name = given[0] if given else None
    try:
        if name == "response_format":
            constraint = response_format_constraint(body[name])
        elif name == "guided_json":
            constraint = Constraint.json_schema(body[name])
        elif name == "guided_regex":
            constraint = Constraint.regex(body[name])
        elif name == "guided_choice":
            check_choices(body[name], options.limits, name)
            constraint = Constraint.choices(body[name])
        else:
            constraint = options.defaults.constraint
        if constraint is not None and options.check_constraint is not None:
            options.check_constraint(constraint)
    except ConstraintError as e:
        field = name or "the job's constraint"
        raise RowRejected("invalid_constraint", f"{field}: {e}") from None
    return constraint


def _prompt_ids(body: dict, openai: str | None, prompts: PromptBuilder, options: RowOptions,
                row: dict) -> tuple[list[int], Any]:
    """The prompt's token ids, and the processor inputs of a row with images."""
    column_image = row.get(options.image_column) if options.image_column else None
    if _is_raw_prompt(body, openai):
        prompt = body.get("prompt")
        if openai == "completion" and not isinstance(prompt, str):
            ids = completion_prompts(prompt, prompts, options)
            if column_image is not None:
                raise RowRejected("invalid_prompt", "a prompt of token ids takes no images")
            return ids, None
        if not isinstance(prompt, str):
            raise RowRejected("invalid_prompt", "prompt must be a string")
        if not prompt:
            raise RowRejected("invalid_prompt", "prompt is empty")
        _check_prompt_size(len(prompt), "prompt", options.limits)
        if column_image is not None:
            return _with_images([{"role": "user", "content": prompt}], [], body, prompts,
                                options, column_image, openai)
        return prompts.encode(prompt), None
    if "messages" in body:
        messages = body["messages"]
    elif options.prompt_template is not None and openai is None:
        messages = [{"role": "user", "content": _fill(options.prompt_template, body,
                                                      options.limits.prompt_chars)}]
    else:
        raise RowRejected("missing_prompt", "the row has no 'prompt' or 'messages' field "
                                            "(or pass --prompt-template to build one from columns)")
    _check_prompt_size(_text_chars(messages) + _json_chars(body.get("tools")),
                       _messages_field(openai), options.limits)
    if options.system and isinstance(messages, list) and not _has_system(messages):
        messages = [{"role": "system", "content": options.system}, *messages]
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RowRejected("invalid_field", "chat_template_kwargs must be an object")
    if body.get("enable_thinking") is not None:  # vLLM's top-level form of the template switch
        if not isinstance(body["enable_thinking"], bool):
            raise RowRejected("invalid_field", "enable_thinking must be true or false")
        kwargs = {**(kwargs or {}), "enable_thinking": body["enable_thinking"]}
    if body.get("tool_choice") == "none":  # no tools offered: the model cannot call one
        body = {**body, "tools": None}
    continue_final = body.get("continue_final_message", False)
    if not isinstance(continue_final, bool):
        raise RowRejected("invalid_field", "continue_final_message must be true or false")
    if options.answer_prefix is not None and isinstance(messages, list) and not continue_final:
        messages = [*messages, {"role": "assistant", "content": options.answer_prefix}]
        continue_final = True
    refs = _image_refs(messages, openai)
    if column_image is not None or refs:
        if continue_final:
            raise RowRejected("unsupported_field", "an answer begun for the model "
                                                   "(continue_final_message, --answer-prefix) "
                                                   "is not supported on rows with images")
        return _with_images(messages, refs, body, prompts, options, column_image, openai)
    return prompts.encode_chat(messages, tools=body.get("tools"), chat_template_kwargs=kwargs,
                               continue_final_message=continue_final), None


MAX_PROMPTS = 64  # prompts one OpenAI completions row may list


def completion_prompts(prompt: Any, prompts: PromptBuilder, options: RowOptions
                       ) -> list[int] | list[list[int]]:
    """An OpenAI completions prompt that is not one string: token ids (one prompt), or a list
    of strings or of token-id lists (one prompt each: a list of lists is returned)."""
    def ids(value: Any, where: str) -> list[int]:
        if isinstance(value, str):
            if not value:
                raise RowRejected("invalid_prompt", f"{where} is empty")
            _check_prompt_size(len(value), where, options.limits)
            return prompts.encode(value)
        if isinstance(value, list) and value and all(
                type(t) is int and 0 <= t < prompts.vocab_size for t in value):
            return list(value)
        raise RowRejected("invalid_prompt", f"{where} must be a string, or a list of token ids "
                                            f"under the vocabulary's {prompts.vocab_size:,}")

    if not isinstance(prompt, list) or not prompt:
        raise RowRejected("invalid_prompt", "prompt must be a string, token ids, or a list of "
                                            "them")
    if all(type(t) is int for t in prompt):
        return ids(prompt, "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise RowRejected("invalid_prompt", f"prompt lists {len(prompt)} prompts; at most "
                                            f"{MAX_PROMPTS}")
    return [ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]


def _image_refs(messages: Any, openai: str | None) -> list[tuple[str, object]]:
    """(field, reference) of every image in the messages, in order."""
    if isinstance(messages, list) and all(
            isinstance(m, dict) and (m.get("content") is None or isinstance(m["content"], str))
            for m in messages):
        return []  # text only: no need for the media module (PIL's import: 47 ms, once)
    from batchrun.io.media import MediaError, image_parts

    try:
        return image_parts(messages, _messages_field(openai))
    except MediaError as e:
        raise RowRejected(e.code, str(e)) from None


def _messages_field(openai: str | None) -> str:
    return "body.messages" if openai else "messages"


def _with_images(messages: list, refs: list[tuple[str, object]], body: dict, prompts: Any,
                 options: RowOptions, column_image: Any,
                 openai: str | None) -> tuple[list[int], Any]:
    """Load the row's images (the image column's first, then `refs`: those in the messages, in
    order) and run the vision model's processor on them."""
    from batchrun.io.media import MediaError, check_image_count

    if options.images is None:  # set for a vision model only
        raise RowRejected("vision_model_required",
                          "this row has images but the model is a text model: pass --model "
                          "with a vision-language model (or --vision to force the vision path)")
    try:
        check_image_count(len(refs) + (column_image is not None), prompts.max_images,
                          _messages_field(openai))
        images = _row_images(refs, column_image, options)
    except MediaError as e:
        raise RowRejected(e.code, str(e)) from None
    if column_image is not None:
        messages = _prepend_image(messages)
    kwargs = body.get("chat_template_kwargs")
    inputs = prompts.prepare(messages, images, body.get("tools"), kwargs)
    return inputs.input_ids, inputs


def _row_images(refs: list[tuple[str, object]], column_image: Any, options: RowOptions) -> list:
    """The row's images (the image column's first), loaded here, or handed over by the feeder
    (images_loaded), or deferred to it (ImagesPending)."""
    loaded = getattr(_images, "loaded", None)
    if loaded is None:
        def load() -> list:
            return _load_images(refs, column_image, options)

        if getattr(_images, "deferred", False):
            raise ImagesPending(load)
        return load()
    if isinstance(loaded, Exception):
        raise loaded
    return loaded


def _load_images(refs: list[tuple[str, object]], column_image: Any, options: RowOptions) -> list:
    from batchrun.io.media import MediaPolicy

    policy = MediaPolicy(options.media_roots, options.allow_private_urls, options.media_timeout)
    images = [options.images.load(ref, options.base_dir, where, policy) for where, ref in refs]
    if column_image is not None:
        images.insert(0, options.images.load(column_image, options.base_dir,
                                             options.image_column, policy))
    return images


def _prepend_image(messages: list) -> list:
    """An image placeholder at the start of the last user message (the image column's)."""
    out = list(messages)
    for i in range(len(out) - 1, -1, -1):
        m = out[i]
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            parts = content if isinstance(content, list) else [{"type": "text",
                                                                "text": content or ""}]
            out[i] = {**m, "content": [{"type": "image"}, *parts]}
            return out
    return [{"role": "user", "content": [{"type": "image"}]}, *out]


def check_choices(choices: Any, limits: RowLimits, field: str) -> None:
    """RowRejected if a list of choices is over the limits (each alternative compiles into the
    grammar: ten thousand take GBs)."""
    if not isinstance(choices, list | tuple):
        return  # Constraint.choices says what is wrong
    if len(choices) > limits.choices:
        raise RowRejected("too_many_choices", f"{field} has {len(choices):,} choices, over the "
                          f"limit of {limits.choices:,} (--limit choices=N raises it)")
    total = sum(len(c) for c in choices if isinstance(c, str))
    if total > limits.choices_chars:
        raise RowRejected("too_many_choices", f"{field}'s choices hold {total:,} characters "
                          f"together, over the limit of {limits.choices_chars:,} (--limit "
                          "choices-chars=N raises it)")
    longest = max((len(c) for c in choices if isinstance(c, str)), default=0)
    if longest > limits.choice_chars:
        raise RowRejected("choice_too_long", f"{field} has a choice of {longest:,} characters, "
                          f"over the limit of {limits.choice_chars:,} (--limit choice-chars=N "
                          "raises it)")


def _check_prompt_size(chars: int, field: str, limits: RowLimits) -> None:
    """RowRejected before tokenizing a prompt longer than the model could take (tokenizing
    takes many times the text's size in memory)."""
    if limits.prompt_chars is not None and chars > limits.prompt_chars:
        raise RowRejected("prompt_too_long", f"{field} holds {chars:,} characters, over the "
                          f"limit of {limits.prompt_chars:,} (more than the model's context "
                          "could take; --limit prompt-chars=N sets it)")


MARKUP_CHARS = 16  # the least a message or a content part adds to a prompt (role markers)


def _text_chars(messages: Any) -> int:
    """What chat messages add to a prompt, in characters: their text, their other fields (tool
    calls, names) as JSON, and markup for each message and part (a million empty messages
    render a prompt of millions of tokens). Images are not text: their own limit holds."""
    if not isinstance(messages, list):
        return 0
    total = 0
    for m in messages:
        total += MARKUP_CHARS
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += MARKUP_CHARS * len(content) + sum(
                len(p["text"]) for p in content
                if isinstance(p, dict) and isinstance(p.get("text"), str))
        total += sum(_json_chars(v) for k, v in m.items() if k not in ("content", "role"))
    return total


def _json_chars(value: Any) -> int:
    """A value's size as the JSON a template writes it in (tools, tool calls)."""
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value)
    try:
        return len(orjson.dumps(value))
    except (TypeError, orjson.JSONEncodeError):
        return 0  # not JSON: the template says what is wrong with it


class _BoundedFormatter(string.Formatter):
    """str.format_map that refuses to render more than `limit` characters: a width or
    precision taken from a row's column (`{text:>{w}}`) is checked before it is rendered."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.total = 0

    def format_field(self, value: Any, format_spec: str) -> str:
        if self.limit is not None and any(len(n) > 9 or int(n) > self.limit
                                          for n in re.findall(r"\d+", format_spec)):
            raise RowRejected("prompt_too_long", "--prompt-template renders a field wider "
                              f"than the limit of {self.limit:,} characters")
        text = super().format_field(value, format_spec)
        self.total += len(text)
        if self.limit is not None and self.total > self.limit:
            raise RowRejected("prompt_too_long", "--prompt-template renders more than the "
                              f"limit of {self.limit:,} characters (--limit prompt-chars=N "
                              "sets it)")
        return text


def template_fields(template: str) -> list[tuple[str, str]]:
    """--prompt-template's fields, each (the field as written, the column it starts with):
    {col} or {col[key]}. Raises ValueError for a template that is not a format string."""
    return [(name, re.split(r"[.\[]", name, maxsplit=1)[0])
            for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def _fill(template: str, row: dict, limit: int | None = None) -> str:
    try:
        return _BoundedFormatter(limit).vformat(template, (), row)
    except KeyError as e:
        raise RowRejected("missing_column", f"--prompt-template needs column {e.args[0]!r}, "
                                            "which this row lacks") from None
    except (ValueError, IndexError, OverflowError) as e:
        raise RowRejected("invalid_template", f"--prompt-template: {_short(e)}") from None


def _short(e: Exception, limit: int = 200) -> str:
    """An exception's message cut short: it may quote the row's value."""
    text = str(e)
    return text if len(text) <= limit else text[:limit] + "..."


def _has_system(messages: list) -> bool:
    return bool(messages) and isinstance(messages[0], dict) and messages[0].get("role") == "system"


def row_seed(index: int, base: int = 0) -> int:
    return (base * 1_000_003 + index * 7919 + 17) & 0x7FFF_FFFF_FFFF_FFFF


def sampling_params(body: dict, defaults: SamplingParams,
                    completion: bool = False) -> SamplingParams:
    """The job's defaults overridden by the row's own sampling fields. In a /v1/completions
    body an integer `logprobs` is OpenAI's count of alternatives a token."""
    overrides: dict[str, Any] = {}
    if "max_completion_tokens" in body and "max_tokens" not in body:
        overrides["max_tokens"] = body["max_completion_tokens"]
    for name in SAMPLING_FIELDS:
        if name in body and body[name] is not None:
            overrides[name] = body[name]
    for name in ("stop", "stop_token_ids"):
        value = overrides.get(name)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            overrides[name] = (value,)
        elif isinstance(value, list):
            overrides[name] = tuple(value)
    if body.get("logit_bias") is not None:
        overrides["logit_bias"] = _logit_bias(body["logit_bias"])
    count = overrides.get("logprobs")
    if completion and isinstance(count, int) and not isinstance(count, bool):
        if not 0 <= count <= 20:
            raise RowRejected("invalid_field", f"logprobs must be an integer in [0, 20], "
                                               f"got {count!r}")
        overrides["logprobs"], overrides["top_logprobs"] = True, count
    if isinstance(overrides.get("top_logprobs"), int) and overrides["top_logprobs"] > 0:
        overrides["logprobs"] = True
    if overrides.get("logprobs") is not None and not isinstance(overrides["logprobs"], bool):
        raise RowRejected("invalid_field", f"logprobs must be true or false, "
                                           f"got {overrides['logprobs']!r}")
    if not overrides:  # the job's own (frozen: shared by its rows)
        return defaults
    try:
        return dataclasses.replace(defaults, **overrides)
    except (ValueError, TypeError) as e:
        raise RowRejected("invalid_sampling", str(e)) from None


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: token ids (as JSON object keys: strings) mapped to numbers."""
    if not isinstance(value, dict):
        raise RowRejected("invalid_field", "logit_bias must be an object of token id: bias")
    bias = []
    for key, number in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise RowRejected("invalid_field", f"logit_bias: {key!r} is not a token id") \
                from None
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise RowRejected("invalid_field", f"logit_bias[{key!r}] must be a number")
        bias.append((token, float(number)))
    return tuple(bias)


def _kind(value: Any) -> str:
    return {type(None): "null", list: "a list", str: "a string", bool: "a boolean",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)
