"""Streamed records rendered from per-request templates (gateways.common.framing.Template) are
byte for byte the records of the general path (translate + orjson), for every schema and for
awkward token text: quotes, backslashes, control characters, line separators, non-BMP
characters, the replacement character of a lone byte, and `%` (the template's own format
character), in the text and in the constant parts. Text-only messages rendered from their text
alone (`render_text`, for MultiplexEvent.texts) and LMI's token records rendered from a compact
token's values (`render_token`, for MultiplexEvent.token_ids) are the same bytes too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common import framing
from gateways.common.chat import route as chat_route
from gateways.common.chat import translate as chat
from gateways.common.chat.schema import parse_chat_request
from gateways.common.core_client import text_response
from gateways.lmi.routes import record_renderer
from gateways.lmi.translate import RenderOptions, StreamRenderer
from gateways.triton.routes import event_renderer
from gateways.triton.translate import ResponseRenderer
from gateways.ws import routes as ws_routes
from gateways.ws import translate as ws_translate

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


def _text_only(m: spb.GenerateResponse) -> str | None:
    """The text of a message that an entry of MultiplexEvent.texts stands for, else None."""
    return m.outputs[0].text if len(m.outputs) == 1 and m == text_response(m.request_id, m.outputs[0].text) else None


def _same_bytes(
    fast: Callable[[spb.GenerateResponse], bytes],
    general: Callable[[spb.GenerateResponse], bytes],
    msgs: list[spb.GenerateResponse],
    fast_text: Callable[[str], bytes | None] | None = None,
) -> int:
    """Assert the fast path renders every message as the general one does, text-only messages
    through `fast_text` (as relay's render_text) when given; returns how many it rendered."""
    by_text = 0
    for m in msgs:
        text = _text_only(m) if fast_text is not None else None
        data = None if text is None else cast(Callable[[str], bytes | None], fast_text)(text)
        by_text += data is not None
        assert (fast(m) if data is None else data) == general(m), m
    return by_text


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


def _chat_stream() -> list[spb.GenerateResponse]:
    out = pb.SequenceOutput
    msgs = [QUEUED, SCHEDULED, _msg(out(index=0, text="Hel"))]
    msgs += [_msg(out(index=0, text=t)) for t in AWKWARD]
    msgs += [
        _msg(out(index=0, text="")),  # a token without text yet
        _msg(out(index=0, text="a"), out(index=1, text="b")),  # two choices with news
        _msg(out(index=1, text="😀")),
        _msg(out(index=1, text="x", finish_reason=pb.FINISH_REASON_LENGTH)),
        _msg(out(index=0, text="end", finish_reason=pb.FINISH_REASON_EOS), final=True),
    ]
    return msgs


@pytest.mark.parametrize("framing_name", ["sse", "jsonlines"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", ["demo", 'odd "model" %b\n😀'])
@pytest.mark.parametrize("texts", [False, True], ids=["messages", "texts"])
def test_chat_chunks_from_templates_are_the_general_chunks(framing_name, include_usage, model, texts):
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    req = parse_chat_request(body)

    def state() -> chat.StreamState:
        return chat.state_for(req, completion_id="chatcmpl-1%", created=5, model=model)

    fast_state, general_state = state(), state()
    fast, fast_text = chat_route.chunk_renderer(fast_state, framing_name)

    def general(m: spb.GenerateResponse) -> bytes:
        chunks = chat.to_chunks(m, general_state)
        return chat_route.encode(chunks, framing_name) if chunks else b""

    msgs = _chat_stream()
    by_text = _same_bytes(fast, general, msgs, fast_text if texts else None)
    plain = [m for m in msgs if chat.content_delta(m, fast_state) is not None]
    assert len(plain) >= len(AWKWARD)  # the templates did render most tokens
    assert by_text == (len(AWKWARD) if texts else 0)  # the first delta carries the role: a message
    assert chat.usage_chunk(fast_state) == chat.usage_chunk(general_state)


def test_chat_logprobs_and_tools_take_the_general_path():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra in ({"logprobs": True}, {"tools": tools}):
        req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "stream": True, **extra})
        state = chat.state_for(req, completion_id="c", created=5, model="m")
        state.role_sent.add(0)
        assert chat.content_delta(_msg(pb.SequenceOutput(index=0, text="a")), state) is None


# ---------------------------------------------------------------------------------- LMI


def _lmi_stream() -> list[spb.GenerateResponse]:
    out = pb.SequenceOutput
    msgs = [QUEUED, _msg(out(text="first", tokens=[_tok(1, "first")]))]
    msgs += [_msg(out(text=t, tokens=[_tok(i + 2, t, -0.125 * i)])) for i, t in enumerate(AWKWARD)]
    msgs += [
        _msg(out(text="", tokens=[_tok(40, "\ufffd", None)])),  # no logprob: null
        _msg(out(text="held ")),  # text before its token: carried to the next record
        _msg(out(text="over", tokens=[_tok(41, "over", -3.5)])),
        _msg(out(text="<s>", tokens=[_tok(42, "<s>", -0.5, special=True)])),
        _msg(out(text="ab", tokens=[_tok(43, "a"), _tok(44, "b")])),  # two tokens in one step
        _msg(out(text=" end", tokens=[_tok(45, " end")], finish_reason=pb.FINISH_REASON_LENGTH), final=True),
    ]
    return msgs


def _compact(m: spb.GenerateResponse) -> tuple[str, int, float | None] | None:
    """(text, token_id, logprob) of the compact token (MultiplexEvent.texts with token_ids) a
    core sends for `m` under compact_tokens, else None: new text of sequence 0 with one ordinary
    token and nothing else."""
    if len(m.outputs) != 1 or m.HasField("usage") or m.state:
        return None
    out = m.outputs[0]
    if out.index or out.finish_reason or len(out.tokens) != 1 or out.tokens[0].special:
        return None
    tok = out.tokens[0]
    return out.text, tok.id, tok.logprob if tok.HasField("logprob") else None


@pytest.mark.parametrize("tgi_compat", [False, True])
@pytest.mark.parametrize("details", [False, True])
@pytest.mark.parametrize("frame", [framing.jsonline, framing.sse_event])
@pytest.mark.parametrize("compact", ["messages", "tokens", "token messages"])
def test_lmi_records_from_templates_are_the_general_records(tgi_compat, details, frame, compact):
    """Each message renders as the general path does: whole (`messages`), or, for those a
    core sends as compact tokens, from the token's values (`tokens`, relay's render_token) or
    as the message the compact token stands for (`token messages`, text_response: its token
    has no text, bytes or special flag)."""
    opts = RenderOptions(inputs='say "hi" %b', stream=True, tgi_compat=tgi_compat, details=details)
    fast_renderer, general_renderer = StreamRenderer(opts), StreamRenderer(opts)
    fast, fast_token = record_renderer(fast_renderer, frame)
    by_token = 0
    for m in _lmi_stream():
        values = _compact(m) if compact != "messages" else None
        if values is None:
            data = fast(m)
        elif compact == "tokens":
            data = fast_token(*values)
            by_token += 1
        else:
            data = fast(text_response(m.request_id, *values))
        assert data == b"".join(map(frame, general_renderer.feed(m))), m
    assert fast_renderer.generated_text == general_renderer.generated_text
    assert StreamRenderer(opts).plain_token(_lmi_stream()[2]) is not None  # the templates did render tokens
    assert by_token == (len(AWKWARD) + 3 if compact == "tokens" else 0)  # first, the lone byte, over


def test_lmi_top_tokens_take_the_general_path():
    renderer = StreamRenderer(RenderOptions(inputs="hi", stream=True, top_tokens=True))
    assert renderer.plain_token(_msg(pb.SequenceOutput(text="a", tokens=[_tok(1, "a")]))) is None
    assert renderer.token_text("a") is None
    assert record_renderer(renderer, framing.jsonline)[1]("a", 1, -0.5) is None


# ---------------------------------------------------------------------------------- Triton


def _triton_stream() -> list[spb.GenerateResponse]:
    out = pb.SequenceOutput
    msgs = [QUEUED, _msg(prompt_text="echo %b "), _msg(out(text="first", tokens=[_tok(1, "first")]))]
    msgs += [_msg(out(text=t, tokens=[_tok(i + 2, t, -0.5)])) for i, t in enumerate(AWKWARD)]
    msgs += [_msg(out(text=t)) for t in AWKWARD]  # text alone, as a request without token details gets it
    msgs += [
        _msg(out(text="")),
        _msg(out(text="last", tokens=[_tok(50, "last")], finish_reason=pb.FINISH_REASON_EOS), final=True),
    ]
    return msgs


@pytest.mark.parametrize("client_id", [None, 'id "1" %b'])
@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("texts", [False, True], ids=["messages", "texts"])
def test_triton_events_from_templates_are_the_general_events(client_id, logprobs, texts):
    def renderer() -> ResponseRenderer:
        return ResponseRenderer("demo%", "1", client_id=client_id, logprobs=logprobs)

    fast_renderer, general_renderer = renderer(), renderer()
    fast, fast_text = event_renderer(fast_renderer)

    def general(m: spb.GenerateResponse) -> bytes:
        event = general_renderer.event(m)
        return b"" if event is None else framing.sse_event(event)

    msgs = _triton_stream()
    by_text = _same_bytes(fast, general, msgs, fast_text if texts else None)
    assert by_text == (len(AWKWARD) + 1 if texts and not logprobs else 0)  # + the empty text
    assert (renderer().plain_text(msgs[3]) is not None) is not logprobs


# ---------------------------------------------------------------------------------- WebSocket


def _ws_stream() -> list[spb.GenerateResponse]:
    out = pb.SequenceOutput
    msgs = [QUEUED, SCHEDULED, spb.GenerateResponse(request_id="r", state=pb.GENERATE_STATE_PREFILLED)]
    msgs += [_msg(out(text=t)) for t in AWKWARD]
    msgs += [
        _msg(out(text="")),
        _msg(out(text="and"), prompt_text="echo"),
        _msg(out(text="last", finish_reason=pb.FINISH_REASON_EOS), final=True),
    ]
    return msgs


@pytest.mark.parametrize("stream_response", [True, False])
@pytest.mark.parametrize("request_id", ["r1", 'id "1" %b 😀'])
@pytest.mark.parametrize("texts", [False, True], ids=["messages", "texts"])
def test_ws_progress_from_templates_is_the_general_frame(stream_response, request_id, texts):
    def state() -> ws_translate.PromptState:
        return ws_translate.PromptState(request_id, only_new_tokens=False, stream_response=stream_response)

    fast_state, general_state = state(), state()
    progress = framing.Template(lambda text: framing.dump_bytes(ws_translate.progress_event(fast_state, text)))
    plain = 0
    for m in _ws_stream():
        only = _text_only(m) if texts else None
        if only is not None:  # as Connection._on_news takes an entry of MultiplexEvent.texts
            text = ws_translate.text_progress(only, fast_state)
        else:
            text = ws_translate.progress_text(m, fast_state)
        plain += text is not None
        fast = [progress.fill_text(text)] if text is not None else ws_translate.to_events(m, fast_state)
        general = ws_translate.to_events(m, general_state)
        if general:
            assert ws_routes._array(fast) == framing.dump_bytes(general)
    assert fast_state == general_state
    assert ws_translate.to_complete(fast_state) == ws_translate.to_complete(general_state)
    assert plain == (len(AWKWARD) if stream_response else 0)


def test_ws_frame_of_mixed_events_is_the_array_of_all():
    events = [{"request_id": "a", "type": "STARTED"}, {"request_id": "a", "type": "PROGRESS", "text": "x"}]
    mixed = [events[0], framing.dump_bytes(events[1])]
    assert ws_routes._array(mixed) == framing.dump_bytes(events)
    assert ws_routes._array([mixed[1]]) == framing.dump_bytes([events[1]])
