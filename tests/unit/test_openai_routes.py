"""Pure parts of the OpenAI gateway's handlers (gateways/openai/routes.py)."""

from __future__ import annotations

import grpc
import pytest
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.status import GatewayError
from gateways.openai import routes, translate

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
    assert routes.end_of_stream(framing) == tail


async def test_handle_chat_refuses_unknown_framings():
    with pytest.raises(ValueError):
        await routes.handle_chat(None, {"messages": []}, framing="xml")
    with pytest.raises(ValueError):
        await routes.handle_chat(None, {"messages": []}, finish_reasons="tgi")


def test_a_stream_without_its_final_message_is_an_internal_error():
    state = translate.StreamState("chatcmpl-1", 1, "tiny")
    with pytest.raises(GatewayError) as info:
        routes._completion([spb.GenerateResponse(request_id="x")], state)
    assert info.value.code is grpc.StatusCode.INTERNAL and info.value.http_status() == 500


def test_a_stream_without_its_final_message_ends_with_an_internal_error():
    state = translate.StreamState("chatcmpl-1", 1, "tiny", include_usage=True)
    with pytest.raises(GatewayError) as info:
        routes._closing_chunks(state)
    assert info.value.code is grpc.StatusCode.INTERNAL
    state.usage = pb.Usage(prompt_tokens=2, completion_tokens=3)
    assert routes._closing_chunks(state) == [translate.usage_chunk(state)]
    state.include_usage = False
    assert routes._closing_chunks(state) == []
