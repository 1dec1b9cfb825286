"""Table tests of the Triton gateway's pure translation: request bodies -> GenerateRequest, stream
messages -> `$generate_response` objects, URL model/version checks, error messages, metadata."""

from __future__ import annotations

import importlib.metadata
import json

import grpc
import pytest
from google.protobuf import json_format
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.config import GatewayConfig, load
from gateways.common.fields import client_error
from gateways.common.status import GatewayError
from gateways.triton import add_arguments, errors, make_app, translate
from gateways.triton.config import SETTINGS_KEY, load_settings
from gateways.triton.translate import ResponseRenderer, ServedModel

RID = "triton-test"


def _translate(body, **kw) -> translate.Translation:
    return translate.to_generate_request(body, model="tiny", request_id=RID, **kw)


def _expected(**fields) -> spb.GenerateRequest:
    return spb.GenerateRequest(request_id=RID, model="tiny", text="hi", **fields)


# ----------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, _expected()),
        ({"max_tokens": 7}, _expected(stopping=pb.StoppingParams(max_new_tokens=7))),
        ({"max_new_tokens": 7.0}, _expected(stopping=pb.StoppingParams(max_new_tokens=7))),
        ({"temperature": 0}, _expected(sampling=pb.SamplingParams(temperature=0.0))),
        ({"temperature": 0.5}, _expected(sampling=pb.SamplingParams(temperature=0.5))),
        ({"top_k": 40}, _expected(sampling=pb.SamplingParams(top_k=40))),
        ({"top_p": 0.5}, _expected(sampling=pb.SamplingParams(top_p=0.5))),
        ({"top_p": 0}, _expected()),  # Triton's TensorRT-LLM backend drops top_p <= 0
        ({"top_p": -1.0}, _expected()),
        ({"random_seed": 2**40}, _expected(sampling=pb.SamplingParams(seed=2**40))),
        ({"seed": -3}, _expected(sampling=pb.SamplingParams(seed=-3))),
        ({"repetition_penalty": 1.25}, _expected(sampling=pb.SamplingParams(repetition_penalty=1.25))),
        ({"presence_penalty": 0.5}, _expected(sampling=pb.SamplingParams(presence_penalty=0.5))),
        ({"frequency_penalty": -0.5}, _expected(sampling=pb.SamplingParams(frequency_penalty=-0.5))),
        ({"length_penalty": 1}, _expected(sampling=pb.SamplingParams(length_penalty=1.0))),
        ({"min_length": 3}, _expected(stopping=pb.StoppingParams(min_new_tokens=3))),
        ({"min_tokens": 0}, _expected(stopping=pb.StoppingParams(min_new_tokens=0))),
        ({"stop_words": "x"}, _expected(stopping=pb.StoppingParams(stop=["x"]))),
        ({"stop_words": ["a", "", "b"]}, _expected(stopping=pb.StoppingParams(stop=["a", "b"]))),
        ({"stop": ""}, _expected()),
        ({"stop_words": []}, _expected()),
        ({"bad_words": ["a", "b c"]}, _expected(sampling=pb.SamplingParams(bad_words=["a", "b c"]))),
        ({"bad_words": ""}, _expected()),
        ({"beam_width": 1}, _expected(sampling=pb.SamplingParams(num_beams=1))),
        ({"beam_width": 4}, _expected(sampling=pb.SamplingParams(num_beams=4))),
        ({"end_id": 2}, _expected(stopping=pb.StoppingParams(stop_token_ids=[2], ignore_eos=True))),
        ({"end_id": -1}, _expected(stopping=pb.StoppingParams(ignore_eos=True))),
        ({"pad_id": 0}, _expected()),
        ({"return_log_probs": True}, _expected(output=pb.OutputOptions(logprobs=True))),
        ({"return_log_probs": False}, _expected()),
        ({"exclude_input_in_output": False}, _expected(output=pb.OutputOptions(echo=True))),
        ({"exclude_input_in_output": True}, _expected()),
        (
            {"include_stop_str_in_output": True},
            _expected(stopping=pb.StoppingParams(include_stop_str_in_output=True)),
        ),
        ({"stream": True}, _expected()),
        ({"stream": False}, _expected()),
        # The vLLM backend's names.
        ({"ignore_eos": True}, _expected(stopping=pb.StoppingParams(ignore_eos=True))),
        ({"min_p": 0.5}, _expected(sampling=pb.SamplingParams(min_p=0.5))),
        ({"stop_token_ids": [4, 5.0]}, _expected(stopping=pb.StoppingParams(stop_token_ids=[4, 5]))),
        (
            {"stop_token_ids": [4], "end_id": 2},
            _expected(stopping=pb.StoppingParams(stop_token_ids=[4, 2], ignore_eos=True)),
        ),
        ({"skip_special_tokens": False}, _expected(output=pb.OutputOptions(skip_special_tokens=False))),
        (
            {"spaces_between_special_tokens": False},
            _expected(output=pb.OutputOptions(spaces_between_special_tokens=False)),
        ),
        ({"num_return_sequences": 1}, _expected()),
        ({"return_context_logits": False, "return_generation_logits": False}, _expected()),
        (
            {"max_tokens": 5, "top_k": 5, "temperature": 1.5, "stop_words": ["."], "return_log_probs": True},
            _expected(
                sampling=pb.SamplingParams(top_k=5, temperature=1.5),
                stopping=pb.StoppingParams(max_new_tokens=5, stop=["."]),
                output=pb.OutputOptions(logprobs=True),
            ),
        ),
    ],
)
def test_parameters_map_to_generate_request(params, expected):
    tr = _translate({"text_input": "hi", "parameters": params})
    assert tr.request == expected
    # The same parameters as top-level members mean the same (seed: extra properties are parameters).
    assert _translate({"text_input": "hi", **params}).request == expected


def test_sampling_mode_is_left_to_the_core():
    tr = _translate({"text_input": "hi", "parameters": {"temperature": 0.7, "top_k": 5}})
    assert not tr.request.sampling.HasField("do_sample")


def test_id_logprobs_and_names_are_kept():
    tr = _translate({"id": "42", "text_input": "hi", "parameters": {"return_log_probs": True, "max_new_tokens": 3}})
    assert tr.client_id == "42"
    assert tr.logprobs is True
    assert tr.names["stopping.max_new_tokens"] == "max_new_tokens"
    assert tr.names["sampling.num_beams"] == "beam_width"
    assert tr.names["text"] == "text_input"
    assert _translate({"text_input": "hi"}).client_id is None


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ([], "body", "must be a JSON object"),
        ("hi", "body", "got a string"),
        ({"parameters": {}}, "text_input", "no 'text_input'"),
        ({"text_input": 3}, "text_input", "'text_input' must be a string, got a number"),
        ({"text_input": None}, "text_input", "got null"),
        ({"text_input": "x", "id": 42}, "id", "'id' must be a string, got a number"),
        ({"text_input": "x", "id": None}, "id", "got null"),
        ({"text_input": "x", "parameters": []}, "parameters", "must be an object"),
        ({"text_input": "x", "parameters": None}, "parameters", "got null"),
        ({"text_input": "x", "parameters": {"temperature": "0.5"}}, "temperature", "must be a number, got a string"),
        ({"text_input": "x", "parameters": {"temperature": True}}, "temperature", "got a boolean"),
        ({"text_input": "x", "parameters": {"temperature": None}}, "temperature", "got null"),
        ({"text_input": "x", "parameters": {"temperature": 10**400}}, "temperature", "too large"),
        ({"text_input": "x", "parameters": {"top_k": 1.5}}, "top_k", "must be an integer, got 1.5"),
        ({"text_input": "x", "parameters": {"top_k": "5"}}, "top_k", "must be an integer, got a string"),
        ({"text_input": "x", "parameters": {"top_k": float("inf")}}, "top_k", "must be an integer"),
        ({"text_input": "x", "parameters": {"max_tokens": 2**31}}, "max_tokens", "32-bit integer"),
        ({"text_input": "x", "parameters": {"random_seed": 2**63}}, "random_seed", "64-bit integer"),
        ({"text_input": "x", "parameters": {"return_log_probs": 1}}, "return_log_probs", "must be a boolean"),
        ({"text_input": "x", "parameters": {"stream": "true"}}, "stream", "must be a boolean, got a string"),
        ({"text_input": "x", "parameters": {"exclude_input_in_output": 0}}, "exclude_input_in_output", "boolean"),
        ({"text_input": "x", "parameters": {"stop_words": 5}}, "stop_words", "a string or an array of strings"),
        ({"text_input": "x", "parameters": {"bad_words": ["a", 1]}}, "bad_words", "array of strings"),
        ({"text_input": "x", "parameters": {"stop_token_ids": 4}}, "stop_token_ids", "array of integers"),
        ({"text_input": "x", "parameters": {"stop_token_ids": [2**31]}}, "stop_token_ids", "32-bit integer"),
        ({"text_input": "x", "parameters": {"ignore_eos": 1}}, "ignore_eos", "must be a boolean"),
        ({"text_input": "x", "parameters": {"foo": 1}}, "foo", "Unknown parameter 'foo'"),
        ({"text_input": "x", "foo": 1}, "foo", "Unknown parameter 'foo'"),
        ({"text_input": "x", "parameters": {"max_tokens": 1, "max_new_tokens": 2}}, "max_new_tokens", "same thing"),
        ({"text_input": "x", "parameters": {"stop": "a"}, "stop_words": "b"}, "stop_words", "same thing"),
        ({"text_input": "x", "parameters": {"top_k": 1}, "top_k": 1}, "top_k", "both in 'parameters'"),
        ({"text_input": "x", "num_return_sequences": 2}, "num_return_sequences", "only num_return_sequences=1"),
        ({"text_input": "x", "num_return_sequences": True}, "num_return_sequences", "not supported"),
        ({"text_input": "x", "return_context_logits": True}, "return_context_logits", "=false is accepted"),
        ({"text_input": "x", "lora_task_id": 3}, "lora_task_id", "not supported by this server."),
    ],
)
def test_bad_shapes_and_types_are_invalid_argument(body, param, fragment):
    with pytest.raises(GatewayError) as info:
        _translate(body)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.http_status() == 400
    assert info.value.param == param
    assert fragment in info.value.message


def test_unknown_parameters_can_be_ignored_but_unsupported_ones_never():
    tr = _translate({"text_input": "hi", "foo": 1, "parameters": {"bar": "x", "top_k": 3}}, ignore_unknown=True)
    assert set(tr.ignored) == {"foo", "bar"}
    assert tr.request == _expected(sampling=pb.SamplingParams(top_k=3))
    with pytest.raises(GatewayError, match="lora_task_id"):
        _translate({"text_input": "hi", "lora_task_id": 1}, ignore_unknown=True)


# ----------------------------------------------------------------------------- URL target


SERVED = ServedModel(name="tiny", version="1", engine="hf")


@pytest.mark.parametrize(
    ("model", "version", "served_version", "code"),
    [
        ("tiny", None, "1", None),
        ("tiny", "1", "1", None),
        ("tiny", "01", "1", None),
        ("tiny", "3", "3", None),
        ("tiny", None, "v7-label", None),
        ("other", None, "1", grpc.StatusCode.NOT_FOUND),
        ("tiny", "2", "1", grpc.StatusCode.NOT_FOUND),
        ("tiny", "1", "v7-label", grpc.StatusCode.NOT_FOUND),
        ("tiny", "0", "1", grpc.StatusCode.INVALID_ARGUMENT),
        ("tiny", "abc", "1", grpc.StatusCode.INVALID_ARGUMENT),
        ("tiny", "-1", "1", grpc.StatusCode.INVALID_ARGUMENT),
        ("tiny", "1.0", "1", grpc.StatusCode.INVALID_ARGUMENT),
        ("tiny", "1" * 19, "1", grpc.StatusCode.INVALID_ARGUMENT),
        ("other", "x", "1", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_check_target(model, version, served_version, code):
    served = ServedModel(name="tiny", version=served_version, engine="hf")
    if code is None:
        translate.check_target(model, version, served)
        return
    with pytest.raises(GatewayError) as info:
        translate.check_target(model, version, served)
    assert info.value.code is code
    assert info.value.http_status() == (404 if code is grpc.StatusCode.NOT_FOUND else 400)


# ----------------------------------------------------------------------------- error messages


@pytest.mark.parametrize(
    ("param", "message", "names_from", "expected"),
    [
        (
            "stopping.max_new_tokens",
            "max_new_tokens must be in [1, 1024], got 5000.",
            {},
            "max_tokens: max_new_tokens must be in [1, 1024], got 5000.",
        ),
        (
            "stopping.max_new_tokens",
            "max_new_tokens must be in [1, 1024], got 5000.",
            {"max_new_tokens": 5000},
            "max_new_tokens must be in [1, 1024], got 5000.",
        ),
        (
            "stopping.min_new_tokens",
            "min_new_tokens (5) must not exceed max_new_tokens (2).",
            {"min_length": 5, "max_tokens": 2},
            "min_length: min_new_tokens (5) must not exceed max_new_tokens (2).",
        ),
        (
            "sampling.num_beams",
            "num_beams=2 asks for beam search; use num_beams=1.",
            {},
            "beam_width: num_beams=2 asks for beam search; use num_beams=1.",
        ),
        (
            "stopping.stop_token_ids",
            "stop token id 9999 is outside the vocabulary [0, 4096).",
            {},
            "end_id: stop token id 9999 is outside the vocabulary [0, 4096).",
        ),
        ("text", "The prompt text is empty.", {}, "text_input: The prompt text is empty."),
        (
            "sampling.temperature",
            "temperature must be in [0, inf), got -1.",
            {},
            "temperature must be in [0, inf), got -1.",
        ),
        (
            "stopping.stop",
            "At most 16 stop sequences are allowed, got 17.",
            {},
            "stop_words: At most 16 stop sequences are allowed, got 17.",
        ),
        (
            "stopping.stop",
            "At most 16 stop sequences are allowed, got 17.",
            {"stop": ["a"]},
            "stop: At most 16 stop sequences are allowed, got 17.",
        ),
        (None, "The server is at capacity.", {}, "The server is at capacity."),
        ("top_k", "Parameter 'top_k' must be an integer.", {}, "Parameter 'top_k' must be an integer."),
    ],
)
def test_client_message_speaks_of_the_clients_parameter(param, message, names_from, expected):
    names = _translate({"text_input": "hi", "parameters": names_from}).names
    err = GatewayError(grpc.StatusCode.INVALID_ARGUMENT, message, param=param)
    assert client_error(err, names).message == expected


def test_error_renderings():
    err = GatewayError(grpc.StatusCode.UNAVAILABLE, "The model server cannot be reached.")
    resp = errors.render_before_stream(err)
    assert resp.status == 503
    assert resp.content_type == "application/json"
    assert json.loads(resp.text) == {"error": "The model server cannot be reached."}
    bad = GatewayError(
        grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be in [1, 8], got 9.", param="stopping.max_new_tokens"
    )
    assert errors.render_in_stream(bad, translate.FIELDS.names()) == (
        b'data: {"error":"max_tokens: max_new_tokens must be in [1, 8], got 9."}\n\n'
    )


# ----------------------------------------------------------------------------- responses


def _token(token_id: int, logprob: float | None) -> pb.Token:
    t = pb.Token(id=token_id, text=f"<{token_id}>")
    if logprob is not None:
        t.logprob = logprob
    return t


def _stream(logprobs: bool, finish=pb.FINISH_REASON_EOS, echo: bool = True) -> list[spb.GenerateResponse]:
    lp = (lambda v: v) if logprobs else (lambda v: None)
    first = spb.GenerateResponse(request_id=RID, state=pb.GENERATE_STATE_QUEUED)
    if echo:
        first.prompt_text = "Hi"
    last = pb.SequenceOutput(
        index=0, text=" b", tokens=[_token(9, lp(-0.25)), _token(2, lp(-0.25))], finish_reason=finish
    )
    if logprobs:
        last.cumulative_logprob = -2.0
    return [
        first,
        spb.GenerateResponse(request_id=RID, state=pb.GENERATE_STATE_SCHEDULED),
        spb.GenerateResponse(request_id=RID, state=pb.GENERATE_STATE_PREFILLED),
        spb.GenerateResponse(
            request_id=RID,
            state=pb.GENERATE_STATE_GENERATING,
            outputs=[pb.SequenceOutput(index=0, text=" a", tokens=[_token(5, lp(-1.0))])],
        ),
        # text held back (e.g. a possible stop-string prefix): still an event, with its token
        spb.GenerateResponse(
            request_id=RID, outputs=[pb.SequenceOutput(index=0, text="", tokens=[_token(6, lp(-0.5))])]
        ),
        spb.GenerateResponse(request_id=RID, outputs=[last], usage=pb.Usage(prompt_tokens=2, completion_tokens=4)),
    ]


HEAD = {"model_name": "tiny", "model_version": "1"}


def test_stream_events_with_log_probs_and_echo():
    r = ResponseRenderer("tiny", "1", client_id="42", logprobs=True)
    events = [e for e in map(r.event, _stream(logprobs=True)) if e is not None]
    assert events == [
        {"id": "42", **HEAD, "text_output": "Hi a", "output_log_probs": [-1.0], "cum_log_probs": -1.0},
        {"id": "42", **HEAD, "text_output": "", "output_log_probs": [-0.5], "cum_log_probs": -1.5},
        {
            "id": "42",
            **HEAD,
            "text_output": " b",
            "output_log_probs": [-0.25, -0.25],
            "cum_log_probs": -2.0,
            "finish_reason": "stop",
        },
    ]
    assert list(events[0]) == ["id", "model_name", "model_version", "text_output", "output_log_probs", "cum_log_probs"]


def test_stream_events_without_id_or_log_probs():
    r = ResponseRenderer("tiny", "1")
    events = [e for e in map(r.event, _stream(logprobs=False, echo=False)) if e is not None]
    assert events == [
        {**HEAD, "text_output": " a"},
        {**HEAD, "text_output": ""},
        {**HEAD, "text_output": " b", "finish_reason": "stop"},
    ]


def test_single_response_concatenates_the_stream():
    r = ResponseRenderer("tiny", "1", client_id="", logprobs=True)
    assert r.response(_stream(logprobs=True)) == {
        "id": "",
        **HEAD,
        "text_output": "Hi a b",
        "output_log_probs": [-1.0, -0.5, -0.25, -0.25],
        "cum_log_probs": -2.0,
        "finish_reason": "stop",
    }
    plain = ResponseRenderer("tiny", "1").response(_stream(logprobs=False, finish=pb.FINISH_REASON_LENGTH, echo=False))
    assert plain == {**HEAD, "text_output": " a b", "finish_reason": "length"}


@pytest.mark.parametrize(
    ("reason", "name"),
    [
        (pb.FINISH_REASON_LENGTH, "length"),
        (pb.FINISH_REASON_EOS, "stop"),
        (pb.FINISH_REASON_STOP_SEQUENCE, "stop"),
        (pb.FINISH_REASON_TIME_LIMIT, "timeout"),
        (pb.FINISH_REASON_CANCELLED, "cancelled"),
        (pb.FINISH_REASON_ERROR, "error"),
    ],
)
def test_finish_reasons(reason, name):
    assert ResponseRenderer("tiny", "1").response(_stream(False, finish=reason))["finish_reason"] == name


# ----------------------------------------------------------------------------- metadata and flags


def test_model_and_server_metadata():
    meta = translate.model_metadata(SERVED)
    assert (meta["name"], meta["versions"], meta["platform"]) == ("tiny", ["1"], "trellis_hf")
    inputs = {t["name"]: t for t in meta["inputs"]}
    assert inputs["text_input"] == {"name": "text_input", "datatype": "BYTES", "shape": [-1]}
    assert inputs["max_tokens"] == {"name": "max_tokens", "datatype": "INT32", "shape": [1]}
    assert inputs["stop_words"]["shape"] == [-1]
    assert "seed" not in inputs  # aliases are not inputs of their own
    assert [t["name"] for t in meta["outputs"]] == ["text_output", "output_log_probs", "cum_log_probs", "finish_reason"]
    assert translate.server_metadata("0.1.0") == {"name": "trellis", "version": "0.1.0", "extensions": ["generate"]}


def test_flags_and_environment():
    cfg = load("triton", 8001, add_arguments, [])
    s = load_settings(cfg)
    assert (cfg.port, s.model_version, s.ignore_unknown_parameters) == (8001, None, False)
    env = {"TRELLIS_GATEWAY_MODEL_VERSION": "03", "TRELLIS_GATEWAY_IGNORE_UNKNOWN_PARAMETERS": "yes"}
    s = load_settings(load("triton", 8001, add_arguments, [], environ=env))
    assert (s.model_version, s.ignore_unknown_parameters) == ("3", True)
    argv = ["--model-version", "7", "--no-ignore-unknown-parameters"]
    s = load_settings(load("triton", 8001, add_arguments, argv, environ=env))
    assert (s.model_version, s.ignore_unknown_parameters) == ("7", False)
    with pytest.raises(SystemExit):
        load("triton", 8001, add_arguments, [], environ={"TRELLIS_GATEWAY_MODEL_VERSION": "v1"})
    with pytest.raises(SystemExit):
        load("triton", 8001, add_arguments, ["--model-version", "v1"], environ={})


def test_server_version_comes_from_the_installed_package(monkeypatch):
    config = GatewayConfig(name="triton")
    assert make_app(config)[SETTINGS_KEY].server_version == importlib.metadata.version("trellis")

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)  # a source checkout that is not installed
    assert make_app(config)[SETTINGS_KEY].server_version == "0.0.0"


# ----------------------------------------------------------------------------- guided decoding


@pytest.mark.parametrize(
    ("params", "guide"),
    [
        ({"guided_json": {"type": "object"}}, {"json_schema": '{"type": "object"}'}),
        ({"guided_json": '{"type": "integer"}'}, {"json_schema": '{"type": "integer"}'}),
        ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
        ({"guided_choice": ["yes", "no"]}, {"choice": {"choices": ["yes", "no"]}}),
        ({"guided_grammar": 'root ::= "a"'}, {"ebnf_grammar": 'root ::= "a"'}),
        ({"guided_decoding_guide_type": "json"}, {"json_object": True}),
        (
            {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": '{"type": "object"}'},
            {"json_schema": '{"type": "object"}'},
        ),
        ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "a+"}, {"regex": "a+"}),
        (
            {"guided_decoding_guide_type": "ebnf_grammar", "guided_decoding_guide": 'root ::= "a"'},
            {"ebnf_grammar": 'root ::= "a"'},
        ),
    ],
)
def test_guided_parameters_set_the_guide(params, guide):
    """vLLM's guided_* names and TensorRT-LLM's guided_decoding_guide_type / _guide."""
    req = _translate({"text_input": "x", "parameters": params}).request
    assert json_format.MessageToDict(req.guided_decoding, preserving_proto_field_name=True) == guide


@pytest.mark.parametrize(
    ("params", "param", "message"),
    [
        ({"guided_json": 3}, "guided_json", "must be a JSON Schema"),
        ({"guided_choice": "yes"}, "guided_choice", "must be an array of strings"),
        ({"guided_regex": ["a"]}, "guided_regex", "must be a string"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "Only one guided decoding parameter"),
        ({"guided_decoding_guide_type": "xml"}, "guided_decoding_guide_type", "must be one of json, json_schema"),
        ({"guided_decoding_guide_type": "regex"}, "guided_decoding_guide", "needs guided_decoding_guide"),
        ({"guided_decoding_guide": "a"}, "guided_decoding_guide_type", "needs guided_decoding_guide_type"),
        (
            {"guided_decoding_guide_type": "json", "guided_json": {}},
            "guided_decoding_guide_type",
            "either the guided_\\* parameters or guided_decoding_guide_type",
        ),
    ],
)
def test_guided_parameters_of_another_shape_are_refused(params, param, message):
    with pytest.raises(GatewayError, match=message) as e:
        _translate({"text_input": "x", "parameters": params})
    assert e.value.param == param


def test_a_refused_guide_is_named_as_the_client_sent_it():
    names = _translate({"text_input": "x", "guided_decoding_guide_type": "regex", "guided_decoding_guide": "["}).names
    assert names["guided_decoding.regex"] == "guided_decoding_guide"
    assert _translate({"text_input": "x", "guided_regex": "["}).names["guided_decoding.regex"] == "guided_regex"
