"""Shape and type helpers shared by the gateways' schema and translate modules.

Gateways check only JSON shapes and types; value ranges and cross-field rules are the core's
(core.validation), checked once for every schema. What every schema needs for
that lives here: the proto's integer widths as pydantic types, and JSON type names and field
paths for error messages. (What the checked fields set on the contract: gateways.common.fields.)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Annotated, Any

import grpc
from pydantic import Field

from gateways.common.status import GatewayError

#: The most messages (or input items) a request may carry: the core's bound
#: (core.validation.MAX_MESSAGES), checked by `screen_fields` before pydantic validates each
#: one, so that a body of tens of thousands of tiny messages costs the event loop a length check
#: instead of a validation per message (about 13 µs each).
MAX_MESSAGES = 4096

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# The proto's int32 / int64 fields: a JSON integer outside their range cannot be sent at all, so
# it is a type error found by the gateway, not a range error for the core.
Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]

# pydantic's names for union members in an error location ("str", "list[str]",
# "function-after[...]", a model's class name): they are not fields of the request.
_PLAIN_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list"})


def json_type(value: Any) -> str:
    """The JSON type of a decoded value with its article, for messages: "a string", "an array",
    "a number", "a boolean", "an object", "null"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def field_path(loc: Iterable[int | str], *, tags: Collection[str] = ()) -> str:
    """A pydantic error location as the client's field path: `("prompts", 2, "request_id")` ->
    `"prompts[2].request_id"`.

    Union member tags are left out (`("parameters", "stop_sequences", "list[str]", 1)` ->
    `"parameters.stop_sequences[1]"`), and so are discriminator values in `tags` that follow a
    list index (OpenAI's content parts: `("content", 1, "text", "text")` -> `"content[1].text"`).
    """
    out = ""
    previous: int | str | None = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not (_is_union_tag(part) or (isinstance(previous, int) and part in tags)):
            out += f".{part}" if out else part
        previous = part
    return out


def _is_union_tag(part: str) -> bool:
    return part in _PLAIN_TYPE_TAGS or not part.islower() or "[" in part or "-" in part


def screen_fields(
    body: Any,
    known: Collection[str],
    *,
    ignored: Collection[str],
    unsupported: Mapping[str, str],
    neutral: Callable[[str, Any], bool],
    lists: Collection[str] = ("messages",),
    unknown_message: Callable[[str], str] = lambda name: f"Unrecognized request argument supplied: {name}",
    unsupported_message: Callable[[str, str], str] = lambda name, why: (
        f"The parameter '{name}' is not supported by this server: {why}."
    ),
) -> dict[str, Any]:
    """A request body's fields that the schema's model checks, before pydantic sees them.

    Args:
        body: the parsed JSON body.
        known: the model's fields (kept).
        ignored: fields accepted and dropped.
        unsupported: fields the API defines and this server does not serve, with why; dropped
            when `neutral(name, value)` (the value asks for nothing), else refused.
        neutral, unknown_message, unsupported_message: the schema's rule and wording.
        lists: the fields holding the conversation: a list of more than MAX_MESSAGES items is
            refused.

    Raises:
        GatewayError: INVALID_ARGUMENT for a body that is not an object; for an unknown field
            (reason UNKNOWN_PARAMETER) or an unsupported one that asks for something
            (UNSUPPORTED_PARAMETER), naming it; for a conversation of more than MAX_MESSAGES
            items, naming its field.
    """
    if not isinstance(body, dict):
        raise GatewayError.invalid("The request body must be a JSON object.", param=None)
    checked = {}
    for name, value in body.items():
        if name in known:
            if name in lists and isinstance(value, list) and len(value) > MAX_MESSAGES:
                raise GatewayError.invalid(f"At most {MAX_MESSAGES} messages are allowed, got {len(value)}.", name)
            checked[name] = value
        elif name in ignored:
            continue
        elif name in unsupported:
            if not neutral(name, value):
                raise GatewayError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    unsupported_message(name, unsupported[name]),
                    param=name,
                    reason="UNSUPPORTED_PARAMETER",
                )
        else:
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT, unknown_message(name), param=name, reason="UNKNOWN_PARAMETER"
            )
    return checked
