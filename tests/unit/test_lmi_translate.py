"""LMI translation tables: GenerationParameters -> GenerateRequest, refusals, and Generate
messages -> LMI/TGI records (seed `lmi-input-output-schema.md`)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.status import GatewayError
from gateways.lmi.schema import GenerationParameters
from gateways.lmi.translate import (
    RenderOptions,
    StreamRenderer,
    client_names,
    collect_messages,
    dynamic_delta,
    dynamic_line,
    refuse_unsupported,
    render_dynamic,
    render_options,
    render_response,
    stop_sequences,
    to_generate_request,
)


def translate(params: dict[str, Any], *, stream: bool = False, tgi_compat: bool = False) -> dict[str, Any]:
    p = GenerationParameters.model_validate(params)
    opts = render_options("hi", p, stream=stream, tgi_compat=tgi_compat)
    req = to_generate_request("hi", p, opts, request_id="r1")
    return json_format.MessageToDict(req, preserving_proto_field_name=True)


BASE_STOPPING = {"max_new_tokens": 30}


@pytest.mark.parametrize(
    ("params", "sampling", "stopping", "output"),
    [
        ({}, None, BASE_STOPPING, None),
        ({"do_sample": True}, {"do_sample": True}, BASE_STOPPING, None),
        ({"do_sample": False}, {"do_sample": False}, BASE_STOPPING, None),
        ({"seed": 42}, {"seed": "42"}, BASE_STOPPING, None),
        ({"temperature": 0.7}, {"temperature": 0.7}, BASE_STOPPING, None),
        ({"repetition_penalty": 1.5}, {"repetition_penalty": 1.5}, BASE_STOPPING, None),
        ({"top_k": 5}, {"top_k": 5}, BASE_STOPPING, None),
        ({"top_k": 0}, {"top_k": 0}, BASE_STOPPING, None),
        ({"top_k": -1}, None, BASE_STOPPING, None),  # vLLM/LMI-Dist "disabled": leave unset
        ({"top_p": 0.5}, {"top_p": 0.5}, BASE_STOPPING, None),
        ({"top_p": 0}, None, BASE_STOPPING, None),  # TensorRT-LLM table's greedy default: leave unset
        ({"max_new_tokens": 7}, None, {"max_new_tokens": 7}, None),
        ({"details": True}, None, BASE_STOPPING, {"logprobs": True}),
        ({"return_full_text": True}, None, BASE_STOPPING, {"echo": True}),
        ({"stop_sequences": ["a", "b"]}, None, {**BASE_STOPPING, "stop": ["a", "b"]}, None),
        ({"stop_sequences": "a"}, None, {**BASE_STOPPING, "stop": ["a"]}, None),
        ({"stop": ["x"], "stop_sequences": ["a", "x"]}, None, {**BASE_STOPPING, "stop": ["a", "x"]}, None),
        ({"stop": False}, None, BASE_STOPPING, None),
        (
            {"decoder_input_details": True},
            None,
            BASE_STOPPING,
            {"logprobs": True, "prompt_logprobs": 0},
        ),
        ({"typical_p": 0.9}, {"typical_p": 0.9}, BASE_STOPPING, None),
        ({"truncate": 12}, None, {**BASE_STOPPING, "truncate_input_tokens": 12}, None),
        ({"ignore_eos_token": True}, None, {**BASE_STOPPING, "ignore_eos": True}, None),
        ({"min_p": 0.1}, {"min_p": 0.1}, BASE_STOPPING, None),
        ({"presence_penalty": 0.5}, {"presence_penalty": 0.5}, BASE_STOPPING, None),
        ({"frequency_penalty": -0.5}, {"frequency_penalty": -0.5}, BASE_STOPPING, None),
        ({"n": 3}, {"n": 3}, BASE_STOPPING, {"logprobs": True}),
        ({"best_of": 2}, {"n": 2}, BASE_STOPPING, {"logprobs": True}),
        ({"n": 2, "best_of": 4}, {"n": 4}, BASE_STOPPING, {"logprobs": True}),
        ({"n": 1}, {"n": 1}, BASE_STOPPING, None),
        # Out-of-range values reach the core as given, so its check names them.
        ({"n": 0}, {"n": 0}, BASE_STOPPING, None),
        ({"n": 2, "best_of": -1}, {"n": 2, "best_of": -1}, BASE_STOPPING, {"logprobs": True}),
        ({"top_n_tokens": 3, "logprobs": -1}, None, BASE_STOPPING, {"logprobs": True, "top_logprobs": -1}),
        (
            {"prompt_logprobs": -2, "decoder_input_details": True},
            None,
            BASE_STOPPING,
            {"logprobs": True, "prompt_logprobs": -2},
        ),
        ({"num_beams": 2}, {"num_beams": 2}, BASE_STOPPING, None),
        ({"length_penalty": 1.0}, {"length_penalty": 1.0}, BASE_STOPPING, None),
        ({"early_stopping": False}, {"early_stopping": False}, BASE_STOPPING, None),
        ({"stop_token_ids": [5, 9]}, None, {**BASE_STOPPING, "stop_token_ids": [5, 9]}, None),
        (
            {"include_stop_str_in_output": True},
            None,
            {**BASE_STOPPING, "include_stop_str_in_output": True},
            None,
        ),
        ({"logprobs": 3}, None, BASE_STOPPING, {"logprobs": True, "top_logprobs": 3}),
        ({"logprobs": 0}, None, BASE_STOPPING, {"logprobs": True, "top_logprobs": 0}),
        ({"prompt_logprobs": 2}, None, BASE_STOPPING, {"logprobs": True, "prompt_logprobs": 2}),
        (
            {"prompt_logprobs": 2, "decoder_input_details": True},
            None,
            BASE_STOPPING,
            {"logprobs": True, "prompt_logprobs": 2},
        ),
        ({"skip_special_tokens": False}, None, BASE_STOPPING, {"skip_special_tokens": False}),
        (
            {"spaces_between_special_tokens": False},
            None,
            BASE_STOPPING,
            {"spaces_between_special_tokens": False},
        ),
        ({"min_length": 4}, None, {**BASE_STOPPING, "min_new_tokens": 4}, None),
        ({"bad_sequences": ["foo", "bar"]}, {"bad_words": ["foo", "bar"]}, BASE_STOPPING, None),
        ({"top_n_tokens": 5}, None, BASE_STOPPING, {"logprobs": True, "top_logprobs": 5}),
        ({"top_n_tokens": 2, "logprobs": 4}, None, BASE_STOPPING, {"logprobs": True, "top_logprobs": 4}),
        ({"watermark": False, "grammar": None}, None, BASE_STOPPING, None),
    ],
)
def test_parameter_translation(params, sampling, stopping, output):
    got = translate(params)
    assert got["request_id"] == "r1"
    assert got["text"] == "hi"
    for name in ("temperature", "top_p", "typical_p", "min_p", "presence_penalty", "frequency_penalty"):  # float32
        if name in (sampling or {}):
            assert got["sampling"].pop(name) == pytest.approx(sampling.pop(name))
    assert got.get("sampling", {}) == (sampling or {})
    assert got.get("stopping", {}) == stopping
    assert got.get("output", {}) == (output or {})


@pytest.mark.parametrize(
    ("params", "stream", "tgi_compat", "output", "sampling"),
    [
        # Streamed token records always show log_prob.
        ({}, True, False, {"logprobs": True}, None),
        # TGI compatibility: details on by default; do_sample false means "not forced".
        ({"do_sample": False}, False, True, {"logprobs": True}, None),
        ({"do_sample": True}, False, True, {"logprobs": True}, {"do_sample": True}),
        ({"details": False}, False, True, None, None),
    ],
)
def test_translation_modes(params, stream, tgi_compat, output, sampling):
    got = translate(params, stream=stream, tgi_compat=tgi_compat)
    assert got.get("output", {}) == (output or {})
    assert got.get("sampling", {}) == (sampling or {})


def test_model_is_passed_for_predictions():
    p = GenerationParameters()
    opts = render_options("hi", p, stream=False, tgi_compat=False)
    req = to_generate_request("hi", p, opts, request_id="x", model="tiny")
    assert req.model == "tiny"


@pytest.mark.parametrize(
    ("params", "kwargs", "param"),
    [
        ({"stop": True}, {}, "parameters.stop"),
        ({"watermark": True}, {}, "parameters.watermark"),
        ({"n": 2}, {"stream": True}, "parameters.n"),
        ({"best_of": 2}, {"stream": True}, "parameters.best_of"),
        ({"details": True}, {"dynamic": True}, "parameters.details"),
        ({"decoder_input_details": True}, {"dynamic": True}, "parameters.decoder_input_details"),
        ({"prompt_logprobs": 0}, {"dynamic": True}, "parameters.prompt_logprobs"),
        ({"logprobs": 1}, {"dynamic": True}, "parameters.logprobs"),
        ({"top_n_tokens": 1}, {"dynamic": True}, "parameters.top_n_tokens"),
        ({"n": 2}, {"dynamic": True}, "parameters.n"),
    ],
)
def test_refusals(params, kwargs, param):
    p = GenerationParameters.model_validate(params)
    with pytest.raises(GatewayError) as e:
        refuse_unsupported(p, stream=kwargs.get("stream", False), dynamic=kwargs.get("dynamic", False))
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.param == param
    assert e.value.message.startswith(param + ":")


@pytest.mark.parametrize(
    "params",
    [{"stop": False}, {"watermark": False}, {"n": 1}, {"details": False}, {"best_of": 1}, {"n": 2}],
)
def test_no_refusal(params):
    refuse_unsupported(GenerationParameters.model_validate(params), stream=False)


@pytest.mark.parametrize(
    ("grammar", "guide"),
    [
        ({"type": "json", "value": {"type": "object"}}, {"json_schema": '{"type": "object"}'}),
        ({"type": "json", "value": '{"type": "integer"}'}, {"json_schema": '{"type": "integer"}'}),
        ({"type": "regex", "value": "[0-9]+"}, {"regex": "[0-9]+"}),
        ({"type": "json_object", "value": {"type": "object"}}, {"json_schema": '{"type": "object"}'}),
        (
            {"type": "json_schema", "value": {"name": "n", "schema": {"type": "object"}}},
            {"json_schema": '{"type": "object"}'},
        ),
    ],
)
def test_tgi_grammar_sets_the_guide(grammar, guide):
    """TGI's `grammar` parameter (text-generation-inference GrammarType: json, json_object,
    json_schema, regex)."""
    assert translate({"grammar": grammar})["guided_decoding"] == guide


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        (
            {"type": "xml", "value": "x"},
            'parameters.grammar.type must be "json", "json_object", "json_schema" or "regex"',
        ),
        ({"type": "json_schema", "value": {"name": "n"}}, "parameters.grammar.value must be an object with 'schema'"),
        (
            {"type": "json_schema", "value": {"schema": {}, "type": "x"}},
            r"got members \['schema', 'type'\]",
        ),
        ({"type": "json", "value": 3}, "parameters.grammar.value must be a JSON Schema"),
        ({"type": "regex", "value": {}}, "parameters.grammar.value must be a regular expression"),
        ({"type": "regex", "value": "a", "extra": 1}, "takes only 'type' and 'value'"),
    ],
)
def test_tgi_grammar_of_another_shape_is_refused(grammar, message):
    p = GenerationParameters.model_validate({"grammar": grammar})
    opts = render_options("hi", p, stream=False, tgi_compat=False)
    with pytest.raises(GatewayError, match=message) as e:
        to_generate_request("hi", p, opts, request_id="x")
    assert e.value.param == "parameters.grammar" and e.value.code is grpc.StatusCode.INVALID_ARGUMENT


def test_stop_sequences_and_given():
    p = GenerationParameters(stop_sequences=["a", "a", "b"], stop=["b", "c"], top_k=3, best_of=2)
    assert stop_sequences(p) == ["a", "b", "c"]
    names = client_names(p)
    assert (names["stopping.stop"], names["sampling.top_k"]) == ("parameters.stop_sequences", "parameters.top_k")
    assert (names["sampling.n"], names["text"]) == ("parameters.best_of", "inputs")


@pytest.mark.parametrize(
    ("params", "stream", "tgi_compat", "expected"),
    [
        ({}, False, False, {"details": False, "prefill": False, "num_sequences": 1}),
        ({"details": True}, False, False, {"details": True}),
        ({}, False, True, {"details": True, "tgi_compat": True}),
        ({"details": False}, False, True, {"details": False}),
        ({"decoder_input_details": True}, False, False, {"details": True, "prefill": True, "prefill_top": False}),
        ({"prompt_logprobs": 2}, False, False, {"details": True, "prefill": True, "prefill_top": True}),
        ({"n": 3}, False, False, {"details": True, "num_sequences": 3}),
        ({"best_of": 2, "n": 1}, False, False, {"details": True, "num_sequences": 2}),
        ({"top_n_tokens": 0}, False, False, {"top_tokens": False}),
        ({"top_n_tokens": 2}, False, False, {"top_tokens": True}),
        ({"logprobs": 1}, False, False, {"top_tokens": True}),
        ({"return_full_text": True}, True, False, {"full_text": True, "stream": True}),
    ],
)
def test_render_options(params, stream, tgi_compat, expected):
    opts = render_options("hi", GenerationParameters.model_validate(params), stream=stream, tgi_compat=tgi_compat)
    for name, value in expected.items():
        assert getattr(opts, name) == value, name


# ---------------------------------------------------------------------------- responses


def tok(id_: int, text: str, logprob: float | None = -0.5, special: bool = False, top=()) -> pb.Token:
    t = pb.Token(id=id_, text=text, special=special)
    if logprob is not None:
        t.logprob = logprob
    t.top_logprobs.extend(pb.TopLogprob(id=i, text=s, logprob=lp) for i, s, lp in top)
    return t


def out(index=0, text="", tokens=(), finish=0, cumulative=None) -> pb.SequenceOutput:
    o = pb.SequenceOutput(index=index, text=text, tokens=list(tokens), finish_reason=finish)
    if cumulative is not None:
        o.cumulative_logprob = cumulative
    return o


def msg(*outputs, final=False, seed=None, do_sample=False, prompt_text=None, prompt_tokens=()) -> spb.GenerateResponse:
    m = spb.GenerateResponse(request_id="r", outputs=list(outputs), prompt_tokens=list(prompt_tokens))
    if prompt_text is not None:
        m.prompt_text = prompt_text
    if final:
        m.usage.completion_tokens = 1
        m.seed = seed if seed is not None else 7
        m.effective_sampling.do_sample = do_sample
    return m


QUEUED = spb.GenerateResponse(request_id="r", state=pb.GENERATE_STATE_QUEUED)


@pytest.mark.parametrize(
    ("core", "lmi"),
    [
        (pb.FINISH_REASON_LENGTH, "length"),
        (pb.FINISH_REASON_EOS, "eos_token"),
        (pb.FINISH_REASON_STOP_SEQUENCE, "stop_sequence"),
        (pb.FINISH_REASON_TIME_LIMIT, "length"),
    ],
)
def test_finish_reasons(core, lmi):
    c = collect_messages([QUEUED, msg(out(text="a", tokens=[tok(5, "a")], finish=core), final=True)])
    body = render_response(c, RenderOptions(inputs="hi", details=True))
    assert body["details"]["finish_reason"] == lmi


@pytest.mark.parametrize(
    ("finish", "code"),
    [(pb.FINISH_REASON_CANCELLED, grpc.StatusCode.UNAVAILABLE), (pb.FINISH_REASON_ERROR, grpc.StatusCode.INTERNAL)],
)
def test_unfinished_sequences_are_errors(finish, code):
    messages = [QUEUED, msg(out(text="a", tokens=[tok(5, "a")], finish=finish), final=True)]
    with pytest.raises(GatewayError) as e:
        collect_messages(messages)
    assert e.value.code is code
    with pytest.raises(GatewayError):
        renderer = StreamRenderer(RenderOptions(inputs="hi", stream=True))
        for m in messages:
            renderer.feed(m)
    with pytest.raises(GatewayError):
        dynamic_delta(messages[1])


STREAM = [
    QUEUED,
    msg(out(text="Deep", tokens=[tok(304, "Deep", -0.05)])),
    # Two tokens in one message, text held back and released with the second.
    msg(out(text=" Learning", tokens=[tok(11, " Lear", -1.25), tok(12, "ning", -0.25)])),
    msg(out(text=" is", tokens=[tok(278, " is", -0.5)], finish=pb.FINISH_REASON_LENGTH), final=True),
]


def test_stream_records_lmi():
    renderer = StreamRenderer(RenderOptions(inputs="What is Deep Learning?", stream=True, details=True))
    records = [r for m in STREAM for r in renderer.feed(m)]
    assert records == [
        {"token": {"id": 304, "text": "Deep", "log_prob": pytest.approx(-0.05)}},
        {"token": {"id": 11, "text": "", "log_prob": -1.25}},
        {"token": {"id": 12, "text": " Learning", "log_prob": -0.25}},
        {
            "token": {"id": 278, "text": " is", "log_prob": -0.5},
            "generated_text": "Deep Learning is",
            "details": {"finish_reason": "length", "generated_tokens": 4, "inputs": "What is Deep Learning?"},
        },
    ]


def test_stream_records_tgi_with_seed_prefill_and_top_tokens():
    opts = RenderOptions(inputs="q", stream=True, tgi_compat=True, details=True, prefill=True, top_tokens=True)
    messages = [
        msg(prompt_tokens=[tok(1, "<s>", None, special=True), tok(9, "q", -3.0)]),
        msg(out(text="a", tokens=[tok(5, "a", -0.5, top=[(5, "a", -0.5), (6, "b", -1.0)])])),
        msg(
            out(text="", tokens=[tok(2, "</s>", -0.1, special=True)], finish=pb.FINISH_REASON_EOS),
            final=True,
            seed=11,
            do_sample=True,
        ),
    ]
    renderer = StreamRenderer(opts)
    records = [r for m in messages for r in renderer.feed(m)]
    assert records[0] == {
        "token": {"id": 5, "text": "a", "logprob": -0.5, "special": False},
        "top_tokens": [
            {"id": 5, "text": "a", "logprob": -0.5, "special": False},
            {"id": 6, "text": "b", "logprob": -1.0, "special": False},
        ],
    }
    last = records[1]
    assert last["token"] == {"id": 2, "text": "", "logprob": pytest.approx(-0.1), "special": True}
    assert last["generated_text"] == "a"
    assert last["details"] == {
        "finish_reason": "eos_token",
        "generated_tokens": 2,
        "inputs": "q",
        "seed": 11,
        "prefill": [
            {"id": 1, "text": "<s>", "logprob": None},
            {"id": 9, "text": "q", "logprob": -3.0},
        ],
    }


def test_stream_special_token_flag_and_full_text():
    opts = RenderOptions(inputs="q", stream=True, full_text=True)
    messages = [
        msg(prompt_text="Hello"),
        msg(out(text=" there", tokens=[tok(7, " there")])),
        msg(out(text="", tokens=[tok(2, "<|eos|>", special=True)], finish=pb.FINISH_REASON_EOS), final=True),
    ]
    renderer = StreamRenderer(opts)
    records = [r for m in messages for r in renderer.feed(m)]
    assert records[-1] == {
        "token": {"id": 2, "text": "", "log_prob": -0.5, "special_token": True},
        "generated_text": "Hello there",
    }


def test_stream_text_without_token_is_carried_to_the_next_record():
    renderer = StreamRenderer(RenderOptions(inputs="q", stream=True))
    records = renderer.feed(msg(out(text="ab", tokens=[])))
    assert records == []
    records = renderer.feed(msg(out(text="c", tokens=[tok(3, "c")], finish=pb.FINISH_REASON_LENGTH), final=True))
    assert records == [{"token": {"id": 3, "text": "abc", "log_prob": -0.5}, "generated_text": "abc"}]


def test_stream_final_message_without_token_still_ends_with_a_record():
    renderer = StreamRenderer(RenderOptions(inputs="q", stream=True, details=True))
    renderer.feed(msg(out(text="a", tokens=[tok(3, "a")])))
    records = renderer.feed(msg(out(text="b", finish=pb.FINISH_REASON_LENGTH), final=True))
    assert records == [
        {
            "token": {"id": -1, "text": "b", "log_prob": None, "special_token": True},
            "generated_text": "ab",
            "details": {"finish_reason": "length", "generated_tokens": 1, "inputs": "q"},
        }
    ]


def test_response_without_details():
    c = collect_messages(STREAM)
    assert render_response(c, RenderOptions(inputs="q")) == {"generated_text": "Deep Learning is"}


def test_response_with_details_prefill_and_top_tokens():
    messages = [
        msg(
            prompt_text="What",
            prompt_tokens=[tok(1, "<s>", None, special=True), tok(9, "What", -3.0, top=[(4, "x", -1.0)])],
        ),
        *STREAM[1:],
    ]
    opts = RenderOptions(inputs="What", details=True, prefill=True, prefill_top=True, top_tokens=True, full_text=True)
    body = render_response(collect_messages(messages), opts)
    assert body["generated_text"] == "WhatDeep Learning is"
    details = body["details"]
    assert list(details) == ["finish_reason", "generated_tokens", "inputs", "tokens", "prefill", "top_tokens"]
    assert [t["text"] for t in details["tokens"]] == ["Deep", "", " Learning", " is"]
    assert details["generated_tokens"] == 4
    assert details["prefill"] == [
        {"id": 1, "text": "<s>", "log_prob": None, "top_tokens": []},
        {"id": 9, "text": "What", "log_prob": -3.0, "top_tokens": [{"id": 4, "text": "x", "log_prob": -1.0}]},
    ]
    assert details["top_tokens"] == [[], [], [], []]


def test_best_of_ranks_by_cumulative_logprob():
    messages = [
        QUEUED,
        msg(
            out(0, "zero", [tok(1, "zero", -2.0)], pb.FINISH_REASON_LENGTH, cumulative=-2.0),
            out(1, "one", [tok(2, "one", -0.5)], pb.FINISH_REASON_EOS, cumulative=-0.5),
            out(2, "two", [tok(3, "two", -1.0)], pb.FINISH_REASON_STOP_SEQUENCE, cumulative=-1.0),
            final=True,
        ),
    ]
    body = render_response(collect_messages(messages), RenderOptions(inputs="q", details=True, num_sequences=3))
    assert body["generated_text"] == "one"
    assert body["details"]["finish_reason"] == "eos_token"
    assert body["details"]["best_of_sequences"] == [
        {
            "generated_text": "two",
            "finish_reason": "stop_sequence",
            "generated_tokens": 1,
            "tokens": [{"id": 3, "text": "two", "log_prob": -1.0}],
        },
        {
            "generated_text": "zero",
            "finish_reason": "length",
            "generated_tokens": 1,
            "tokens": [{"id": 1, "text": "zero", "log_prob": -2.0}],
        },
    ]


def test_tgi_response_is_an_array_with_prefill_and_seed():
    messages = [*STREAM[:-1], msg(*STREAM[-1].outputs, final=True, seed=3, do_sample=False)]
    body = render_response(collect_messages(messages), RenderOptions(inputs="q", tgi_compat=True, details=True))
    assert isinstance(body, list) and len(body) == 1
    details = body[0]["details"]
    assert details["prefill"] == [] and details["seed"] is None  # TGI reports a seed only when sampling
    assert details["tokens"][0] == {"id": 304, "text": "Deep", "logprob": pytest.approx(-0.05), "special": False}


def test_dynamic_helpers():
    assert dynamic_delta(msg(out(text="a", tokens=[tok(1, "a")]), prompt_text="P: ")) == "P: a"
    assert dynamic_delta(QUEUED) == ""
    assert dynamic_line(["a", ""]) == {"outputs": ["a", ""]}
    results = [collect_messages(STREAM), collect_messages([msg(prompt_text="P"), *STREAM[1:]])]
    assert render_dynamic(results, full_text=False) == [
        {"generated_text": "Deep Learning is"},
        {"generated_text": "Deep Learning is"},
    ]
    assert render_dynamic(results, full_text=True)[1] == {"generated_text": "PDeep Learning is"}
