"""Pure parts of the chat completions route (gateways/common/chat/route.py)."""

from __future__ import annotations

import pytest

from gateways.common.chat import route as routes

CHUNK = {"id": "chatcmpl-1", "choices": []}


@pytest.mark.parametrize(
    "framing, body, tail",
    [
        (
            "sse",
            b'data: {"id":"chatcmpl-1","choices":[]}\n\ndata: {"id":"chatcmpl-1","choices":[]}\n\n',
            b"data: [DONE]\n\n",
        ),
        ("jsonlines", b'{"id":"chatcmpl-1","choices":[]}\n{"id":"chatcmpl-1","choices":[]}\n', b""),
    ],
)
def test_framing(framing, body, tail):
    assert routes.encode([CHUNK, CHUNK], framing) == body
    assert routes.encode([CHUNK], framing) == body[: len(body) // 2]
    assert routes.end_of_stream(framing) == tail


async def test_handle_chat_refuses_unknown_framings():
    with pytest.raises(ValueError):
        await routes.handle_chat(None, {"messages": []}, framing="xml")
