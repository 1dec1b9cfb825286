"""Every range and cross-field rule of core.validation: the error type, the field path, a sentence."""

from __future__ import annotations

import dataclasses

import pytest

from core.errors import ContextLengthExceeded, InvalidArgument, ModelNotFound
from core.guided import MAX_CHOICES, MAX_GUIDE_CHARS, check_compiles
from core.sampling import resolve_generic
from core.types import (
    ChatMessage,
    ChatTemplateOptions,
    ContentPart,
    EngineInfo,
    GenerationRequest,
    Guide,
    OutputOptions,
    SamplingOptions,
    StoppingOptions,
    Tool,
    ToolCall,
)
from core.validation import MAX_TOOLS, Limits, resolve_max_new_tokens, validate_engine_support, validate_request

INFO = EngineInfo(engine="hf", max_context_length=100, vocab_size=50, max_num_beams=1, max_n=8)
LIMITS = Limits(served_model="tiny", engine=INFO, max_new_tokens=100, max_stop_sequences=4, max_n=8)


def req(**kw) -> GenerationRequest:
    base = dict(request_id="r", text="hello")
    base.update(kw)
    return GenerationRequest(**base)


S = SamplingOptions
T = StoppingOptions
O = OutputOptions  # noqa: E741

BAD = [
    (req(model="other"), ModelNotFound, "model"),
    (req(text=None), InvalidArgument, "text"),
    (req(text=""), InvalidArgument, "text"),
    (req(text=None, token_ids=()), InvalidArgument, "token_ids"),
    (req(text=None, token_ids=(1, 50)), InvalidArgument, "token_ids"),
    (req(text=None, token_ids=(-1,)), InvalidArgument, "token_ids"),
    (req(text=None, messages=()), InvalidArgument, "messages"),
    (
        req(text=None, messages=(ChatMessage(role="", content=(ContentPart(text="x"),)),)),
        InvalidArgument,
        "messages[0].role",
    ),
    (
        req(text=None, messages=(ChatMessage(role="user", content=(ContentPart(image_url="http://x/y.png"),)),)),
        InvalidArgument,
        "messages[0].content",
    ),
    (req(sampling=S(temperature=-0.1)), InvalidArgument, "sampling.temperature"),
    (req(sampling=S(temperature=float("nan"))), InvalidArgument, "sampling.temperature"),
    (req(sampling=S(top_k=-1)), InvalidArgument, "sampling.top_k"),
    (req(sampling=S(top_p=0.0)), InvalidArgument, "sampling.top_p"),
    (req(sampling=S(top_p=1.01)), InvalidArgument, "sampling.top_p"),
    (req(sampling=S(min_p=1.5)), InvalidArgument, "sampling.min_p"),
    (req(sampling=S(typical_p=0.0)), InvalidArgument, "sampling.typical_p"),
    (req(sampling=S(repetition_penalty=0.0)), InvalidArgument, "sampling.repetition_penalty"),
    (req(sampling=S(presence_penalty=2.5)), InvalidArgument, "sampling.presence_penalty"),
    (req(sampling=S(frequency_penalty=-2.5)), InvalidArgument, "sampling.frequency_penalty"),
    (req(sampling=S(n=0)), InvalidArgument, "sampling.n"),
    (req(sampling=S(n=9)), InvalidArgument, "sampling.n"),
    (req(sampling=S(n=3, best_of=2)), InvalidArgument, "sampling.best_of"),
    (req(sampling=S(num_beams=0)), InvalidArgument, "sampling.num_beams"),
    (req(logit_bias={99: 1.0}), InvalidArgument, "sampling.logit_bias"),
    (req(logit_bias={3: 101.0}), InvalidArgument, "sampling.logit_bias"),
    (req(bad_words=("",)), InvalidArgument, "sampling.bad_words"),
    (req(bad_words=("x",) * 65), InvalidArgument, "sampling.bad_words"),
    (req(stopping=T(max_new_tokens=0)), InvalidArgument, "stopping.max_new_tokens"),
    (req(stopping=T(max_new_tokens=101)), InvalidArgument, "stopping.max_new_tokens"),
    (req(stopping=T(min_new_tokens=-1)), InvalidArgument, "stopping.min_new_tokens"),
    (req(stopping=T(stop=("a", "b", "c", "d", "e"))), InvalidArgument, "stopping.stop"),
    (req(stopping=T(stop=("",))), InvalidArgument, "stopping.stop"),
    (req(stopping=T(stop_token_ids=(50,))), InvalidArgument, "stopping.stop_token_ids"),
    (req(stopping=T(time_limit_ms=0)), InvalidArgument, "stopping.time_limit_ms"),
    (req(stopping=T(truncate_input_tokens=0)), InvalidArgument, "stopping.truncate_input_tokens"),
    (req(output=O(logprobs=True, top_logprobs=21)), InvalidArgument, "output.top_logprobs"),
    (req(output=O(logprobs=False, top_logprobs=2)), InvalidArgument, "output.top_logprobs"),
    (req(output=O(prompt_logprobs=-1)), InvalidArgument, "output.prompt_logprobs"),
    (req(session_id=""), InvalidArgument, "session_id"),
    (req(session_id="s", sampling=S(n=2)), InvalidArgument, "session_id"),
]


@pytest.mark.parametrize("request_, error, field", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_invalid_requests_name_the_field(request_, error, field):
    with pytest.raises(error) as info:
        validate_request(request_, LIMITS)
    assert info.value.field == field
    assert info.value.message.endswith(".")
    assert len(info.value.message.split()) >= 4


GOOD = [
    req(),
    req(model="tiny"),
    req(text=None, token_ids=(1, 2, 49)),
    req(text=None, session_id="continue-me"),
    req(sampling=S(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, n=8, best_of=8)),
    req(sampling=S(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1.3), logit_bias={0: -100.0}),
    req(stopping=T(max_new_tokens=100, min_new_tokens=0, stop=("a", "b", "c", "d"), stop_token_ids=(49,))),
    req(output=O(logprobs=True, top_logprobs=20, prompt_logprobs=20)),
]


@pytest.mark.parametrize("request_", GOOD)
def test_valid_requests_pass(request_):
    validate_request(request_, LIMITS)


def test_max_new_tokens_default_is_lowered_to_fit_the_context():
    assert resolve_max_new_tokens(req(), 10, LIMITS, default=30) == 30
    assert resolve_max_new_tokens(req(), 90, LIMITS, default=30) == 10


@pytest.mark.parametrize(
    "stopping, prompt_len, field",
    [(T(), 100, "text"), (T(max_new_tokens=50), 60, "stopping.max_new_tokens")],
)
def test_prompt_plus_max_new_tokens_must_fit_the_context(stopping, prompt_len, field):
    with pytest.raises(ContextLengthExceeded) as info:
        resolve_max_new_tokens(req(stopping=stopping), prompt_len, LIMITS, default=30)
    assert info.value.field == field
    assert "context" in info.value.message


def test_engine_input_limit_names_the_input_field():
    limits = dataclasses.replace(LIMITS, engine=dataclasses.replace(INFO, max_input_length=8))
    assert resolve_max_new_tokens(req(), 8, limits, default=30) == 30
    with pytest.raises(ContextLengthExceeded) as info:
        resolve_max_new_tokens(req(text=None, token_ids=tuple(range(9))), 9, limits, default=30)
    assert info.value.field == "token_ids"


@pytest.mark.parametrize(
    "stopping, prompt_len",
    [
        (T(max_new_tokens=5, min_new_tokens=6), 3),
        (T(min_new_tokens=31), 3),  # above the default max_new_tokens
        (T(min_new_tokens=20), 90),  # above the default lowered to fit the context
    ],
)
def test_min_new_tokens_must_not_exceed_the_max_new_tokens_in_effect(stopping, prompt_len):
    with pytest.raises(InvalidArgument) as info:
        resolve_max_new_tokens(req(stopping=stopping), prompt_len, LIMITS, default=30)
    assert info.value.field == "stopping.min_new_tokens"
    assert resolve_max_new_tokens(req(stopping=T(min_new_tokens=10)), prompt_len, LIMITS, default=30) >= 10


@pytest.mark.parametrize(
    "sampling, info, field",
    [
        (S(num_beams=2), INFO, "sampling.num_beams"),
        (S(num_beams=8), dataclasses.replace(INFO, max_num_beams=4), "sampling.num_beams"),
        (S(length_penalty=0.5), INFO, "sampling.length_penalty"),
        (S(early_stopping=True), INFO, "sampling.early_stopping"),
        (
            S(typical_p=0.5),
            dataclasses.replace(INFO, unsupported_sampling_fields=frozenset({"typical_p"})),
            "sampling.typical_p",
        ),
    ],
)
def test_features_the_engine_cannot_honour_are_refused(sampling, info, field):
    r = req(sampling=sampling)
    with pytest.raises(InvalidArgument) as e:
        validate_engine_support(resolve_generic(sampling, random_seed=1), r, info)
    assert e.value.field == field


@pytest.mark.parametrize(
    "output, info, field",
    [
        (O(logprobs=True, top_logprobs=1), dataclasses.replace(INFO, max_top_logprobs=0), "output.top_logprobs"),
        (O(logprobs=True, top_logprobs=6), dataclasses.replace(INFO, max_top_logprobs=5), "output.top_logprobs"),
        (O(prompt_logprobs=0), dataclasses.replace(INFO, supports_prompt_logprobs=False), "output.prompt_logprobs"),
    ],
)
def test_outputs_the_engine_cannot_produce_are_refused(output, info, field):
    r = req(output=output)
    with pytest.raises(InvalidArgument) as e:
        validate_engine_support(resolve_generic(r.sampling, random_seed=1), r, info)
    assert e.value.field == field


def test_neutral_values_of_unsupported_features_are_accepted():
    info = dataclasses.replace(INFO, unsupported_sampling_fields=frozenset({"typical_p"}))
    for sampling in (S(length_penalty=1.0, early_stopping=False, num_beams=1), S(typical_p=1.0)):
        validate_engine_support(resolve_generic(sampling, random_seed=1), req(sampling=sampling), info)


def test_beam_search_message_names_the_engine():
    with pytest.raises(InvalidArgument) as e:
        validate_engine_support(resolve_generic(S(num_beams=4), random_seed=1), req(sampling=S(num_beams=4)), INFO)
    assert "hf engine" in e.value.message and "num_beams=4" in e.value.message


# ----------------------------------------------------------------------------- guides and tools

GUIDED = dataclasses.replace(INFO, guided_decoding=frozenset({"json_object", "json_schema", "regex", "choice"}))
MSGS = (ChatMessage("user", (ContentPart(text="hi"),)),)


@pytest.mark.parametrize(
    ("request_", "field", "words"),
    [
        (req(guide=Guide("")), "guided_decoding", "sets no guide"),
        (req(guide=Guide("lark_grammar", 'start: "a"')), "guided_decoding.lark_grammar", "supports: json_object"),
        (req(guide=Guide("json_schema", "{nope")), "guided_decoding.json_schema", "not valid JSON"),
        (req(guide=Guide("json_schema", "[1]")), "guided_decoding.json_schema", "must be a JSON object"),
        (req(guide=Guide("regex", " ")), "guided_decoding.regex", "must not be empty"),
        (req(guide=Guide("regex", "a" * (MAX_GUIDE_CHARS + 1))), "guided_decoding.regex", "at most"),
        (req(guide=Guide("choice")), "guided_decoding.choice", "at least one"),
        (req(guide=Guide("choice", choices=("a", ""))), "guided_decoding.choice", "empty strings"),
        (req(guide=Guide("choice", choices=("a",) * (MAX_CHOICES + 1))), "guided_decoding.choice", "at most"),
    ],
)
def test_guides_are_checked_against_the_engine(request_, field, words):
    resolved = resolve_generic(request_.sampling, random_seed=1)
    with pytest.raises(InvalidArgument, match=words) as info:
        validate_engine_support(resolved, request_, GUIDED)
    assert info.value.field == field


def test_an_engine_without_guided_decoding_refuses_every_guide():
    r = req(guide=Guide("json_object"))
    with pytest.raises(InvalidArgument, match="supports: none") as info:
        validate_engine_support(resolve_generic(r.sampling, random_seed=1), r, INFO)
    assert info.value.field == "guided_decoding.json_object"


@pytest.mark.parametrize(
    ("stopping", "field"),
    [(T(ignore_eos=True), "stopping.ignore_eos"), (T(min_new_tokens=2), "stopping.min_new_tokens")],
)
def test_guides_cannot_be_kept_from_ending(stopping, field):
    with pytest.raises(InvalidArgument, match="guided_decoding") as info:
        validate_request(req(guide=Guide("regex", "a"), stopping=stopping), LIMITS)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("guide", "words"),
    [
        (Guide("json_schema", '{"type": "objectx"}'), "Invalid type"),
        (Guide("regex", "[a-"), "unclosed character class"),
        (Guide("lark_grammar", "start: nowhere"), "unknown name"),
        (Guide("ebnf_grammar", "root ::= ("), "GBNF"),
    ],
)
def test_guides_that_do_not_compile(guide, words):
    with pytest.raises(InvalidArgument, match=words) as info:
        check_compiles(guide)
    assert info.value.field == guide.field


def test_every_kind_compiles():
    for guide in [
        Guide("json_object"),
        Guide("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}'),
        Guide("regex", "[0-9]+"),
        Guide("ebnf_grammar", 'root ::= "a" [0-9]'),
        Guide("lark_grammar", 'start: "a" | "b"'),
        Guide("choice", choices=("x", 'y "z"')),
    ]:
        check_compiles(guide)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (req(text=None, messages=MSGS, tools=(Tool("a b"),)), "tools[0].name"),
        (req(text=None, messages=MSGS, tools=(Tool("f"), Tool("f"))), "tools[1].name"),
        (req(text=None, messages=MSGS, tools=(Tool("f", parameters="{"),)), "tools[0].parameters"),
        (req(text=None, messages=MSGS, tools=(Tool("f", parameters="[]"),)), "tools[0].parameters"),
        (req(text=None, messages=MSGS, tools=tuple(Tool(f"f{i}") for i in range(MAX_TOOLS + 1))), "tools"),
        (req(text=None, messages=(ChatMessage("tool", (ContentPart(text="x"),)),)), "messages[0].tool_call_id"),
        (
            req(text=None, messages=(ChatMessage("user", tool_calls=(ToolCall("1", "f", "{}"),)),)),
            "messages[0].tool_calls",
        ),
    ],
)
def test_tools_and_tool_messages(request_, field):
    with pytest.raises(InvalidArgument) as info:
        validate_request(request_, LIMITS)
    assert info.value.field == field


USER_AND_ASSISTANT = (ChatMessage("user", (ContentPart(text="a"),)), ChatMessage("assistant", (ContentPart(text="b"),)))


@pytest.mark.parametrize(
    "template, messages, words",
    [
        (ChatTemplateOptions(kwargs="{nope"), USER_AND_ASSISTANT, "not valid JSON"),
        (ChatTemplateOptions(kwargs="[1]"), USER_AND_ASSISTANT, "JSON object"),
        (ChatTemplateOptions(kwargs='{"tools": []}'), USER_AND_ASSISTANT, "'tools'"),
        (ChatTemplateOptions(continue_final_message=True), USER_AND_ASSISTANT, "add_generation_prompt false"),
        (
            ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True),
            USER_AND_ASSISTANT[:1],
            "must be the assistant's",
        ),
    ],
)
def test_chat_template_options_are_checked(template, messages, words):
    with pytest.raises(InvalidArgument) as info:
        validate_request(req(text=None, messages=messages, template=template), LIMITS)
    assert info.value.field.startswith("messages.") and words in str(info.value)


def test_valid_chat_template_options_pass():
    template = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True, kwargs='{"x": 1}')
    validate_request(req(text=None, messages=USER_AND_ASSISTANT, template=template), LIMITS)


def test_model_aliases_are_served_names():
    aliased = dataclasses.replace(LIMITS, model_aliases=("gpt-4o",))
    validate_request(req(model="gpt-4o"), aliased)
    with pytest.raises(ModelNotFound):
        validate_request(req(model="gpt-4o"), LIMITS)


def test_fill_context_takes_the_rest_of_the_context():
    filled = req(stopping=T(fill_context=True))
    assert resolve_max_new_tokens(filled, 10, LIMITS, default=30) == 90
    assert resolve_max_new_tokens(req(), 10, LIMITS, default=30) == 30
    bounded = dataclasses.replace(LIMITS, max_new_tokens=50)
    assert resolve_max_new_tokens(filled, 10, bounded, default=30) == 50
