"""Pure conversions between protobuf messages and core.types.

This module, the service and the server are the only places that import the generated
contract; everything else in the core works on dataclasses. Unset proto3 `optional` fields
become None.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from core.types import (
    DEFAULT_TEMPLATE,
    ChatMessage,
    ChatTemplateOptions,
    ContentPart,
    FinishReason,
    GenerationRequest,
    Guide,
    OutputOptions,
    RequestState,
    ResolvedSampling,
    ResponseDelta,
    SamplingOptions,
    StoppingOptions,
    TokenInfo,
    Tool,
    ToolCall,
)

FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.TIME_LIMIT: pb.FINISH_REASON_TIME_LIMIT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
STATES = {
    RequestState.QUEUED: pb.GENERATE_STATE_QUEUED,
    RequestState.SCHEDULED: pb.GENERATE_STATE_SCHEDULED,
    RequestState.PREFILLED: pb.GENERATE_STATE_PREFILLED,
    RequestState.GENERATING: pb.GENERATE_STATE_GENERATING,
}
_SAMPLING_FIELDS = [f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.has_presence and f.name != "logit_bias"]


def _opt(msg: Message, name: str) -> Any:
    """A proto3 `optional` field's value, None when unset."""
    return getattr(msg, name) if msg.HasField(name) else None


def to_generation_request(
    req: spb.GenerateRequest, request_id: str, caller: str = "", key_tenant: str | None = None
) -> GenerationRequest:
    """A GenerateRequest as core types, under `request_id` (the service passes the client's
    request_id, or the one it generated when that is empty). `caller` is the identity of the
    call's API key ("" without keys): with the request's `tenant` it scopes the session.
    `key_tenant` is the name of the call's API key when it has one: the request is then served
    for that tenant (fair shares, limits), whatever its `tenant` field says."""
    s, st, o = req.sampling, req.stopping, req.output
    which = req.WhichOneof("input")
    messages = None
    if which == "messages":
        messages = tuple(
            ChatMessage(
                role=m.role,
                content=tuple(
                    ContentPart(text=p.text)
                    if p.WhichOneof("part") == "text"
                    else ContentPart(image_url=p.image_url.url)
                    for p in m.content
                    if p.WhichOneof("part") is not None
                ),
                name=_opt(m, "name"),
                tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
                tool_call_id=_opt(m, "tool_call_id"),
            )
            for m in req.messages.messages
        )
    return GenerationRequest(
        request_id=request_id,
        model=_opt(req, "model") or None,
        text=req.text if which == "text" else None,
        token_ids=tuple(req.token_ids.ids) if which == "token_ids" else None,
        messages=messages,
        sampling=SamplingOptions(**{name: _opt(s, name) for name in _SAMPLING_FIELDS}),
        logit_bias=dict(s.logit_bias),
        bad_words=tuple(s.bad_words),
        stopping=StoppingOptions(
            max_new_tokens=_opt(st, "max_new_tokens"),
            min_new_tokens=_opt(st, "min_new_tokens"),
            stop=tuple(st.stop),
            stop_token_ids=tuple(st.stop_token_ids),
            ignore_eos=_opt(st, "ignore_eos"),
            include_stop_str_in_output=_opt(st, "include_stop_str_in_output"),
            time_limit_ms=_opt(st, "time_limit_ms"),
            truncate_input_tokens=_opt(st, "truncate_input_tokens"),
            fill_context=_opt(st, "fill_context"),
        ),
        output=OutputOptions(
            logprobs=o.logprobs,
            top_logprobs=_opt(o, "top_logprobs"),
            prompt_logprobs=_opt(o, "prompt_logprobs"),
            echo=_opt(o, "echo"),
            skip_special_tokens=_opt(o, "skip_special_tokens"),
            spaces_between_special_tokens=_opt(o, "spaces_between_special_tokens"),
            tokens=_opt(o, "tokens"),
        ),
        session_id=_opt(req, "session_id"),
        session_scope=f"{caller}/{req.tenant}" if caller or req.tenant else "",
        tools=tuple(Tool(t.name, t.description, t.parameters) for t in req.messages.tools)
        if which == "messages"
        else (),
        guide=to_guide(req.guided_decoding) if req.HasField("guided_decoding") else None,
        priority=req.priority,
        tenant=req.tenant if key_tenant is None else key_tenant,
        adapter=req.adapter,
        template=ChatTemplateOptions(
            add_generation_prompt=req.messages.add_generation_prompt
            if req.messages.HasField("add_generation_prompt")
            else True,
            continue_final_message=req.messages.continue_final_message,
            kwargs=req.messages.template_kwargs,
        )
        if which == "messages"
        else DEFAULT_TEMPLATE,
    )


def to_guide(g: pb.GuidedDecoding) -> Guide:
    """A GuidedDecoding message as a Guide. No guide set, or json_object false (which asks for
    nothing), is kind "", which validation refuses."""
    kind = g.WhichOneof("guide") or ""
    if kind == "choice":
        return Guide(kind, choices=tuple(g.choice.choices))
    if kind == "json_object":
        return Guide(kind if g.json_object else "")
    return Guide(kind, spec=getattr(g, kind) if kind else "")


def to_sampling_params(r: ResolvedSampling) -> pb.SamplingParams:
    """Resolved sampling as SamplingParams (fields left None stay unset)."""
    msg = pb.SamplingParams(do_sample=r.do_sample, seed=r.seed, num_beams=r.num_beams)
    for name in (
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "typical_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "length_penalty",
        "early_stopping",
    ):
        value = getattr(r, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def _fill_token(msg: pb.Token, t: TokenInfo) -> None:
    msg.id = t.id
    msg.text = t.text
    msg.bytes = t.bytes
    if t.special:
        msg.special = True
    if t.logprob is not None:
        msg.logprob = t.logprob
    for a in t.top:
        msg.top_logprobs.add(id=a.id, text=a.text, bytes=a.bytes, logprob=a.logprob, special=a.special)


def to_response(delta: ResponseDelta, request_id: str) -> spb.GenerateResponse:
    """Render one pipeline delta as a GenerateResponse."""
    msg = spb.GenerateResponse()
    fill_response(msg, delta, request_id)
    return msg


def fill_response(msg: spb.GenerateResponse, delta: ResponseDelta, request_id: str) -> None:
    """Render one pipeline delta into an empty GenerateResponse (one inside a
    MultiplexGenerateResponse, built in place)."""
    msg.request_id = request_id
    if delta.session_continued:
        msg.session_continued = True
    if delta.prompt_token_count is not None:
        msg.prompt_token_count = delta.prompt_token_count
    if delta.state is not None:
        msg.state = STATES[delta.state]
    if delta.prompt_text is not None:
        msg.prompt_text = delta.prompt_text
    if delta.prompt_tokens:
        for t in delta.prompt_tokens:
            _fill_token(msg.prompt_tokens.add(), t)
    for s in delta.sequences:
        out = msg.outputs.add(index=s.index, text=s.text, stop_sequence=s.stop_sequence)
        for t in s.tokens:
            _fill_token(out.tokens.add(), t)
        if s.finish_reason is not None:
            out.finish_reason = FINISH_REASONS[s.finish_reason]
        if s.stop_token_id is not None:
            out.stop_token_id = s.stop_token_id
        if s.cumulative_logprob is not None:
            out.cumulative_logprob = s.cumulative_logprob
    if delta.final is not None:
        f = delta.final
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=f.usage.prompt_tokens,
                completion_tokens=f.usage.completion_tokens,
                cached_tokens=f.usage.cached_tokens,
            )
        )
        msg.effective_sampling.CopyFrom(to_sampling_params(f.effective))
        if f.seed is not None:
            msg.seed = f.seed
        else:  # the engine cannot reproduce this request's sampling: no seed is promised
            msg.effective_sampling.ClearField("seed")
        msg.timing.CopyFrom(
            pb.Timing(queue_ms=f.timing.queue_ms, prefill_ms=f.timing.prefill_ms, total_ms=f.timing.total_ms)
        )
