"""OpenAI's error object before and after the first byte (gateways/common/chat/errors.py)."""

from __future__ import annotations

import json

import grpc
import pytest

from gateways.common.chat import errors
from gateways.common.status import GatewayError

STATUSES = [
    # (gRPC code, HTTP status, OpenAI type): docs/architecture.md, "Errors"; docs/openai.md, "Errors"
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (grpc.StatusCode.FAILED_PRECONDITION, 400, "invalid_request_error"),
    (grpc.StatusCode.OUT_OF_RANGE, 400, "invalid_request_error"),
    (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
    (grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
    (grpc.StatusCode.CANCELLED, 503, "server_error"),  # only the core cancels a call we still render
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "server_error"),
    (grpc.StatusCode.INTERNAL, 500, "server_error"),
    (grpc.StatusCode.UNKNOWN, 500, "server_error"),
]


@pytest.mark.parametrize("code, status, kind", STATUSES, ids=[c[0].name for c in STATUSES])
def test_render_before_stream(code, status, kind):
    err = GatewayError(code, "Something went wrong.", param="temperature", reason="SOME_REASON")
    resp = errors.render_before_stream(err)
    assert resp.status == status
    assert resp.content_type == "application/json"
    assert json.loads(resp.body) == {
        "error": {"message": "Something went wrong.", "type": kind, "param": "temperature", "code": "some_reason"}
    }


@pytest.mark.parametrize("code, status, kind", STATUSES, ids=[c[0].name for c in STATUSES])
def test_render_in_stream_has_the_same_object(code, status, kind):
    """An error without the core's reason still has a machine-readable code: its status's name."""
    err = GatewayError(code, "Late failure.")
    assert errors.render_in_stream(err) == {
        "error": {"message": "Late failure.", "type": kind, "param": None, "code": code.name.lower()}
    }


def test_overrides_change_status_and_type():
    err = GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "Busy.", reason="QUEUE_FULL")
    overrides = {grpc.StatusCode.RESOURCE_EXHAUSTED: 503}
    resp = errors.render_before_stream(err, overrides)
    assert resp.status == 503
    assert json.loads(resp.body)["error"]["type"] == "server_error"
    assert errors.render_in_stream(err, overrides)["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    "status, kind",
    [
        (400, "invalid_request_error"),
        (404, "invalid_request_error"),
        (405, "invalid_request_error"),
        (413, "invalid_request_error"),
        (429, "rate_limit_error"),
        (502, "server_error"),
    ],
)
def test_error_type(status, kind):
    assert errors.error_type(status) == kind


def test_error_response_keeps_non_ascii():
    resp = errors.error_response(400, "Ungültig: ☃", param="messages")
    assert "☃".encode() in resp.body
