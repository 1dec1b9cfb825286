"""A conversation of more than MAX_MESSAGES items is refused by the gateway's field screen,
naming its field, before pydantic validates each item: tens of thousands of tiny messages would
otherwise cost the gateway's event loop close to a second per body."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from core.validation import MAX_MESSAGES as CORE_MAX_MESSAGES
from gateways.common.chat.schema import parse_chat_request
from gateways.common.schema import MAX_MESSAGES
from gateways.common.status import GatewayError
from gateways.openai.messages_schema import parse_messages_request
from gateways.openai.responses_schema import parse_responses_request

MESSAGE = {"role": "user", "content": "hi"}


def test_the_gateway_bound_is_the_cores() -> None:
    assert MAX_MESSAGES == CORE_MAX_MESSAGES


@pytest.mark.parametrize(
    ("parse", "field", "extra"),
    [
        (parse_chat_request, "messages", {"model": "m"}),
        (parse_responses_request, "input", {"model": "m"}),
        (parse_messages_request, "messages", {"model": "m", "max_tokens": 8}),
    ],
)
def test_one_message_too_many_is_refused_naming_the_field(
    parse: Callable[[Any], object], field: str, extra: dict[str, Any]
) -> None:
    parse({**extra, field: [MESSAGE] * MAX_MESSAGES})  # the bound itself passes
    with pytest.raises(GatewayError) as info:
        parse({**extra, field: [MESSAGE] * (MAX_MESSAGES + 1)})
    assert info.value.param == field
    assert f"At most {MAX_MESSAGES} messages" in str(info.value)
