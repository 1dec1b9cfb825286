"""Every LMI error row (docs/lmi.md, "Errors"; LMI's "Error Responses"): status and body
before the stream, the in-band record after it, the dynamic-batch shape, HTTP-level errors, and
the LMI names of the core's field paths (translate.FIELDS)."""

from __future__ import annotations

import json

import grpc
import pytest
from aiohttp.test_utils import make_mocked_request

from gateways.common.config import GatewayConfig
from gateways.common.fields import client_error
from gateways.common.status import GatewayError
from gateways.lmi import make_app
from gateways.lmi.errors import (
    PayloadError,
    dynamic_error,
    model_not_found,
    render_before_stream,
    render_http_error,
    render_in_stream,
)
from gateways.lmi.translate import FIELDS

ERROR_BODY = {
    "generated_text": "",
    "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None, "tokens": None},
    "error": "boom",
}


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.FAILED_PRECONDITION, 400),
        (grpc.StatusCode.OUT_OF_RANGE, 400),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.PERMISSION_DENIED, 403),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 503),  # DJL answers a full job queue with 503
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNKNOWN, 500),
    ],
)
def test_before_stream_status_from_grpc_code(code, status):
    resp = render_before_stream(GatewayError(code, "boom"))
    assert resp.status == status
    assert resp.content_type == "application/json"
    assert json.loads(resp.text) == ERROR_BODY


@pytest.mark.parametrize(
    ("err", "status"),
    [
        (PayloadError("bad shape", param="inputs"), 424),
        (model_not_found("gpt2", "tiny"), 404),
    ],
)
def test_before_stream_error_code_shape(err, status):
    resp = render_before_stream(err)
    assert resp.status == status
    assert json.loads(resp.text) == {"error": err.message, "code": status}


@pytest.mark.parametrize(
    ("batching", "status", "want_status", "body"),
    [
        ("rolling", 404, 404, {"error": "boom", "code": 404}),
        ("rolling", 405, 405, {"error": "boom", "code": 405}),
        ("rolling", 413, 413, {"error": "boom", "code": 413}),
        ("rolling", 500, 500, ERROR_BODY),
        ("dynamic", 404, 404, {"error": "boom", "code": 404}),
        ("dynamic", 405, 405, {"error": "boom", "code": 405}),
        ("dynamic", 413, 413, {"code": 413, "message": "invoke handler failure", "error": "boom"}),
        ("dynamic", 500, 424, {"code": 424, "message": "invoke handler failure", "error": "boom"}),
    ],
)
def test_http_errors(batching, status, want_status, body):
    app = make_app(GatewayConfig(name="lmi", options={"batching": batching}))
    resp = render_http_error(make_mocked_request("GET", "/x", app=app), status, "boom")
    assert (resp.status, resp.content_type, json.loads(resp.text)) == (want_status, "application/json", body)


def test_shape_error_messages():
    assert model_not_found("gpt2", "tiny").message == "Model not found: 'gpt2'; this server serves 'tiny'."


@pytest.mark.parametrize("tgi_compat", [False, True])
def test_in_stream_record(tgi_compat):
    record = render_in_stream(GatewayError(grpc.StatusCode.INTERNAL, "engine died"), tgi_compat=tgi_compat)
    token = (
        {"id": -1, "text": "", "logprob": -1, "special": True}
        if tgi_compat
        else {"id": -1, "text": "", "log_prob": -1, "special_token": True}
    )
    assert record == {
        "token": token,
        "generated_text": "",
        "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None},
        "error": "engine died",
    }


@pytest.mark.parametrize(
    ("err", "status"),
    [
        (GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "boom"), 424),
        (GatewayError(grpc.StatusCode.INTERNAL, "boom"), 424),
        (GatewayError(grpc.StatusCode.NOT_FOUND, "boom"), 404),
        (PayloadError("boom"), 424),
        (GatewayError(grpc.StatusCode.UNAVAILABLE, "boom"), 503),
        (GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "boom"), 503),
    ],
)
def test_dynamic_errors(err, status):
    resp = render_before_stream(err, dynamic=True)
    assert resp.status == status
    assert json.loads(resp.text) == {"code": status, "message": "invoke handler failure", "error": "boom"}
    assert dynamic_error(err) == (status, json.loads(resp.text))


@pytest.mark.parametrize(
    ("core_param", "given", "lmi"),
    [
        (None, set(), None),
        ("text", set(), "inputs"),
        ("sampling.temperature", set(), "parameters.temperature"),
        ("sampling.top_k", set(), "parameters.top_k"),
        ("sampling.top_p", set(), "parameters.top_p"),
        ("sampling.min_p", set(), "parameters.min_p"),
        ("sampling.typical_p", set(), "parameters.typical_p"),
        ("sampling.repetition_penalty", set(), "parameters.repetition_penalty"),
        ("sampling.presence_penalty", set(), "parameters.presence_penalty"),
        ("sampling.frequency_penalty", set(), "parameters.frequency_penalty"),
        ("sampling.length_penalty", set(), "parameters.length_penalty"),
        ("sampling.early_stopping", set(), "parameters.early_stopping"),
        ("sampling.seed", set(), "parameters.seed"),
        ("sampling.num_beams", set(), "parameters.num_beams"),
        ("sampling.bad_words", set(), "parameters.bad_sequences"),
        ("sampling.n", {"n"}, "parameters.n"),
        ("sampling.n", {"best_of"}, "parameters.best_of"),
        ("sampling.n", {"n", "best_of"}, "parameters.n"),
        ("sampling.best_of", {"n", "best_of"}, "parameters.best_of"),
        ("sampling.best_of", {"n"}, "parameters.n"),
        ("stopping.max_new_tokens", set(), "parameters.max_new_tokens"),
        ("stopping.min_new_tokens", set(), "parameters.min_length"),
        ("stopping.stop", set(), "parameters.stop_sequences"),
        ("stopping.stop_token_ids", set(), "parameters.stop_token_ids"),
        ("stopping.truncate_input_tokens", set(), "parameters.truncate"),
        ("output.top_logprobs", {"logprobs"}, "parameters.logprobs"),
        ("output.top_logprobs", {"top_n_tokens"}, "parameters.top_n_tokens"),
        ("output.prompt_logprobs", {"prompt_logprobs"}, "parameters.prompt_logprobs"),
        ("output.prompt_logprobs", {"decoder_input_details"}, "parameters.decoder_input_details"),
        ("session_id", set(), "session_id"),
    ],
)
def test_lmi_names_of_core_fields(core_param, given, lmi):
    assert FIELDS.names(given).get(core_param, core_param) == lmi


def test_client_error_prefixes_the_message():
    err = GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1], got 0.", param="sampling.top_p")
    out = client_error(err, FIELDS.names())
    assert out.param == "parameters.top_p"
    assert out.message == "parameters.top_p: top_p must be in (0, 1], got 0."
    assert out.code is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "err",
    [
        GatewayError(grpc.StatusCode.INTERNAL, "no field"),
        GatewayError.invalid("parameters.stop: refused", param="parameters.stop"),
        PayloadError("bad", param="inputs"),
    ],
)
def test_client_error_leaves_the_gateways_own_errors(err):
    assert client_error(err, FIELDS.names()) is err
