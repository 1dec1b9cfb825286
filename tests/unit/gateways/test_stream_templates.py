"""One renderer per schema takes every delta of a stream, and a plain decode step (a Step tuple,
gateways.common.core_call) renders the same bytes as the GenerateResponse it stands for
(generate_service.proto, Steps): `{request_id, outputs: [{index: 0, text, tokens: [{id,
logprob}]}]}`, without `tokens` for a request that does not ask for them (OpenAI chat, Triton
without log probs, WebSocket). Each test renders a stream twice, on fresh renderers: once with
every delta a whole message, once with the plain decode steps as Steps, and compares the bytes
of each delta and the state left for the stream's end. Steps and messages carry awkward text:
quotes, backslashes, control characters, line separators, non-BMP characters, the replacement
character of a lone byte, and `%` (the per-request Template's own format character), in the
text and in the constant parts. The Template itself fills a value to the bytes of its
rendering."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common import framing
from gateways.common.chat import route as chat_route
from gateways.common.chat import translate as chat
from gateways.common.chat.schema import parse_chat_request
from gateways.common.core_call import CoreCall, Delta, Step
from gateways.common.core_client import CONFIG_KEY
from gateways.lmi.routes import record_renderer
from gateways.lmi.translate import RenderOptions, StreamRenderer
from gateways.triton.routes import event_renderer
from gateways.triton.translate import ResponseRenderer
from gateways.ws import routes as ws_routes
from gateways.ws.config import WsSettings

AWKWARD = [
    'say "hi"',
    "back\\slash \\u0041 \\n",
    "\x00\x01\x08\x0b\x1f\x7f",
    "tab\tnew\nline\rfeed\f",
    "\u2028\u2029",
    "😀 𝄞 non-BMP",
    "\ufffd",  # a lone byte, as the core's text shows it
    "é ü 中文",
    "</script><!--",
    "%b %s %% %",
    " ",
]

#: Token text as the core may send it: any valid Unicode (no lone surrogates), often awkward.
TEXTS = st.one_of(st.sampled_from([*AWKWARD, ""]), st.text(st.characters(exclude_categories=("Cs",)), max_size=12))

#: A renderer of one stream: `render(delta)` gives its bytes; `end()` what the stream's end
#: depends on (the state the renderer keeps), to compare.
Renderer = tuple[Callable[[Delta], bytes], Callable[[], Any]]


def stands_for(step: Step, *, tokens: bool) -> spb.GenerateResponse:
    """The message a plain decode step stands for."""
    msg = spb.GenerateResponse(request_id="r")
    out = msg.outputs.add(index=0, text=step[0])
    if tokens:
        tok = out.tokens.add(id=step[1])
        if step[2] is not None:
            tok.logprob = step[2]
    return msg


def same_bytes(make: Callable[[], Renderer], stream: list[Delta], *, tokens: bool) -> list[bytes]:
    """Render `stream` as whole messages and with its Steps, on fresh renderers; assert each
    delta renders the same bytes and the end state is the same. Returns the bytes per delta."""
    whole, whole_end = make()
    stepped, stepped_end = make()
    expected = [whole(stands_for(d, tokens=tokens) if isinstance(d, tuple) else d) for d in stream]
    got = [stepped(d) for d in stream]
    for delta, want, have in zip(stream, expected, got, strict=True):
        assert have == want, delta
    assert stepped_end() == whole_end()
    return got


def of_steps(stream: list[Delta], got: list[bytes]) -> list[bytes]:
    """The bytes of the steps of `stream`."""
    return [data for delta, data in zip(stream, got, strict=True) if isinstance(delta, tuple)]


def _msg(*outputs: pb.SequenceOutput, final: bool = False, prompt_text: str | None = None) -> spb.GenerateResponse:
    m = spb.GenerateResponse(request_id="r", outputs=list(outputs))
    if prompt_text is not None:
        m.prompt_text = prompt_text
    if final:
        m.usage.prompt_tokens = 3
        m.usage.completion_tokens = 5
    return m


def _tok(token_id: int, text: str, logprob: float | None = -0.25, special: bool = False) -> pb.Token:
    t = pb.Token(id=token_id, text=text, special=special)
    if logprob is not None:
        t.logprob = logprob
    return t


QUEUED = spb.GenerateResponse(request_id="r", state=pb.GENERATE_STATE_QUEUED)
SCHEDULED = spb.GenerateResponse(request_id="r", state=pb.GENERATE_STATE_SCHEDULED)
PREFILLED = spb.GenerateResponse(request_id="r", state=pb.GENERATE_STATE_PREFILLED)
out = pb.SequenceOutput


# ---------------------------------------------------------------------------------- Template


@pytest.mark.parametrize("text", [*AWKWARD, ""])
def test_template_fill_is_the_rendering(text):
    def render(value: Any) -> bytes:
        return framing.sse_event({"id": "x%b%%", "choices": [{"delta": {"content": value}, "n": None}]})

    t = framing.Template(render)
    assert t.fill_text(text) == t.fill(text) == render(text)


@pytest.mark.parametrize("values", [(5, "a", -0.5), (0, "", None), (2**40, AWKWARD[0], -1e-30), (7, "%d", 0.0)])
def test_template_fills_several_values(values):
    def render(*v: Any) -> bytes:
        return framing.jsonline({"token": {"id": v[0], "text": v[1], "log_prob": v[2]}, "k": "%s"})

    assert framing.Template(render, 3).fill(*values) == render(*values)


@pytest.mark.parametrize("values", [(5, "a"), (1, "%b", None, True)])
def test_template_fills_two_or_four_values(values):
    def render(*v: Any) -> bytes:
        return framing.sse_event({"v": list(v), "k": "%%"})

    assert framing.Template(render, len(values)).fill(*values) == render(*values)


def test_template_refuses_a_value_that_is_not_rendered_once():
    with pytest.raises(ValueError, match="exactly once"):
        framing.Template(lambda text: framing.sse_event({"a": 1}))
    with pytest.raises(ValueError, match="exactly once"):
        framing.Template(lambda text: framing.sse_event({"a": text, "b": text}))
    with pytest.raises(ValueError, match="exactly once"):
        framing.Template(lambda text: framing.sse_event({"a": text.upper()}))


# ---------------------------------------------------------------------------------- chat


def chat_renderer(framing_name: str = "sse", include_usage: bool = False, model: str = "demo") -> Renderer:
    """chunk_renderer of a streamed chat request that takes steps (no logprobs, no tools)."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    state = chat.state_for(parse_chat_request(body), completion_id="chatcmpl-1%", created=5, model=model)
    assert chat.plain_deltas(state)  # the route asks for steps

    def end() -> Any:
        usage = chat.usage_chunk(state) if include_usage else None
        return usage, state.role_sent

    return chat_route.chunk_renderer(state, framing_name), end


def chat_stream(first: str) -> list[Delta]:
    """A chat stream; its first token a message or a step (the role goes with either)."""
    head: Delta = _msg(out(index=0, text="Hel")) if first == "message" else ("Hel", 1, None)
    stream: list[Delta] = [QUEUED, SCHEDULED, head]
    stream += [(t, i + 2, None) for i, t in enumerate(AWKWARD)]
    stream += [
        ("", 30, None),  # a token without text yet
        _msg(out(index=0, text="whole")),  # a plain token sent whole
        ("after", 31, None),
        _msg(out(index=0, text="end", finish_reason=pb.FINISH_REASON_EOS), final=True),
    ]
    return stream


@pytest.mark.parametrize("framing_name", ["sse", "jsonlines"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", ["demo", 'odd "model" %b\n😀'])
@pytest.mark.parametrize("first", ["message", "step"])
def test_chat_steps_render_as_their_messages(framing_name, include_usage, model, first):
    make = functools.partial(chat_renderer, framing_name, include_usage, model)
    stream = chat_stream(first)
    got = same_bytes(make, stream, tokens=False)
    assert all(data for delta, data in zip(stream, got, strict=True) if isinstance(delta, tuple) and delta[0])


def reasoning_renderer(parser: str) -> Renderer:
    """chunk_renderer of a streamed chat request on a gateway with a reasoning parser."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    state = chat.state_for(parse_chat_request(body), completion_id="c", created=5, model="m", reasoning=parser)
    assert chat.plain_deltas(state)  # the route asks for steps
    return chat_route.chunk_renderer(state, "sse"), lambda: (state.role_sent, state.reasoners)


#: Texts of a reasoning model's tokens: tags cut anywhere, and a tag after the first block.
THINKING = [" ", "<th", "ink>", "Two", " and\n", "two</", "think", ">The", " answer", "", " is <think>4</think>"]


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("first", ["message", "step"])
@pytest.mark.parametrize("cut", [0, 3, 6, len(THINKING)])
def test_chat_steps_with_reasoning_render_as_their_messages(parser, first, cut):
    """Reasoning is split out of steps as out of messages, and after `</think>` a step is
    content as it comes; whatever part of the stream arrives as whole messages (`cut`)."""
    head: Delta = _msg(out(index=0, text=THINKING[0])) if first == "message" else (THINKING[0], 1, None)
    tail = [(t, i + 2, None) for i, t in enumerate(THINKING[1:])]
    middle = [_msg(out(index=0, text=d[0])) if i < cut else d for i, d in enumerate(tail)]
    final = _msg(out(index=0, text=".", finish_reason=pb.FINISH_REASON_EOS), final=True)
    stream: list[Delta] = [QUEUED, head, *middle, final]
    got = same_bytes(functools.partial(reasoning_renderer, parser), stream, tokens=False)
    text = b"".join(got).decode()
    assert "<think>4</think>" in text and "</think>The" not in text


@settings(max_examples=60, deadline=None)
@given(
    parser=st.sampled_from(["qwen3", "deepseek_r1"]),
    whole=st.lists(st.sampled_from(["<think>", "</think>", " ", "a", "<", "</", "think", ">", *AWKWARD]), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
    as_message=st.lists(st.booleans(), max_size=8),
)
def test_any_reasoning_text_renders_the_same_bytes_as_steps(parser, whole, cuts, as_message):
    """Any text, cut anywhere into steps and messages, renders the bytes of all messages."""
    text = "".join(whole)
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    stream: list[Delta] = [QUEUED]
    for i, piece in enumerate(pieces):
        stream.append(_msg(out(index=0, text=piece)) if i < len(as_message) and as_message[i] else (piece, i, None))
    stream.append(_msg(out(index=0, finish_reason=pb.FINISH_REASON_LENGTH), final=True))
    same_bytes(functools.partial(reasoning_renderer, parser), stream, tokens=False)


def test_chat_with_logprobs_or_tools_takes_no_steps():
    """Such a stream renders from messages only: the route asks for no steps."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra in ({"logprobs": True}, {"tools": tools}):
        req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "stream": True, **extra})
        assert not chat.plain_deltas(chat.state_for(req, completion_id="c", created=5, model="m"))


# ---------------------------------------------------------------------------------- LMI


def lmi_renderer(tgi_compat: bool, details: bool, frame: Callable[[Any], bytes]) -> Renderer:
    opts = RenderOptions(inputs='say "hi" %b', stream=True, tgi_compat=tgi_compat, details=details)
    renderer = StreamRenderer(opts)
    return record_renderer(renderer, frame), lambda: renderer.generated_text


def lmi_stream() -> list[Delta]:
    stream: list[Delta] = [QUEUED, _msg(out(text="first", tokens=[_tok(1, "first")]))]
    stream += [(t, i + 2, -0.125 * (i + 1)) for i, t in enumerate(AWKWARD)]
    stream += [
        ("", 40, None),  # no logprob asked: null
        _msg(out(text="held ")),  # text before its token: carried to the next record
        ("over", 41, -3.5),
        _msg(out(text="<s>", tokens=[_tok(42, "<s>", -0.5, special=True)])),
        _msg(out(text="ab", tokens=[_tok(43, "a"), _tok(44, "b")])),  # two tokens in one step
        _msg(out(text="held again ")),
        _msg(out(text="whole", tokens=[_tok(45, "whole")])),  # a plain token sent whole
        (" end", 46, -1.0),
        _msg(out(text="!", tokens=[_tok(47, "!")], finish_reason=pb.FINISH_REASON_LENGTH), final=True),
    ]
    return stream


@pytest.mark.parametrize("tgi_compat", [False, True])
@pytest.mark.parametrize("details", [False, True])
@pytest.mark.parametrize("frame", [framing.jsonline, framing.sse_event])
def test_lmi_steps_render_as_their_messages(tgi_compat, details, frame):
    stream = lmi_stream()
    got = same_bytes(functools.partial(lmi_renderer, tgi_compat, details, frame), stream, tokens=True)
    assert all(of_steps(stream, got))  # a record for every step


# ---------------------------------------------------------------------------------- Triton


def triton_renderer(client_id: str | None, logprobs: bool) -> Renderer:
    renderer = ResponseRenderer("demo%", "1", client_id=client_id, logprobs=logprobs)
    return event_renderer(renderer), lambda: (renderer._pending_prompt, renderer._cumulative)


def triton_stream(logprobs: bool) -> list[Delta]:
    """A Triton stream whose prompt echo is pending when the first step comes."""

    def lp(i: int) -> float | None:
        return -0.5 * i if logprobs else None

    stream: list[Delta] = [QUEUED, _msg(prompt_text="echo %b "), ("first", 1, lp(1))]
    stream += [(t, i + 2, lp(i)) for i, t in enumerate(AWKWARD)]
    stream += [
        ("", 30, lp(2)),
        _msg(out(text="whole", tokens=[_tok(31, "whole", -0.25)] if logprobs else [])),
        _msg(prompt_text=" more %s"),
        ("again", 32, lp(3)),
        _msg(out(text="last", tokens=[_tok(50, "last")], finish_reason=pb.FINISH_REASON_EOS), final=True),
    ]
    return stream


@pytest.mark.parametrize("client_id", [None, 'id "1" %b'])
@pytest.mark.parametrize("logprobs", [False, True])
def test_triton_steps_render_as_their_messages(client_id, logprobs):
    make = functools.partial(triton_renderer, client_id, logprobs)
    stream = triton_stream(logprobs)
    got = same_bytes(make, stream, tokens=logprobs)
    assert b'"text_output":"echo %b first"' in got[2]  # the pending echo goes with the step
    assert all(of_steps(stream, got))  # an event for every step


# ---------------------------------------------------------------------------------- WebSocket


class _Transport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.sent.append(data)

    def is_closing(self) -> bool:
        return False


class _CoreClient:
    """The core client at `generate`: the calls a socket starts, kept for the test to feed."""

    def __init__(self) -> None:
        self.calls: list[CoreCall] = []
        self.tracing = None  # tracing off

    def generate(
        self, request: spb.GenerateRequest, *, hash_key: str | None = None, steps: bool = False, span: None = None
    ) -> CoreCall:
        assert steps  # the socket takes plain decode steps
        call = CoreCall(request, steps=steps, hash_key=hash_key)
        self.calls.append(call)
        return call


def ws_renderer(stream_response: bool, request_id: str) -> Renderer:
    """A socket's Connection with one prompt in flight: `render(delta)` hands the delta to the
    prompt's call as the stream's reader does and returns the frames the socket wrote."""
    transport = _Transport()
    protocol = SimpleNamespace(transport=transport, writing_paused=False)
    request = SimpleNamespace(
        app={CONFIG_KEY: SimpleNamespace(max_json_depth=64)},
        protocol=protocol,
        writer=None,
        get=lambda key: None,
        path="/ws",
    )
    client = _CoreClient()
    conn = ws_routes.Connection(request, SimpleNamespace(closed=False), client, WsSettings())  # type: ignore[arg-type]
    frame = {"prompts": [{"request_id": request_id, "prompt": "hi"}], "only_new_tokens": False}
    conn._on_frame(orjson.dumps({**frame, "stream_response": stream_response}).decode())
    (call,) = client.calls

    def render(delta: Delta) -> bytes:
        written = len(transport.sent)
        if isinstance(delta, tuple):
            call._add_step(delta)
            call._notify()
        else:
            call._news([delta], delta.HasField("usage"), None)
        return b"".join(transport.sent[written:])

    return render, lambda: (conn.prompts, conn._out)


def ws_stream() -> list[Delta]:
    stream: list[Delta] = [QUEUED, SCHEDULED, PREFILLED, ("first", 1, None)]
    stream += [(t, i + 2, None) for i, t in enumerate(AWKWARD)]
    stream += [
        ("", 30, None),
        _msg(out(text="and"), prompt_text="echo"),
        ("more", 31, None),
        _msg(out(text="last", finish_reason=pb.FINISH_REASON_EOS), final=True),
    ]
    return stream


@pytest.mark.parametrize("stream_response", [True, False])
@pytest.mark.parametrize("request_id", ["r1", 'id "1" %b 😀'])
def test_ws_steps_render_as_their_messages(stream_response, request_id):
    """The frames, COMPLETE (whose text joins the steps' texts) included."""
    stream = ws_stream()
    got = same_bytes(functools.partial(ws_renderer, stream_response, request_id), stream, tokens=False)
    frames = [data for delta, data in zip(stream, got, strict=True) if isinstance(delta, tuple) and delta[0]]
    assert all(frames) if stream_response else not any(frames)  # PROGRESS frames when streamed
    assert b'"type":"COMPLETE"' in got[-1]


def test_ws_frame_of_mixed_events_is_the_array_of_all():
    events = [{"request_id": "a", "type": "STARTED"}, {"request_id": "a", "type": "PROGRESS", "text": "x"}]
    mixed = [events[0], framing.dump_bytes(events[1])]
    assert ws_routes._array(mixed) == framing.dump_bytes(events)
    assert ws_routes._array([mixed[1]]) == framing.dump_bytes([events[1]])


# ---------------------------------------------------------------------------------- any text


SCHEMAS: dict[str, tuple[Callable[[], Renderer], bool, Callable[[list[Delta]], list[Delta]]]] = {
    # name: (renderer, steps stand for messages with tokens, the stream around the drawn steps)
    "chat": (functools.partial(chat_renderer, "sse", True), False, lambda s: [QUEUED, *s, chat_stream("step")[-1]]),
    "lmi": (functools.partial(lmi_renderer, True, True, framing.sse_event), True, lambda s: [*s, lmi_stream()[-1]]),
    "triton": (functools.partial(triton_renderer, "1", True), True, lambda s: [_msg(prompt_text="%"), *s]),
    "ws": (functools.partial(ws_renderer, True, "r"), False, lambda s: [*s, ws_stream()[-1]]),
}


#: A token's logprob as the core sends it (a float32, <= 0).
LOGPROBS = st.floats(max_value=0.0, width=32, allow_nan=False)


@pytest.mark.parametrize("schema", sorted(SCHEMAS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.lists(st.tuples(TEXTS, LOGPROBS), max_size=6), carried=TEXTS)
def test_any_text_renders_the_same_bytes_as_a_step(schema, tokens, carried):
    """For any token text and logprob, with a whole message's text between steps (LMI carries
    it into the next record), a step renders its message's bytes."""
    make, with_tokens, around = SCHEMAS[schema]
    steps: list[Delta] = [(text, i, logprob if with_tokens else None) for i, (text, logprob) in enumerate(tokens)]
    steps.insert(len(steps) // 2, _msg(out(text=carried)))
    same_bytes(make, around(steps), tokens=with_tokens)
