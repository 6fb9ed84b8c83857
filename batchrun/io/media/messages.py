"""The images of chat messages: where each one is (its field) and what it references, and the
per-row image limit. Content that is not a string or a list of known parts is the row's error.
"""

from __future__ import annotations

from typing import Any

from batchrun.io.media.errors import MediaError

_PART_TYPES = ("text", "image_url", "input_image", "image")


def image_parts(messages: Any, prefix: str = "messages") -> list[tuple[str, object]]:
    """The (field, reference) of every image in the messages, in order. Raises MediaError
    (invalid_content or invalid_image_url) for content that is not a string or a list of known
    parts."""
    if not isinstance(messages, list):
        raise MediaError("invalid_content", "must be a list of {role, content} objects", prefix)
    found: list[tuple[str, object]] = []
    for i, message in enumerate(messages):
        where = f"{prefix}[{i}]"
        if not isinstance(message, dict):
            raise MediaError("invalid_content", "must be a {role, content} object", where)
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise MediaError("invalid_content", "must be a string or a list of "
                             "{type: text|image_url, ...} parts", f"{where}.content")
        for j, part in enumerate(content):
            ref = _part_image(part, f"{where}.content[{j}]")
            if ref is not None:
                found.append(ref)
    return found


def count_images(messages: Any, prefix: str = "messages") -> int:
    return len(image_parts(messages, prefix))


def check_image_count(n: int, limit: int | None, field: str) -> None:
    if limit is not None and n > limit:
        raise MediaError("too_many_images", f"the row has {n} images, more than the limit of "
                         f"{limit} per row; split the row or raise the job's image limit", field)


def _part_image(part: Any, where: str) -> tuple[str, object] | None:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _PART_TYPES:
        raise MediaError("invalid_content", f"must be a part with type one of "
                         f"{', '.join(_PART_TYPES)}, got {_describe(part, kind)}", where)
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise MediaError("invalid_content", "a text part needs a string 'text'", where)
        return None
    if kind in ("image_url", "input_image"):
        where = f"{where}.{kind}"  # input_image is the Responses API's image_url part
        url = part.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        if not isinstance(url, str) or not url.strip():
            raise MediaError("invalid_image_url", "needs a url: {\"url\": \"<path, file://, "
                             "data: or http(s) URL>\"} or the URL as a string", where)
        return where, url
    for key in ("image", "url", "path"):  # {type: image} as Qwen and HF chat templates write it
        if part.get(key) is not None:
            return f"{where}.{key}", part[key]
    raise MediaError("invalid_image_url", "an image part needs 'image' (a path, URL or bytes), "
                     "'url' or 'path'", where)


def _describe(part: Any, kind: Any) -> str:
    if not isinstance(part, dict):
        return type(part).__name__
    return "no type" if kind is None else repr(kind)
