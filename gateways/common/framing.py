"""Wire framing shared by the gateways: strict JSON in; JSON, Server-Sent Events and JSON lines
out, as bytes."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from typing import Any

import orjson

from gateways.common.status import GatewayError

SSE_CONTENT_TYPE = "text/event-stream"
JSONLINES_CONTENT_TYPE = "application/jsonlines"

# Records are encoded by orjson: every streamed token is one record, and orjson encodes one in
# about a tenth of the time of the standard library's encoder (scripts/bench/overhead.py).
# Non-string keys become strings (as json.dumps does); NaN and infinities, which are not JSON,
# become null instead of json.dumps' invalid `NaN`.
_OPTIONS = orjson.OPT_NON_STR_KEYS


#: Deepest nesting of arrays and objects a request may have (--max-json-depth).
MAX_JSON_DEPTH = 32


def loads(raw: bytes | str, what: str = "The request body", *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse strict JSON: NaN and Infinity are not JSON and are refused; so are a nesting
    deeper than `max_depth` and a lone surrogate escape (`"\\ud800"`: JSON allows it, but it is
    no Unicode character, and the request could not be encoded as UTF-8 for the core).

    Raises:
        GatewayError: INVALID_ARGUMENT naming `what`, for invalid UTF-8 or invalid JSON, or
            naming the field (its JSON path, e.g. "messages[0].content") that holds a lone
            surrogate or nests too deep.
    """
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        obj = _DECODER.decode(text)
    except UnicodeDecodeError:
        raise GatewayError.invalid(f"{what} is not valid UTF-8.") from None
    except (ValueError, RecursionError) as e:
        raise GatewayError.invalid(f"{what} is not valid JSON: {e}.") from None
    # A lone surrogate comes from an escape or, in text given as str, as itself (UTF-8 bytes
    # cannot carry one), and a body nests no deeper than its brackets: most bodies need no walk.
    if (
        _SURROGATE_ESCAPE.search(text)
        or (not text.isascii() and _SURROGATE.search(text))
        or text.count("[") + text.count("{") > max_depth
    ):
        _check_values(obj, [], max_depth, what)
    return obj


def _check_values(obj: Any, path: list[str | int], max_depth: int, what: str) -> None:
    """Raise GatewayError for the first string with a lone surrogate, or nesting past max_depth."""
    if isinstance(obj, str):
        if not obj.isascii() and _SURROGATE.search(obj):
            name = _path(path) or what
            raise GatewayError.invalid(
                f"{name}: the text contains a lone surrogate escape (a \\ud800-\\udfff escape without its pair), "
                "which is not a Unicode character.",
                _path(path) or None,
            )
        return
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, list):
        items = enumerate(obj)
    else:
        return
    if len(path) >= max_depth:
        raise GatewayError.invalid(
            f"{what} nests arrays and objects deeper than {max_depth} levels (at {_path(path)}).", _path(path) or None
        )
    for key, value in items:
        if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
            raise GatewayError.invalid(f"{what} has a key with a lone surrogate escape, at {_path(path) or 'the top'}.")
        path.append(key)
        _check_values(value, path, max_depth, what)
        path.pop()


_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _path(path: list[str | int]) -> str:
    """A JSON path as the schemas name fields: `messages[0].content`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON value")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def dumps(obj: Any) -> str:
    """Compact JSON that keeps non-ASCII text as is (what every gateway sends)."""
    return orjson.dumps(obj, option=_OPTIONS).decode()


def dump_bytes(obj: Any) -> bytes:
    """`dumps` as UTF-8 bytes, for writing to a transport."""
    return orjson.dumps(obj, option=_OPTIONS)


def sse_event(obj: Any) -> bytes:
    """One SSE event: `data: <json>` and a blank line."""
    return b"data: " + orjson.dumps(obj, option=_OPTIONS) + b"\n\n"


def named_sse_event(name: str, obj: Any) -> bytes:
    """One SSE event with an event name: `event: <name>` then `data: <JSON>` (the Responses and
    Anthropic Messages streams, whose clients dispatch on the name)."""
    return b"event: " + name.encode() + b"\n" + sse_event(obj)


def sse_done() -> bytes:
    """OpenAI's end-of-stream sentinel."""
    return b"data: [DONE]\n\n"


def jsonline(obj: Any) -> bytes:
    """One JSON lines record."""
    return orjson.dumps(obj, option=_OPTIONS | orjson.OPT_APPEND_NEWLINE)


#: Stand-ins for the values a Template leaves open: text no record carries (private-use
#: characters around a marker drawn per process, so no client can put one in a record's
#: constant part, e.g. a request id), each encoded as one JSON string.
_HOLES = tuple(f"\ue000{secrets.token_hex(8)}-{i}\ue001" for i in range(4))
_HOLES_JSON = tuple(orjson.dumps(h) for h in _HOLES)


class Template:
    """The bytes of a framed record with some JSON values left open, encoded once per request.

    A streamed token is one record whose other parts (ids, names, constants, framing) are the
    same on every token of a request: `render(*holes)` gives the framed record with a stand-in
    in place of each open value, split once here, and `fill(*values)` puts in each value's own
    orjson encoding. orjson encodes a value the same alone as inside an object or array, so
    `fill(*values) == render(*values)` byte for byte.

    Args:
        render: the framed bytes of the record for the given values (the general path, e.g.
            `lambda text: sse_event(chunk_with(text))`); each value must appear in it once, as
            a JSON value.
        holes: how many values are open (1 to 4).

    Raises:
        ValueError: a stand-in does not appear exactly once in the rendering (a value that is
            not rendered, or rendered as something other than itself).
    """

    __slots__ = ("_format", "_parts")

    def __init__(self, render: Callable[..., bytes], holes: int = 1):
        data = render(*_HOLES[:holes])
        parts: list[bytes] = []
        for hole in _HOLES_JSON[:holes]:
            head, found, data = data.partition(hole)
            if not found or hole in head or hole in data:
                raise ValueError("a template value must appear exactly once in the rendered record")
            parts.append(head)
        parts.append(data)
        self._parts = parts
        self._format = b"%b".join(p.replace(b"%", b"%%") for p in parts)

    def fill(self, *values: Any) -> bytes:
        """The record with `values` (str, int, float, bool or None) in their places."""
        dumps = orjson.dumps
        if len(values) == 3:  # LMI's token records (id, text, logprob): spelled out, 0.3 µs less than map
            a, b, c = values
            return self._format % (dumps(a), dumps(b), dumps(c))
        return self._format % tuple(map(dumps, values))

    def fill_text(self, text: str) -> bytes:
        """`fill(text)` for a one-value template (the common case: a token's text)."""
        parts = self._parts
        return parts[0] + orjson.dumps(text) + parts[1]
