"""Error rendering of the /ws protocol (gateways.ws.errors): refused frames, per-prompt ERROR
events with the core's field named in this protocol's terms, and the pre-upgrade answer."""

import json

import grpc
import pytest

from gateways.common.status import GatewayError
from gateways.ws.errors import UPGRADE_REQUIRED, error_text, render_before_stream, render_in_stream

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "err, request_id, prompt, text",
    [
        (
            GatewayError(
                INVALID,
                "num_beams=2 asks for beam search, which the hf engine does not support; use num_beams=1.",
                param="sampling.num_beams",
            ),
            "a",
            "x",
            "generation_config.num_beams: num_beams=2 asks for beam search, which the hf engine does not "
            "support; use num_beams=1.",
        ),
        (
            GatewayError(
                INVALID,
                "The prompt has 9 tokens and max_new_tokens is 5000, which exceeds ...",
                param="stopping.max_new_tokens",
            ),
            "a",
            "x",
            "generation_config.max_new_tokens: The prompt has 9 tokens and max_new_tokens is 5000, which exceeds ...",
        ),
        (
            GatewayError(INVALID, "top_p must be in (0, 1].", param="sampling.top_p"),
            "a",
            "x",
            "generation_config.top_p: top_p must be in (0, 1].",
        ),
        (
            GatewayError(
                INVALID,
                "There is no live session 'a' to continue and the request has no input; "
                "send text, token_ids or messages.",
                param="text",
            ),
            "a",
            "",
            "prompt: the prompt is empty and there is no session for request_id 'a' to continue; send a prompt.",
        ),
        (
            GatewayError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "Session 'a' is in use by another running request.",
                param="session_id",
                reason="SESSION_BUSY",
            ),
            "a",
            "x",
            "request_id: 'a' is already generating on another connection; wait for its COMPLETE or ERROR before "
            "sending it again.",
        ),
        (
            GatewayError(grpc.StatusCode.UNAVAILABLE, "The model server cannot be reached."),
            "a",
            "x",
            "The model server cannot be reached.",
        ),
        (
            GatewayError(INVALID, "prompts: must not be empty.", param="prompts"),
            None,
            None,
            "prompts: must not be empty.",
        ),
        (
            GatewayError(INVALID, "odd", param="sampling.logit_bias"),
            "a",
            "x",
            "odd",
        ),
    ],
    ids=[
        "num_beams",
        "max_new_tokens",
        "top_p",
        "empty prompt without session",
        "session busy",
        "unavailable",
        "gateway's own",
        "unmapped field",
    ],
)
def test_error_text(err, request_id, prompt, text):
    assert error_text(err, request_id=request_id, prompt=prompt) == text


def test_render_in_stream_shapes():
    err = GatewayError(grpc.StatusCode.INTERNAL, "boom")
    assert render_in_stream(err, "r") == {"request_id": "r", "type": "ERROR", "error": "boom"}
    assert render_in_stream(err) == {"error": "boom"}


def test_render_before_stream():
    resp = render_before_stream(GatewayError(grpc.StatusCode.FAILED_PRECONDITION, "use ws", reason=UPGRADE_REQUIRED))
    assert resp.status == 426
    assert resp.headers["Upgrade"] == "websocket"
    assert json.loads(resp.text) == [{"error": "use ws"}]
    resp = render_before_stream(GatewayError(grpc.StatusCode.UNAVAILABLE, "down"))
    assert resp.status == 503
    assert json.loads(resp.text) == [{"error": "down"}]
