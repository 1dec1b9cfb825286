"""Table tests of the chat completions translation (gateways/common/chat/translate.py)."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import text_format
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.chat import translate
from gateways.common.chat.schema import parse_chat_request
from gateways.common.status import GatewayError
from gateways.lmi.translate import FINISH_REASONS as LMI_FINISH_REASONS

USER = [{"role": "user", "content": "hi"}]
USER_PB = 'messages { messages { role: "user" content { text: "hi" } } }'

REQUESTS = [
    # (id, body, expected GenerateRequest in proto text, request_id "r")
    ("defaults_sample", {"messages": USER}, f"{USER_PB} sampling {{ do_sample: true }} stopping {{}} output {{}}"),
    (
        "temperature_zero_is_greedy",
        {"messages": USER, "temperature": 0},
        f"{USER_PB} sampling {{ do_sample: false temperature: 0 }} stopping {{}} output {{}}",
    ),
    (
        "temperature_set_samples",
        {"messages": USER, "temperature": 0.7, "top_p": 0.9},
        f"{USER_PB} sampling {{ do_sample: true temperature: 0.7 top_p: 0.9 }} stopping {{}} output {{}}",
    ),
    (
        "penalties_seed_n",
        {"messages": USER, "presence_penalty": 0.5, "frequency_penalty": -1, "seed": 42, "n": 3},
        f"{USER_PB} sampling {{ do_sample: true presence_penalty: 0.5 frequency_penalty: -1 seed: 42 n: 3 }} "
        "stopping {} output {}",
    ),
    (
        "logit_bias_keys_become_ids",
        {"messages": USER, "logit_bias": {"2435": -100, "640": 50.5}},
        f"{USER_PB} sampling {{ do_sample: true logit_bias {{ key: 2435 value: -100 }} "
        "logit_bias { key: 640 value: 50.5 } } stopping {} output {}",
    ),
    (
        "max_tokens",
        {"messages": USER, "max_tokens": 12},
        f"{USER_PB} sampling {{ do_sample: true }} stopping {{ max_new_tokens: 12 }} output {{}}",
    ),
    (
        "max_completion_tokens_wins",
        {"messages": USER, "max_tokens": 12, "max_completion_tokens": 5},
        f"{USER_PB} sampling {{ do_sample: true }} stopping {{ max_new_tokens: 5 }} output {{}}",
    ),
    (
        "stop_string",
        {"messages": USER, "stop": "END"},
        f'{USER_PB} sampling {{ do_sample: true }} stopping {{ stop: "END" }} output {{}}',
    ),
    (
        "stop_list_ignore_eos",
        {"messages": USER, "stop": ["a", "b"], "ignore_eos": True},
        f'{USER_PB} sampling {{ do_sample: true }} stopping {{ stop: "a" stop: "b" ignore_eos: true }} output {{}}',
    ),
    (
        "logprobs",
        {"messages": USER, "logprobs": True, "top_logprobs": 2},
        f"{USER_PB} sampling {{ do_sample: true }} stopping {{}} output {{ logprobs: true top_logprobs: 2 }}",
    ),
    (
        "top_logprobs_alone_is_passed_on",
        {"messages": USER, "top_logprobs": 2},
        f"{USER_PB} sampling {{ do_sample: true }} stopping {{}} output {{ top_logprobs: 2 }}",
    ),
    (
        "model_and_user",
        {"messages": USER, "model": "tiny", "user": "someone"},
        f'model: "tiny" {USER_PB} sampling {{ do_sample: true }} stopping {{}} output {{}}',
    ),
    (
        "roles_names_parts",
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "name": "ann",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "high"}},
                    ],
                },
                {"role": "assistant", "content": None},
            ]
        },
        "messages { "
        'messages { role: "system" content { text: "be brief" } } '
        'messages { role: "user" name: "ann" content { text: "look" } '
        'content { image_url { url: "data:image/png;base64,AA" detail: "high" } } } '
        'messages { role: "assistant" } } '
        "sampling { do_sample: true } stopping {} output {}",
    ),
]


@pytest.mark.parametrize("raw, expected", [c[1:] for c in REQUESTS], ids=[c[0] for c in REQUESTS])
def test_to_generate_request(raw, expected):
    got = translate.to_generate_request(parse_chat_request(raw), request_id="r")
    want = text_format.Parse(f'request_id: "r" {expected}', spb.GenerateRequest())
    assert got == want, text_format.MessageToString(got)


PARAMS = [
    # (core path, request fields, OpenAI param)
    ("sampling.temperature", {}, "temperature"),
    ("sampling.do_sample", {}, "temperature"),
    ("sampling.top_p", {}, "top_p"),
    ("sampling.presence_penalty", {}, "presence_penalty"),
    ("sampling.frequency_penalty", {}, "frequency_penalty"),
    ("sampling.logit_bias", {}, "logit_bias"),
    ("sampling.seed", {}, "seed"),
    ("sampling.n", {}, "n"),
    ("stopping.stop", {}, "stop"),
    ("stopping.ignore_eos", {}, "ignore_eos"),
    ("stopping.max_new_tokens", {}, "max_tokens"),
    ("stopping.max_new_tokens", {"max_tokens": 5}, "max_tokens"),
    ("stopping.max_new_tokens", {"max_completion_tokens": 5}, "max_completion_tokens"),
    ("output.logprobs", {}, "logprobs"),
    ("output.top_logprobs", {}, "top_logprobs"),
    ("model", {}, "model"),
    ("messages", {}, "messages"),
    ("text", {}, "messages"),
    ("messages[2].content", {}, "messages[2].content"),
    ("sampling.top_k", {}, "top_k"),
    ("stopping.min_new_tokens", {}, "min_tokens"),
    ("stopping.truncate_input_tokens", {}, "truncate_prompt_tokens"),
    ("guided_decoding.regex", {}, "guided_regex"),
    ("messages.template_kwargs", {}, "chat_template_kwargs"),
    ("messages.continue_final_message", {}, "continue_final_message"),
    ("sampling.typical_p", {}, "sampling.typical_p"),
    (None, {}, None),
]


def _openai_param(path, req):
    return translate.client_names(req).get(path, path)


@pytest.mark.parametrize("path, fields, param", PARAMS)
def test_openai_names_of_core_fields(path, fields, param):
    req = parse_chat_request({"messages": USER, **fields})
    assert _openai_param(path, req) == param


def test_openai_names_without_request():
    assert _openai_param("stopping.max_new_tokens", None) == "max_tokens"


FINISH = [
    # (core reason, OpenAI's word, LMI's word or the error it is)
    (pb.FINISH_REASON_UNSPECIFIED, None, None),
    (pb.FINISH_REASON_LENGTH, "length", "length"),
    (pb.FINISH_REASON_EOS, "stop", "eos_token"),
    (pb.FINISH_REASON_STOP_SEQUENCE, "stop", "stop_sequence"),
    (pb.FINISH_REASON_TIME_LIMIT, "length", "length"),
    (pb.FINISH_REASON_CANCELLED, "abort", grpc.StatusCode.UNAVAILABLE),
    (pb.FINISH_REASON_ERROR, "error", grpc.StatusCode.INTERNAL),
]


def _finish_chunk(reason, words):
    msg = spb.GenerateResponse(outputs=[pb.SequenceOutput(index=0, text="x", finish_reason=reason)])
    return translate.to_chunks(msg, _state(finish_words=words))[0]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("reason, openai, lmi", FINISH)
def test_finish_reasons(reason, openai, lmi):
    assert _finish_chunk(reason, translate.FINISH_REASONS) == openai
    if isinstance(lmi, grpc.StatusCode):
        # LMI's words are the seed's enum: a request the core cancelled or failed is an error.
        with pytest.raises(GatewayError) as info:
            _finish_chunk(reason, LMI_FINISH_REASONS)
        assert info.value.code is lmi
    else:
        assert _finish_chunk(reason, LMI_FINISH_REASONS) == lmi


def test_every_proto_finish_reason_has_an_openai_word():
    assert set(translate.FINISH_REASONS) == set(pb.FinishReason.values()) - {pb.FINISH_REASON_UNSPECIFIED}


def _msg(text: str) -> spb.GenerateResponse:
    return text_format.Parse(text, spb.GenerateResponse())


def _token(id_, text, logprob, top=()):
    t = f'tokens {{ id: {id_} text: "{text}" bytes: "{text}" logprob: {logprob} '
    t += " ".join(f'top_logprobs {{ id: {i} text: "{x}" bytes: "{x}" logprob: {lp} }}' for i, x, lp in top)
    return t + " }"


LOGPROBS = [
    (
        "plain",
        f'index: 0 text: "ab" {_token(5, "a", -0.5, [(5, "a", -0.5), (6, "c", -1.5)])} {_token(7, "b", -1)}',
        [
            {
                "token": "a",
                "logprob": -0.5,
                "bytes": [97],
                "top_logprobs": [
                    {"token": "a", "logprob": -0.5, "bytes": [97]},
                    {"token": "c", "logprob": -1.5, "bytes": [99]},
                ],
            },
            {"token": "b", "logprob": -1.0, "bytes": [98], "top_logprobs": []},
        ],
    ),
    (
        "eos_token_left_out",
        f'index: 0 text: "a" {_token(5, "a", -0.5)} {_token(2, "<|eos|>", -2)} finish_reason: FINISH_REASON_EOS',
        [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}],
    ),
    (
        "stop_token_left_out",
        f'index: 0 text: "" {_token(9, "x", -0.25)} finish_reason: FINISH_REASON_STOP_SEQUENCE stop_token_id: 9',
        [],
    ),
    (
        "stop_string_token_kept",
        f'index: 0 text: "" {_token(9, "x", -0.25)} finish_reason: FINISH_REASON_STOP_SEQUENCE stop_sequence: "x"',
        [{"token": "x", "logprob": -0.25, "bytes": [120], "top_logprobs": []}],
    ),
]


@pytest.mark.parametrize("out, expected", [c[1:] for c in LOGPROBS], ids=[c[0] for c in LOGPROBS])
def test_logprobs_content(out, expected):
    assert translate.logprobs_content(text_format.Parse(out, pb.SequenceOutput())) == expected


def test_logprobs_keep_raw_utf8_fragments():
    out = pb.SequenceOutput(
        index=0,
        text="é",
        tokens=[
            pb.Token(id=1, text="\ufffd", bytes=b"\xc3", logprob=-1.0),
            pb.Token(id=2, text="\ufffd", bytes=b"\xa9", logprob=-2.0),
        ],
    )
    entries = translate.logprobs_content(out)
    assert bytes(b for e in entries for b in e["bytes"]).decode() == "é"


STREAM = [
    "state: GENERATE_STATE_QUEUED",
    "state: GENERATE_STATE_SCHEDULED",
    "state: GENERATE_STATE_PREFILLED",
    f'state: GENERATE_STATE_GENERATING outputs {{ index: 0 text: "He" {_token(10, "He", -0.1)} }} '
    f'outputs {{ index: 1 text: "" {_token(11, "W", -0.2)} }}',
    f'outputs {{ index: 1 text: "Wo" {_token(12, "o", -0.3)} }}',
    f'outputs {{ index: 0 text: "llo" {_token(13, "llo", -0.4)} finish_reason: FINISH_REASON_LENGTH }}',
    f'outputs {{ index: 1 text: "" {_token(2, "<|eos|>", -0.5)} finish_reason: FINISH_REASON_EOS }} '
    "usage { prompt_tokens: 4 completion_tokens: 5 } seed: 7",
]


def _state(**kw):
    args = dict(completion_id="chatcmpl-1", created=1700000000, model="tiny")
    args.update(kw)
    return translate.StreamState(**args)


def _chunk(index, delta, finish=None, logprobs=None, usage=False):
    c = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "tiny",
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
    }
    if usage:
        c["usage"] = None
    return c


def test_to_chunks_role_first_finish_last_per_choice():
    state = _state(finish_words=LMI_FINISH_REASONS)
    chunks = [c for m in STREAM for c in translate.to_chunks(_msg(m), state)]
    assert chunks == [
        _chunk(0, {"role": "assistant", "content": "He"}),
        _chunk(1, {"role": "assistant", "content": "Wo"}),
        _chunk(0, {"content": "llo"}, "length"),
        _chunk(1, {}, "eos_token"),
    ]
    assert state.usage == pb.Usage(prompt_tokens=4, completion_tokens=5)


def test_to_chunks_with_logprobs_sends_token_only_deltas():
    state = _state(logprobs=True)
    chunks = [c for m in STREAM for c in translate.to_chunks(_msg(m), state)]
    lp = lambda t, v: {"content": [{"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}]}  # noqa: E731
    assert [c["choices"][0] for c in chunks] == [
        _chunk(0, {"role": "assistant", "content": "He"}, None, lp("He", pytest.approx(-0.1)))["choices"][0],
        _chunk(1, {"role": "assistant", "content": ""}, None, lp("W", pytest.approx(-0.2)))["choices"][0],
        _chunk(1, {"content": "Wo"}, None, lp("o", pytest.approx(-0.3)))["choices"][0],
        _chunk(0, {"content": "llo"}, "length", lp("llo", pytest.approx(-0.4)))["choices"][0],
        _chunk(1, {}, "stop", {"content": []})["choices"][0],
    ]


def test_include_usage_chunks():
    state = _state(include_usage=True)
    chunks = [c for m in STREAM for c in translate.to_chunks(_msg(m), state)]
    assert all(c["usage"] is None for c in chunks)
    assert translate.usage_chunk(state) == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "tiny",
        "choices": [],
        "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9},
    }


def test_usage_reports_cached_prompt_tokens_only_when_some():
    assert translate.usage_dict(pb.Usage(prompt_tokens=40, completion_tokens=2, cached_tokens=32)) == {
        "prompt_tokens": 40,
        "completion_tokens": 2,
        "total_tokens": 42,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    assert translate.usage_dict(pb.Usage(prompt_tokens=4, completion_tokens=2)) == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
    }


def test_empty_output_still_sends_role():
    state = _state()
    chunks = translate.to_chunks(_msg("outputs { index: 0 finish_reason: FINISH_REASON_EOS } usage {}"), state)
    assert chunks == [_chunk(0, {"role": "assistant", "content": ""}, "stop")]


def test_to_completion():
    state = _state()
    got = translate.to_completion([_msg(m) for m in STREAM], state)
    assert got == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello"},
                "logprobs": None,
                "finish_reason": "length",
            },
            {"index": 1, "message": {"role": "assistant", "content": "Wo"}, "logprobs": None, "finish_reason": "stop"},
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9},
    }


def test_to_completion_logprobs():
    got = translate.to_completion([_msg(m) for m in STREAM], _state(logprobs=True, finish_words=LMI_FINISH_REASONS))
    assert [t["token"] for t in got["choices"][0]["logprobs"]["content"]] == ["He", "llo"]
    assert [t["token"] for t in got["choices"][1]["logprobs"]["content"]] == ["W", "o"]
    assert [c["finish_reason"] for c in got["choices"]] == ["length", "eos_token"]


def test_state_for_takes_options_from_the_request():
    req = parse_chat_request(
        {"messages": USER, "logprobs": True, "stream": True, "stream_options": {"include_usage": True}}
    )
    state = translate.state_for(req, completion_id="chatcmpl-9", created=5, model="m", finish_words=LMI_FINISH_REASONS)
    assert (state.logprobs, state.include_usage, state.finish_words) == (True, True, LMI_FINISH_REASONS)
    plain = translate.state_for(parse_chat_request({"messages": USER}), completion_id="c", created=5, model="m")
    assert (plain.logprobs, plain.include_usage, plain.finish_words) == (False, False, translate.FINISH_REASONS)
