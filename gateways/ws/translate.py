"""Pure translation between the `/ws` protocol and the core's Generate stream.

Request side: one GenerateRequest per prompt (`to_generate_request`, through the schema's field
table `FIELDS`), with `session_id` set to the prompt's request_id so that the core continues a
live session ("continue generation", docs/architecture.md "Sessions"). Default precedence (written down
once): a `generation_config` field the client set > the gateway's ".env" default > unset (the
core's engine default).

Response side: the core's lifecycle markers map 1:1 to the seed's events (docs/architecture.md "The gRPC
contract"): QUEUED -> ACCEPTED, SCHEDULED -> STARTED, PREFILLED -> INITIALIZED. Every message
whose text delta is non-empty gives one PROGRESS event (when stream_response); a message whose
delta is empty (the core holds back an incomplete UTF-8 character or a special token it leaves
out) gives none, so the PROGRESS texts always concatenate to the generated text. COMPLETE is
built from the final message (the one carrying `usage`) by `to_complete`, which the route calls
once the call has ended cleanly (gateways.common.core_call.CoreCall checks that the final
message came). A sequence the core cancelled or failed is an ERROR (the protocol has no finish
reason for it).

No I/O, clocks or ids in here: the route owns the socket and passes `PromptState` in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.core_call import incomplete_stream
from gateways.common.fields import FieldTable, by_rule, same_names
from gateways.common.streaming import sequence_error
from gateways.ws.schema import GenerationConfig, PromptItem, WsRequest

ACCEPTED = "ACCEPTED"
STARTED = "STARTED"
INITIALIZED = "INITIALIZED"
PROGRESS = "PROGRESS"
COMPLETE = "COMPLETE"
ERROR = "ERROR"

_STATE_EVENTS = {
    pb.GENERATE_STATE_QUEUED: ACCEPTED,
    pb.GENERATE_STATE_SCHEDULED: STARTED,
    pb.GENERATE_STATE_PREFILLED: INITIALIZED,
}

#: The protocol's fields (seed "generation_config", "prompts") and the GenerateRequest paths
#: they set; the prompt, request_id and only_new_tokens are set by `to_generate_request`.
FIELDS = FieldTable(
    (
        *same_names(
            "generation_config.",
            "sampling",
            ("num_beams", "do_sample", "temperature", "top_p", "top_k", "repetition_penalty", "length_penalty"),
        ),
        *same_names("generation_config.", "stopping", ("max_new_tokens",)),
        *by_rule("prompt", "text"),
        *by_rule("request_id", "session_id", "request_id"),
        *by_rule("priority", "priority"),
    )
)

#: Contract path -> this protocol's name, for ERROR texts (every field is always named the same).
NAMES = FIELDS.names()


def effective_config(given: GenerationConfig | None, defaults: GenerationConfig) -> Mapping[str, Any]:
    """Field name -> the client's value if set, else the default's (None: unset in both)."""
    fallback = vars(defaults)
    if given is None:
        return fallback
    return {name: fallback[name] if value is None else value for name, value in vars(given).items()}


def to_generate_request(
    body: WsRequest, item: PromptItem, defaults: GenerationConfig, tenant: str = ""
) -> spb.GenerateRequest:
    """The Generate call for one prompt of a batch.

    `request_id` and `session_id` are both the prompt's request_id (the seed: "also used for
    internal caching"), the session scoped to `tenant`, the client's tenant
    (gateways.common.tenant). An empty prompt leaves the input unset: it
    can only continue a session, and the core says so when there is none. only_new_tokens
    false asks the core to echo the input sequence (`prompt_text`), which is the prompt, or
    for a continued session everything generated so far.
    """
    cfg = effective_config(body.generation_config, defaults)
    req = spb.GenerateRequest(request_id=item.request_id, session_id=item.request_id, tenant=tenant)
    if body.model is not None:
        req.model = body.model  # the core takes an adapter's name as that adapter
    if item.prompt:
        req.text = item.prompt
    FIELDS.apply(cfg, req)
    if body.priority is not None:
        req.priority = body.priority
    if not body.new_tokens_only:
        req.output.echo = True
    return req


@dataclass(slots=True)
class PromptState:
    """What one prompt's stream has produced so far (owned by the route, one per prompt).

    Attributes:
        request_id: the prompt's request_id.
        only_new_tokens: COMPLETE/INITIALIZED texts without the input sequence.
        stream_response: emit PROGRESS events.
        prompt: the prompt as the client sent it (for error texts).
        input_text: the core's `prompt_text` (the whole input sequence), when echoed.
        parts: text deltas received, in order.
        finish_reason: the sequence's finish reason once known.
        final: the final message (has `usage`), once received.
    """

    request_id: str
    only_new_tokens: bool = True
    stream_response: bool = True
    prompt: str = ""
    input_text: str = ""
    parts: list[str] = field(default_factory=list)
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
    final: spb.GenerateResponse | None = None

    @classmethod
    def start(cls, body: WsRequest, item: PromptItem) -> PromptState:
        """The initial state of a prompt of `body`."""
        return cls(item.request_id, body.new_tokens_only, body.streaming, item.prompt)


def to_events(msg: spb.GenerateResponse, state: PromptState) -> list[dict[str, Any]]:
    """Events for one Generate message (lifecycle and PROGRESS; never COMPLETE), updating `state`.

    Raises:
        GatewayError: the core cancelled the sequence (UNAVAILABLE) or failed it (INTERNAL);
            see gateways.common.streaming.sequence_error.
    """
    if msg.HasField("prompt_text"):
        state.input_text = msg.prompt_text
    events: list[dict[str, Any]] = []
    kind = _STATE_EVENTS.get(msg.state)
    if kind == INITIALIZED:
        text = "" if state.only_new_tokens else state.input_text
        events.append({"request_id": state.request_id, "type": INITIALIZED, "text": text})
    elif kind is not None:
        events.append({"request_id": state.request_id, "type": kind})
    for out in msg.outputs:
        if out.index != 0:  # the protocol has no n; the core never sends other indexes here
            continue
        if out.text:
            state.parts.append(out.text)
            if state.stream_response:
                events.append(progress_event(state, out.text))
        if out.finish_reason:
            if (err := sequence_error(out.finish_reason)) is not None:
                raise err
            state.finish_reason = out.finish_reason
    if msg.HasField("usage"):
        state.final = msg
    return events


def step_progress(text: str, state: PromptState) -> str | None:
    """What `to_events` does with a plain decode step (core_call.Step: a message with `text`
    alone for sequence 0): the text joins `state.parts`; returns the text of its PROGRESS event,
    or None for an empty text or a prompt that is not streamed."""
    if not text:
        return None
    state.parts.append(text)
    return text if state.stream_response else None


def progress_event(state: PromptState, text: str) -> dict[str, Any]:
    """The PROGRESS event of a text delta (seed "Type PROGRESS")."""
    return {"request_id": state.request_id, "type": PROGRESS, "text": text}


def to_complete(state: PromptState) -> dict[str, Any]:
    """The COMPLETE event (seed "Type COMPLETE") of a prompt whose call ended cleanly, so
    `state.final` is set.

    `text` is the generated text (only_new_tokens) or the input sequence followed by it;
    `new_tokens_count` is usage.completion_tokens; `is_eos` is finish_reason EOS;
    `execution_time` is the core's timing.total_ms in seconds (arrival at the core to the final
    message, which excludes the gateway hop).

    Raises:
        GatewayError: INTERNAL when the final message never came (streaming.incomplete_stream).
    """
    final = state.final
    if final is None:
        raise incomplete_stream()
    generated = "".join(state.parts)
    return {
        "request_id": state.request_id,
        "type": COMPLETE,
        "text": generated if state.only_new_tokens else state.input_text + generated,
        "is_eos": state.finish_reason == pb.FINISH_REASON_EOS,
        "new_tokens_count": final.usage.completion_tokens,
        "execution_time": round(final.timing.total_ms / 1000.0, 6),
    }
