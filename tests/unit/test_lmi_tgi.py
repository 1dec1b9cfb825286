"""TGI's routes on the LMI gateway, the pure parts: error statuses and types
(gateways.lmi.tgi_errors), `/tokenize` and `/info` bodies (gateways.lmi.translate), and the
TGI router's record shapes (translate.StreamRenderer, render_response)."""

from __future__ import annotations

import grpc
import pytest
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.core_call import incomplete_stream
from gateways.common.status import GatewayError
from gateways.lmi import tgi_errors
from gateways.lmi.errors import PayloadError
from gateways.lmi.schema import GenerationParameters
from gateways.lmi.translate import (
    StreamRenderer,
    collect_messages,
    render_options,
    render_response,
    tgi_info,
    tgi_tokens,
    to_generate_request,
)


@pytest.mark.parametrize(
    ("err", "expected"),
    [
        (PayloadError("inputs is missing"), (422, "validation")),
        (GatewayError.invalid("bad top_p"), (422, "validation")),
        (GatewayError(grpc.StatusCode.OUT_OF_RANGE, "x"), (422, "validation")),
        (GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"), (429, "overloaded")),
        (GatewayError(grpc.StatusCode.UNAVAILABLE, "down"), (503, "unavailable")),
        (GatewayError(grpc.StatusCode.CANCELLED, "draining"), (503, "unavailable")),
        (GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, "slow"), (504, "timeout")),
        (GatewayError(grpc.StatusCode.INTERNAL, "engine"), (424, "generation")),
        (incomplete_stream(), (500, "incomplete_generation")),
    ],
)
def test_error_status_and_type(err, expected):
    assert tgi_errors.status_and_type(err) == expected
    assert tgi_errors.render_in_stream(err) == {"error": err.message, "error_type": expected[1]}


@pytest.mark.parametrize(
    ("status", "error_type"),
    [(401, "authentication"), (405, "method_not_allowed"), (413, "validation"), (500, "internal")],
)
def test_http_level_errors(status, error_type):
    resp = tgi_errors.render_http_error(status, "m")
    assert resp.status == status and resp.text == f'{{"error":"m","error_type":"{error_type}"}}'


def test_tokens_with_and_without_spans():
    text = "hé y"
    resp = spb.TokenizeResponse(
        token_ids=[1, 7, 8],
        spans=[spb.TokenSpan(start=0, stop=0), spb.TokenSpan(start=0, stop=3), spb.TokenSpan(start=3, stop=5)],
    )
    assert tgi_tokens(text, resp) == [
        {"id": 1, "text": "", "start": 0, "stop": 0},
        {"id": 7, "text": "hé", "start": 0, "stop": 3},
        {"id": 8, "text": " y", "start": 3, "stop": 5},
    ]
    assert tgi_tokens(text, resp, truncate=1) == [{"id": 8, "text": " y", "start": 3, "stop": 5}]
    no_spans = spb.TokenizeResponse(token_ids=[1, 7])
    assert tgi_tokens(text, no_spans) == [
        {"id": 1, "text": "", "start": 0, "stop": 0},
        {"id": 7, "text": "", "start": 0, "stop": 0},
    ]


def test_info_from_model_info():
    info = spb.GetModelInfoResponse(model_name="m", max_context_length=2048, max_n=4, max_stop_sequences=16)
    out = tgi_info(info, "1.2.3")
    assert out["model_id"] == "m" and out["max_total_tokens"] == 2048 and out["max_input_tokens"] == 2047
    assert out["max_best_of"] == 4 and out["max_stop_sequences"] == 16 and out["version"] == "1.2.3"
    assert out["max_concurrent_requests"] is None and out["model_sha"] is None


def _messages() -> list[spb.GenerateResponse]:
    tok = pb.Token(id=5, text="a", logprob=-0.5)
    return [
        spb.GenerateResponse(outputs=[pb.SequenceOutput(index=0, text="a", tokens=[tok])]),
        spb.GenerateResponse(
            outputs=[
                pb.SequenceOutput(
                    index=0, text="b", tokens=[pb.Token(id=6, logprob=-1.0)], finish_reason=pb.FINISH_REASON_LENGTH
                )
            ],
            usage=pb.Usage(prompt_tokens=3, completion_tokens=2),
        ),
    ]


def test_router_stream_records():
    p = GenerationParameters(details=True)
    renderer = StreamRenderer(render_options("q", p, stream=True, tgi_compat=False, tgi_router=True))
    records = [r for m in _messages() for r in renderer.feed(m)]
    assert records[0] == {
        "index": 1,
        "token": {"id": 5, "text": "a", "logprob": -0.5, "special": False},
        "generated_text": None,
        "details": None,
    }
    assert records[1]["index"] == 2 and records[1]["generated_text"] == "ab"
    assert records[1]["details"] == {"finish_reason": "length", "generated_tokens": 2, "seed": None, "input_length": 3}


def test_router_body_and_defaults():
    plain = GenerationParameters()
    opts = render_options("q", plain, stream=False, tgi_compat=False, tgi_router=True)
    assert render_response(collect_messages(_messages()), opts) == {"generated_text": "ab"}
    assert not to_generate_request("q", plain, opts, request_id="r").stopping.HasField("max_new_tokens")
    array = render_options(
        "q", GenerationParameters(details=True), stream=False, tgi_compat=False, tgi_router=True, array=True
    )
    body = render_response(collect_messages(_messages()), array)
    assert isinstance(body, list) and "inputs" not in body[0]["details"] and body[0]["details"]["prefill"] == []


@pytest.mark.parametrize(
    ("params", "stream", "name"),
    [({"decoder_input_details": True}, True, "decoder_input_details")],
)
def test_router_refusals(params, stream, name):
    p = GenerationParameters.model_validate(params)
    opts = render_options("q", p, stream=stream, tgi_compat=False, tgi_router=True)
    with pytest.raises(GatewayError) as e:
        to_generate_request("q", p, opts, request_id="r")
    assert e.value.param == f"parameters.{name}"


def test_adapter_id_names_the_adapter():
    p = GenerationParameters.model_validate({"adapter_id": "a"})
    opts = render_options("q", p, stream=False, tgi_compat=False, tgi_router=True)
    assert to_generate_request("q", p, opts, request_id="r").adapter == "a"
    assert to_generate_request("q", p, opts, request_id="r", adapter="a").adapter == "a"
    with pytest.raises(GatewayError) as e:
        to_generate_request("q", p, opts, request_id="r", adapter="b")
    assert e.value.param == "parameters.adapter_id"
