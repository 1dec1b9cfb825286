"""Table tests of the core's protobuf <-> core.types conversions (core/convert.py): unset
proto3 `optional` fields become None and None stays unset, every input kind, every enum
member."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from core import convert
from core.types import (
    ChatMessage,
    ContentPart,
    FinalInfo,
    FinishReason,
    GenerationRequest,
    OutputOptions,
    RequestState,
    ResolvedSampling,
    ResponseDelta,
    SamplingOptions,
    SequenceDelta,
    StoppingOptions,
    Timing,
    TokenInfo,
    TopToken,
    Usage,
)


def _request(text: str) -> spb.GenerateRequest:
    return text_format.Parse(text, spb.GenerateRequest())


def test_an_empty_request_leaves_everything_unset():
    got = convert.to_generation_request(spb.GenerateRequest(), "generated-id")
    assert got == GenerationRequest(request_id="generated-id")


def test_every_field_of_a_full_request():
    req = _request(
        """
        request_id: "client-id" model: "m" text: "hi" session_id: "s1"
        sampling {
          do_sample: true temperature: 0.5 top_k: 4 top_p: 0.75 min_p: 0.125 typical_p: 0.5
          repetition_penalty: 1.25 presence_penalty: 0.5 frequency_penalty: -0.5 length_penalty: 2
          early_stopping: true seed: 7 n: 2 best_of: 3 num_beams: 1
          logit_bias { key: 5 value: -1.5 } bad_words: "bad"
        }
        stopping {
          max_new_tokens: 9 min_new_tokens: 1 stop: ["a", "b"] stop_token_ids: [3, 4] ignore_eos: false
          include_stop_str_in_output: true time_limit_ms: 100 truncate_input_tokens: 8
        }
        output {
          logprobs: true top_logprobs: 2 prompt_logprobs: 0 echo: true skip_special_tokens: false
          spaces_between_special_tokens: true
        }
        """
    )
    assert convert.to_generation_request(req, "the-service-s-id") == GenerationRequest(
        request_id="the-service-s-id",
        model="m",
        text="hi",
        sampling=SamplingOptions(
            do_sample=True,
            temperature=0.5,
            top_k=4,
            top_p=0.75,
            min_p=0.125,
            typical_p=0.5,
            repetition_penalty=1.25,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            length_penalty=2.0,
            early_stopping=True,
            seed=7,
            n=2,
            best_of=3,
            num_beams=1,
        ),
        logit_bias={5: -1.5},
        bad_words=("bad",),
        stopping=StoppingOptions(
            max_new_tokens=9,
            min_new_tokens=1,
            stop=("a", "b"),
            stop_token_ids=(3, 4),
            ignore_eos=False,
            include_stop_str_in_output=True,
            time_limit_ms=100,
            truncate_input_tokens=8,
        ),
        output=OutputOptions(
            logprobs=True,
            top_logprobs=2,
            prompt_logprobs=0,
            echo=True,
            skip_special_tokens=False,
            spaces_between_special_tokens=True,
        ),
        session_id="s1",
    )


@pytest.mark.parametrize(
    ("text", "fields"),
    [
        ('text: ""', {"text": ""}),
        ("token_ids { ids: [1, 2] }", {"token_ids": (1, 2)}),
        ("token_ids {}", {"token_ids": ()}),
        ('model: ""', {}),  # an empty model is no model
        (
            'messages { messages { role: "user" name: "ann" content { text: "hi" }'
            ' content { image_url { url: "data:x" detail: "low" } } content {} } messages { role: "assistant" } }',
            {
                "messages": (
                    ChatMessage(
                        role="user",
                        content=(ContentPart(text="hi"), ContentPart(image_url="data:x")),
                        name="ann",
                    ),
                    ChatMessage(role="assistant"),
                )
            },
        ),
        ("messages {}", {"messages": ()}),
    ],
)
def test_inputs(text, fields):
    assert convert.to_generation_request(_request(text), "r") == GenerationRequest(request_id="r", **fields)


def test_resolved_sampling_leaves_none_unset():
    msg = convert.to_sampling_params(ResolvedSampling(do_sample=False, seed=3, temperature=0.0, num_beams=1))
    assert msg == pb.SamplingParams(do_sample=False, seed=3, temperature=0.0, num_beams=1)
    assert msg.HasField("temperature") and not msg.HasField("top_k")


def test_every_finish_reason_and_state_has_a_proto_value():
    assert set(convert.FINISH_REASONS) == set(FinishReason)
    assert set(convert.FINISH_REASONS.values()) == set(pb.FinishReason.values()) - {pb.FINISH_REASON_UNSPECIFIED}
    assert set(convert.STATES) == set(RequestState)
    assert set(convert.STATES.values()) == set(pb.GenerateState.values()) - {pb.GENERATE_STATE_UNSPECIFIED}


def test_a_lifecycle_delta():
    msg = convert.to_response(ResponseDelta(state=RequestState.QUEUED, prompt_text="echo"), "r")
    assert msg == text_format.Parse(
        'request_id: "r" state: GENERATE_STATE_QUEUED prompt_text: "echo"', spb.GenerateResponse()
    )


def test_a_full_final_delta():
    token = TokenInfo(
        id=5, text="a", bytes=b"a", special=False, logprob=-0.5, top=[TopToken(6, "b", b"b", -1.0, special=True)]
    )
    delta = ResponseDelta(
        state=RequestState.GENERATING,
        sequences=[
            SequenceDelta(index=0, text="a", tokens=[token], finish_reason=FinishReason.STOP_SEQUENCE, stop_token_id=9),
            SequenceDelta(index=1, text="", finish_reason=FinishReason.CANCELLED, cumulative_logprob=-2.5),
            SequenceDelta(index=2, stop_sequence="###", finish_reason=FinishReason.STOP_SEQUENCE),
        ],
        prompt_tokens=[TokenInfo(id=1, text="<s>", bytes=b"", special=True)],
        final=FinalInfo(
            usage=Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1),
            seed=42,
            effective=ResolvedSampling(do_sample=True, seed=42, temperature=0.7),
            timing=Timing(queue_ms=1.5, prefill_ms=2.5, total_ms=9.0),
        ),
        session_continued=True,
    )
    assert convert.to_response(delta, "r") == text_format.Parse(
        """
        request_id: "r" state: GENERATE_STATE_GENERATING session_continued: true
        prompt_tokens { id: 1 text: "<s>" special: true }
        outputs {
          index: 0 text: "a" finish_reason: FINISH_REASON_STOP_SEQUENCE stop_token_id: 9
          tokens { id: 5 text: "a" bytes: "a" logprob: -0.5
                   top_logprobs { id: 6 text: "b" bytes: "b" logprob: -1.0 special: true } }
        }
        outputs { index: 1 finish_reason: FINISH_REASON_CANCELLED cumulative_logprob: -2.5 }
        outputs { index: 2 stop_sequence: "###" finish_reason: FINISH_REASON_STOP_SEQUENCE }
        usage { prompt_tokens: 3 completion_tokens: 2 cached_tokens: 1 }
        seed: 42
        effective_sampling { do_sample: true seed: 42 temperature: 0.7 num_beams: 1 }
        timing { queue_ms: 1.5 prefill_ms: 2.5 total_ms: 9.0 }
        """,
        spb.GenerateResponse(),
    )


def test_a_token_without_a_logprob_leaves_it_unset():
    msg = convert.to_response(ResponseDelta(sequences=[SequenceDelta(0, "x", [TokenInfo(1, "x", b"x", False)])]), "r")
    assert not msg.outputs[0].tokens[0].HasField("logprob")
    assert not msg.outputs[0].HasField("stop_token_id") and not msg.outputs[0].HasField("cumulative_logprob")
    assert not msg.HasField("usage") and not msg.HasField("seed")


def test_chat_template_options_and_the_prompt_token_count():
    body = spb.GenerateRequest(
        messages=pb.ChatMessages(
            messages=[pb.ChatMessage(role="user")],
            add_generation_prompt=False,
            continue_final_message=True,
            template_kwargs='{"x": 1}',
        )
    )
    t = convert.to_generation_request(body, "r").template
    assert (t.add_generation_prompt, t.continue_final_message, t.kwargs) == (False, True, '{"x": 1}')
    plain = convert.to_generation_request(spb.GenerateRequest(messages=pb.ChatMessages()), "r").template
    assert plain.add_generation_prompt and not plain.continue_final_message and plain.kwargs == ""
    msg = convert.to_response(ResponseDelta(state=RequestState.QUEUED, prompt_token_count=7), "r")
    assert msg.prompt_token_count == 7
    assert not convert.to_response(ResponseDelta(), "r").HasField("prompt_token_count")
