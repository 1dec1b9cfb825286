"""The field tables every schema uses both ways (gateways/common/fields.py): client values onto
the GenerateRequest, and the core's field paths back to the client's names."""

from __future__ import annotations

import grpc
import pytest
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.fields import Field, FieldTable, client_error, true_or_unset
from gateways.common.status import GatewayError

TABLE = FieldTable(
    (
        Field("inputs", "text", None),
        Field("parameters.top_k", "sampling.top_k", lambda v: None if v == -1 else v),
        Field("parameters.max_tokens", "stopping.max_new_tokens", aliases=("max_new_tokens",)),
        Field("parameters.max_completion_tokens", "stopping.max_new_tokens"),
        Field("parameters.stop", "stopping.stop"),
        Field("parameters.logit_bias", "sampling.logit_bias"),
        Field("parameters.echo", "output.echo", true_or_unset),
        Field("parameters.stream", None),
    )
)


def test_apply_sets_what_the_client_gave_through_the_transforms():
    req = spb.GenerateRequest()
    TABLE.apply(
        {"top_k": -1, "max_tokens": 5, "stop": ["a", "b"], "logit_bias": {7: 1.5}, "echo": False, "stream": True},
        req,
    )
    assert not req.sampling.HasField("top_k")  # -1: the schema's "disabled"
    assert req.stopping.max_new_tokens == 5
    assert list(req.stopping.stop) == ["a", "b"]
    assert dict(req.sampling.logit_bias) == {7: 1.5}
    assert not req.output.HasField("echo")
    TABLE.apply({"top_k": 3, "echo": True, "inputs": "ignored: set by the schema's code"}, req)
    assert (req.sampling.top_k, req.output.echo, req.WhichOneof("input")) == (3, True, None)


def test_the_later_given_row_wins_and_names_the_path():
    req = spb.GenerateRequest()
    TABLE.apply({"max_tokens": 5, "max_completion_tokens": 9}, req)
    assert req.stopping.max_new_tokens == 9
    assert TABLE.names(["max_tokens", "max_completion_tokens"])["stopping.max_new_tokens"] == (
        "parameters.max_completion_tokens"
    )
    assert TABLE.names(["max_tokens"])["stopping.max_new_tokens"] == "parameters.max_tokens"
    assert TABLE.names(["max_new_tokens"])["stopping.max_new_tokens"] == "parameters.max_new_tokens"
    # Nothing given: the first row names the path.
    assert TABLE.names()["stopping.max_new_tokens"] == "parameters.max_tokens"
    assert TABLE.names()["text"] == "inputs"


def test_apply_assigns_extends_and_updates_nested_and_top_level_fields():
    table = FieldTable(
        (
            Field("temperature", "sampling.temperature"),
            Field("stop_token_ids", "stopping.stop_token_ids"),
            Field("logit_bias", "sampling.logit_bias"),
            Field("model", "model"),
            Field("stop", "stopping.stop"),
        )
    )
    req = spb.GenerateRequest()
    table.apply({"temperature": 0.5, "stop_token_ids": (1, 2), "logit_bias": {3: -1.0}, "model": "m", "stop": []}, req)
    assert (req.sampling.temperature, list(req.stopping.stop_token_ids), req.model) == (0.5, [1, 2], "m")
    assert dict(req.sampling.logit_bias) == {3: -1.0}
    # An empty list or mapping changes nothing, not even the enclosing message's presence.
    req = spb.GenerateRequest()
    table.apply({"stop": [], "logit_bias": {}}, req)
    assert not req.HasField("stopping") and not req.HasField("sampling")


NAMES = TABLE.names(["max_new_tokens"])


@pytest.mark.parametrize(
    ("param", "message", "prefix", "want_param", "want_message"),
    [
        ("sampling.top_k", "top_k must be in [0, inf), got -2.", True, "parameters.top_k", None),
        (
            "stopping.max_new_tokens",
            "max_new_tokens must be in [1, 1024], got 0.",
            True,
            "parameters.max_new_tokens",
            "parameters.max_new_tokens: max_new_tokens must be in [1, 1024], got 0.",
        ),
        ("text", "The prompt text is empty.", True, "inputs", "inputs: The prompt text is empty."),
        ("text", "The prompt text is empty.", False, "inputs", "The prompt text is empty."),
        ("inputs", "inputs: already the client's name.", True, "inputs", "inputs: already the client's name."),
        ("parameters.top_k", "a gateway's own error", True, "parameters.top_k", "a gateway's own error"),
        (None, "The server is at capacity.", True, None, "The server is at capacity."),
        ("session_id", "not in the table", True, "session_id", "not in the table"),
    ],
)
def test_client_error_names_the_clients_field(param, message, prefix, want_param, want_message):
    err = GatewayError(grpc.StatusCode.INVALID_ARGUMENT, message, param=param, reason="R")
    out = client_error(err, NAMES, prefix=prefix)
    want = want_message or f"{want_param}: {message}"
    assert (out.code, out.param, out.message, out.reason) == (err.code, want_param, want, "R")


def test_a_longer_name_is_not_the_clients_name():
    names = {"stopping.stop": "stop"}
    err = GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "stop_words: x", param="stopping.stop")
    assert client_error(err, names).message == "stop: stop_words: x"
    err = GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "stop sequences: x", param="stopping.stop")
    assert client_error(err, names).message == "stop sequences: x"
