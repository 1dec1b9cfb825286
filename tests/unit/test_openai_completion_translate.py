"""Pure parts of `/v1/completions` (gateways/common/chat/completion_translate.py): request mapping,
choice numbering across prompts, echo, logprobs offsets, usage sums, and the errors of an
incomplete stream."""

from __future__ import annotations

import pytest
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.chat import completion_translate as t
from gateways.common.chat.completion_schema import parse_completion_request
from gateways.common.status import GatewayError


def state(**kw) -> t.CompletionState:
    return t.CompletionState(completion_id="cmpl-1", created=7, model="m", **kw)


def msg(*outputs: pb.SequenceOutput, usage: tuple[int, int] | None = None, prompt_text: str | None = None):
    m = spb.GenerateResponse(outputs=outputs)
    if usage:
        m.usage.prompt_tokens, m.usage.completion_tokens = usage
    if prompt_text is not None:
        m.prompt_text = prompt_text
    return m


def out(index: int, text: str, finish: int = 0, tokens: list[tuple[str, float]] = ()) -> pb.SequenceOutput:
    o = pb.SequenceOutput(index=index, text=text, finish_reason=finish)
    for tok_text, lp in tokens:
        o.tokens.add(text=tok_text, logprob=lp, bytes=tok_text.encode())
    return o


def test_requests_per_prompt_with_openai_defaults():
    req = parse_completion_request(
        {"prompt": [[4], [5, 6]], "logprobs": 3, "echo": False, "stop": "x", "temperature": 0, "best_of": 2}
    )
    first, second = t.to_generate_requests(req, completion_id="cmpl-9")
    assert (first.request_id, list(first.token_ids.ids), list(second.token_ids.ids)) == ("cmpl-9-0", [4], [5, 6])
    assert first.stopping.max_new_tokens == 16 and list(first.stopping.stop) == ["x"]
    assert first.output.logprobs and first.output.top_logprobs == 3 and not first.output.HasField("echo")
    assert first.sampling.do_sample is False and first.sampling.best_of == 2


def test_client_names():
    req = parse_completion_request({"prompt": "a", "max_tokens": 3})
    names = t.client_names(req)
    assert names["stopping.max_new_tokens"] == "max_tokens" and names["output.top_logprobs"] == "logprobs"
    assert t.client_names(None)["sampling.top_p"] == "top_p"


def test_chunks_number_choices_by_prompt_and_echo_leads():
    s = state(n=2)
    assert t.to_chunks(1, msg(prompt_text="Hi"), s) == []  # lifecycle only
    chunks = t.to_chunks(1, msg(out(1, " there"), out(0, "")), s)
    assert [c["choices"][0]["index"] for c in chunks] == [3, 2]
    assert chunks[0]["choices"][0]["text"] == "Hi there" and chunks[1]["choices"][0]["text"] == "Hi"
    last = t.to_chunks(1, msg(out(1, "!", pb.FINISH_REASON_EOS)), s)
    assert last[0]["choices"][0] == {"index": 3, "text": "!", "logprobs": None, "finish_reason": "stop"}
    assert last[0]["object"] == "text_completion" and "usage" not in last[0]


def test_logprobs_offsets_follow_the_text_and_echo():
    s = state(logprobs=2)
    t.to_chunks(0, msg(prompt_text="ab"), s)
    first = t.to_chunks(0, msg(out(0, "cd", tokens=[("c", -1.0), ("d", -2.0)])), s)[0]["choices"][0]
    assert first["text"] == "abcd" and first["logprobs"]["text_offset"] == [2, 3]
    nxt = t.to_chunks(0, msg(out(0, "e", tokens=[("e", -0.5)])), s)[0]["choices"][0]
    assert nxt["logprobs"] == {"tokens": ["e"], "token_logprobs": [-0.5], "top_logprobs": [{}], "text_offset": [4]}


def test_completion_merges_streams_and_sums_usage():
    s = state()
    streams = [
        [msg(out(0, "x")), msg(out(0, "y", pb.FINISH_REASON_LENGTH), usage=(3, 2))],
        [msg(out(0, "z", pb.FINISH_REASON_STOP_SEQUENCE), usage=(4, 1))],
    ]
    done = t.to_completion(streams, s)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in done["choices"]] == [
        (0, "xy", "length"),
        (1, "z", "stop"),
    ]
    assert done["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def test_cached_tokens_are_summed_over_the_prompts_and_left_out_when_none():
    s = state()
    cached = msg(out(0, "y", pb.FINISH_REASON_LENGTH), usage=(40, 2))
    cached.usage.cached_tokens = 32
    plain = msg(out(0, "z", pb.FINISH_REASON_LENGTH), usage=(4, 1))
    assert t.to_completion([[cached], [cached], [plain]], s)["usage"] == {
        "prompt_tokens": 84,
        "completion_tokens": 5,
        "total_tokens": 89,
        "prompt_tokens_details": {"cached_tokens": 64},
    }
    assert "prompt_tokens_details" not in t.to_completion([[plain]], state())["usage"]


def test_a_stream_without_its_final_message_is_an_error():
    with pytest.raises(GatewayError) as info:
        t.to_completion([[msg(out(0, "x"))]], state())
    assert info.value.reason == "INCOMPLETE_STREAM"
    s = state(include_usage=True)
    with pytest.raises(GatewayError):
        t.usage_chunk(s, 1)
    t.to_chunks(0, msg(out(0, "x", pb.FINISH_REASON_LENGTH), usage=(1, 1)), s)
    assert t.usage_chunk(s, 1) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 7,
        "model": "m",
        "choices": [],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def prompt_msg(*tokens: tuple[int, str, float | None, list[tuple[int, str, float]]]) -> spb.GenerateResponse:
    m = spb.GenerateResponse(state=pb.GENERATE_STATE_PREFILLED)
    for tid, text, lp, top in tokens:
        tok = m.prompt_tokens.add(id=tid, text=text)
        if lp is not None:
            tok.logprob = lp
        for aid, atext, alp in top:
            tok.top_logprobs.add(id=aid, text=atext, logprob=alp)
    return m


PROMPT_TOKENS = (
    (1, "The", None, []),
    (2, " cat", -1.5, [(9, " dog", -0.5), (2, " cat", -1.5)]),
    (3, " sat", -0.25, [(3, " sat", -0.25), (8, " ran", -2.0)]),
)


def test_echo_with_logprobs_leads_with_the_prompt_tokens():
    req = parse_completion_request({"prompt": "The cat sat", "echo": True, "logprobs": 1, "max_tokens": 2})
    (g,) = t.to_generate_requests(req, completion_id="c")
    assert g.output.prompt_logprobs == 1 and g.output.echo and g.stopping.max_new_tokens == 2
    s = t.state_for(req, completion_id="c", created=1, model="m")
    assert t.to_chunks(0, msg(prompt_text="The cat sat"), s) == []
    assert t.to_chunks(0, prompt_msg(*PROMPT_TOKENS), s) == []
    done = t.to_completion([[msg(out(0, " on", pb.FINISH_REASON_LENGTH, [(" on", -0.75)]), usage=(3, 1))]], s)
    lp = done["choices"][0]["logprobs"]
    assert done["choices"][0]["text"] == "The cat sat on"
    assert lp["tokens"] == ["The", " cat", " sat", " on"]
    assert lp["token_logprobs"] == [None, -1.5, -0.25, -0.75]
    assert lp["top_logprobs"] == [None, {" dog": -0.5}, {" sat": -0.25}, {}]
    assert lp["text_offset"] == [0, 3, 7, 11]
    assert "prompt_logprobs" not in done["choices"][0]


def test_max_tokens_zero_with_echo_scores_the_prompt_only():
    req = parse_completion_request({"prompt": "The cat sat", "echo": True, "logprobs": 0, "max_tokens": 0})
    (g,) = t.to_generate_requests(req, completion_id="c")
    assert g.stopping.max_new_tokens == 1 and g.output.prompt_logprobs == 0
    s = t.state_for(req, completion_id="c", created=1, model="m")
    stream = [
        msg(prompt_text="The cat sat"),
        prompt_msg(*PROMPT_TOKENS),
        msg(out(0, "!", pb.FINISH_REASON_EOS, [("!", -3.0)]), usage=(3, 1)),
    ]
    done = t.to_completion([stream], s)
    choice = done["choices"][0]
    assert choice["text"] == "The cat sat" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["The", " cat", " sat"]
    assert choice["logprobs"]["top_logprobs"] == [None, {}, {}]
    assert done["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}


def test_vllm_prompt_logprobs_per_choice():
    req = parse_completion_request({"prompt": "The cat sat", "prompt_logprobs": 2, "max_tokens": 1, "n": 2})
    (g,) = t.to_generate_requests(req, completion_id="c")
    assert g.output.prompt_logprobs == 2 and not g.output.HasField("echo")
    s = t.state_for(req, completion_id="c", created=1, model="m")
    stream = [prompt_msg(*PROMPT_TOKENS), msg(out(0, " on", 1), out(1, " in", 1), usage=(3, 2))]
    choices = t.to_completion([stream], s)["choices"]
    assert choices[0]["text"] == " on" and choices[0]["logprobs"] is None
    expected = [
        None,
        {
            "2": {"logprob": -1.5, "rank": 2, "decoded_token": " cat"},
            "9": {"logprob": -0.5, "rank": 1, "decoded_token": " dog"},
        },
        {
            "3": {"logprob": -0.25, "rank": 1, "decoded_token": " sat"},
            "8": {"logprob": -2.0, "rank": 2, "decoded_token": " ran"},
        },
    ]
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"] == expected
    one = t.state_for(
        parse_completion_request({"prompt": "x", "prompt_logprobs": 1}), completion_id="c", created=1, model="m"
    )
    stream = [prompt_msg(*PROMPT_TOKENS), msg(out(0, " on", 1), usage=(3, 1))]
    ranks = t.to_completion([stream], one)["choices"][0]["prompt_logprobs"][1]
    assert ranks == {
        "2": {"logprob": -1.5, "rank": None, "decoded_token": " cat"},
        "9": {"logprob": -0.5, "rank": 1, "decoded_token": " dog"},
    }


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_prompt_logprobs_errors(body, param):
    with pytest.raises(GatewayError) as info:
        parse_completion_request(body)
    assert info.value.param == param
