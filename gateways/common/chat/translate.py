"""Chat completions <-> the core's Generate contract, as pure functions (data in, data out: no
I/O, so the tables are tested without a server).

Request: `to_generate_request` maps a checked ChatCompletionRequest to a GenerateRequest through
the schema's field table `FIELDS` (the core renders `messages` with the model's own chat
template). Response: `to_chunks` turns one GenerateResponse into `chat.completion.chunk` objects
(streaming), `to_completion` turns a whole stream into one `chat.completion` object,
`usage_chunk` is the `include_usage` chunk. They take the messages of a complete stream:
gateways.common.core_call.CoreCall checks that the final message (the one with usage) came.
Errors: `client_names` gives, through the same table, OpenAI's parameter name for each field
path the core may name.

The finish reasons are a table per schema: `FINISH_REASONS` is OpenAI's; the LMI gateway, which
serves this schema on `/invocations`, passes its own (gateways.lmi.translate.FINISH_REASONS).

Nothing here reads a clock or draws an id: the completion id, `created` and the model name are
passed in, once per request, so every chunk of a request carries the same values.

Where we follow OpenAI rather than the examples of LMI's chat completions schema
(`chat_input_output_schema.md`): `logprobs` is the object `{"content": [...]}` (the examples wrap
it in a list) and `top_logprobs[].token` is the token's text (the examples show a number).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common import reasoning as thinking
from gateways.common.chat import tools, vllm
from gateways.common.chat.schema import ChatCompletionRequest, ImagePart, Message, NamedToolChoice, TextPart
from gateways.common.core_call import incomplete_stream
from gateways.common.fields import Field, FieldTable, by_rule, same_names, true_or_unset
from gateways.common.guided import response_format_guide
from gateways.common.streaming import finish_word

CHUNK_OBJECT = "chat.completion.chunk"
COMPLETION_OBJECT = "chat.completion"

#: OpenAI's finish_reason per core finish reason. A time limit is a spent budget, like
#: max_tokens. CANCELLED (the core aborted the request, e.g. while draining) and ERROR have no
#: OpenAI value; "abort" and "error" are vLLM's.
FINISH_REASONS: dict[int, str] = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_EOS: "stop",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop",
    pb.FINISH_REASON_TIME_LIMIT: "length",
    pb.FINISH_REASON_CANCELLED: "abort",
    pb.FINISH_REASON_ERROR: "error",
}


def stop_list(stop: str | list[str]) -> list[str]:
    """`stop` as a list (OpenAI takes one string or a list)."""
    return [stop] if isinstance(stop, str) else stop


def token_id_keys(bias: dict[str, float]) -> dict[int, float]:
    """`logit_bias` with int token ids (its keys are decimal strings, checked by the schema)."""
    return {int(key): value for key, value in bias.items()}


#: The request fields (seed "Request Schema") and the GenerateRequest paths they set. `by_rule`
#: rows are set by `to_generate_request` itself or only name a path in errors: do_sample
#: follows temperature, n also stands for best_of, any input path is `messages`, a guide comes
#: from the tools (a forced call) or else from response_format.
#: `max_completion_tokens` wins over `max_tokens` (the later row).
FIELDS = FieldTable(
    (
        *by_rule("messages", "messages", "text", "token_ids"),
        Field("model", "model"),
        Field("priority", "priority"),
        *same_names("", "sampling", ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "n")),
        *by_rule("temperature", "sampling.do_sample"),
        *by_rule("n", "sampling.best_of"),
        Field("logit_bias", "sampling.logit_bias", token_id_keys),
        *same_names("", "stopping", ("ignore_eos",)),
        Field("max_tokens", "stopping.max_new_tokens"),
        Field("max_completion_tokens", "stopping.max_new_tokens"),
        Field("stop", "stopping.stop", stop_list),
        *same_names("", "output", ("logprobs", "top_logprobs")),
        *by_rule("tools", "tools", "guided_decoding.json_schema"),
        *by_rule("response_format", "guided_decoding.json_object", "guided_decoding.json_schema"),
        *vllm.FIELDS,
        Field("prompt_logprobs", "output.prompt_logprobs"),
        Field("add_generation_prompt", "messages.add_generation_prompt"),
        Field("continue_final_message", "messages.continue_final_message", true_or_unset),
        Field("chat_template_kwargs", "messages.template_kwargs", json.dumps),
    )
)


def to_generate_request(
    req: ChatCompletionRequest, *, request_id: str, fill_context: bool = False
) -> spb.GenerateRequest:
    """The GenerateRequest for a chat completion request.

    Rules (OpenAI's API and the schema's "Request Schema"): `do_sample` is set explicitly, true
    unless temperature is 0 (OpenAI samples by default; DJL's chat path does the same); an unset
    temperature keeps the engine's default (1.0). `max_completion_tokens` (or else
    `max_tokens`) -> `stopping.max_new_tokens`; both unset leaves it unset (the core's default
    applies). `stop` (a string or a list) -> `stopping.stop`. `logit_bias` keys (decimal
    strings, checked by the schema) become int token ids. `user` has no generation effect and
    is not sent. A "developer" message is sent with the "system" role. `response_format` and a
    tool_choice that forces a call set `guided_decoding` (gateways.common.guided,
    gateways.common.chat.tools); `tools` go to the chat template unless tool_choice is "none"
    (the model is not to call them then). vLLM's extras map through their rows
    (gateways.common.chat.vllm); its guides apply when nothing else constrains the output;
    `stream_options.continuous_usage_stats` asks for tokens (to count them per chunk).

    Args:
        req: a request checked by `schema.parse_chat_request`.
        request_id: the id the core logs and echoes (the completion id).
        fill_context: without max_tokens / max_completion_tokens, ask for the rest of the
            context (`stopping.fill_context`; OpenAI's and vLLM's default) rather than the
            core's default.
    """
    out = spb.GenerateRequest(
        request_id=request_id,
        messages=pb.ChatMessages(messages=[_message(m) for m in req.messages]),
        sampling=pb.SamplingParams(do_sample=req.temperature != 0),
        stopping=pb.StoppingParams(),
        output=pb.OutputOptions(),
    )
    FIELDS.apply(vars(req), out)
    if fill_context and req.max_tokens is None and req.max_completion_tokens is None:
        out.stopping.fill_context = True
    mode = tool_mode(req)
    if mode is not None:
        out.messages.tools.extend(
            pb.Tool(
                name=t.function.name,
                description=t.function.description or "",
                parameters=json.dumps(t.function.parameters) if t.function.parameters is not None else "",
            )
            for t in req.tools or ()
        )
    guide = response_format_guide(req.response_format)
    if mode is not None and mode != "auto":
        functions = [tools.FunctionSpec(t.function.name, t.function.parameters) for t in req.tools or ()]
        guide = tools.tool_guide(mode, functions, name=_named(req), parallel=req.parallel_tool_calls is not False)
    if guide is None:
        guide = vllm.guide(req)  # the schema checked that nothing else constrains the output
    if guide is not None:
        out.guided_decoding.CopyFrom(guide)
    if req.stream and req.stream_options is not None and req.stream_options.continuous_usage_stats:
        out.output.tokens = True  # counted for the usage of each chunk
    return out


def tool_mode(req: ChatCompletionRequest) -> tools.Mode | None:
    """How tool calls are asked for: None without tools or with tool_choice "none"; "auto" when
    tool_choice is unset (OpenAI's default with tools) or "auto"."""
    if not req.tools or req.tool_choice == "none":
        return None
    if isinstance(req.tool_choice, NamedToolChoice):
        return "named"
    return "required" if req.tool_choice == "required" else "auto"


def _named(req: ChatCompletionRequest) -> str | None:
    return req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None


def _message(m: Message) -> pb.ChatMessage:
    msg = pb.ChatMessage(role="system" if m.role == "developer" else m.role)
    if isinstance(m.content, str):
        msg.content.append(pb.ContentPart(text=m.content))
    elif m.content is not None:
        for part in m.content:
            if isinstance(part, ImagePart):
                image = pb.ImageUrl(url=part.image_url.url, detail=part.image_url.detail or "")
                msg.content.append(pb.ContentPart(image_url=image))
            else:
                msg.content.append(pb.ContentPart(text=part.text))
    if m.name is not None:
        msg.name = m.name
    for call in m.tool_calls or ():
        msg.tool_calls.add(id=call.id, name=call.function.name, arguments=call.function.arguments)
    if m.tool_call_id is not None:
        msg.tool_call_id = m.tool_call_id
    return msg


def client_names(req: ChatCompletionRequest | None) -> dict[str, str]:
    """OpenAI's parameter name for each GenerateRequest path the core may name in an error:
    "sampling.temperature" -> "temperature", "stopping.max_new_tokens" -> "max_tokens" or
    "max_completion_tokens" (whichever the request used; max_tokens when neither, or when the
    request did not parse). Paths below `messages` ("messages[1].content") are OpenAI's too
    and are not in the table."""
    given = [name for name, value in req if value is not None] if req is not None else []
    return FIELDS.names(given)


@dataclass
class StreamState:
    """What a response needs across the messages of one Generate stream.

    Attributes:
        completion_id: "chatcmpl-<unique>", the same on every chunk.
        created: Unix seconds, the same on every chunk.
        model: the served model's name.
        finish_words: the schema's finish-reason table (FINISH_REASONS, or LMI's); a finish
            reason without a word in it is an error (streaming.finish_word).
        logprobs: whether the client asked for logprobs.
        include_usage: whether chunks carry `usage` (null until the usage chunk).
        role_sent: choice indexes whose first delta (carrying the role) was sent.
        usage: the final message's usage, once it arrived.
        tool_calls: reads tool calls out of the text (gateways.common.chat.tools), when the
            request has tools and tool_choice is not "none".
        reasoning: the reasoning parser's name (gateways.common.reasoning.PARSERS; the
            gateway's --reasoning-parser), "" for none. With one, the text of each choice is
            split into `reasoning` and `content` before tool calls are read out of the content.
        reasoners: the reasoning parser of each choice, made on its first text.
        continuous_usage: whether every chunk carries the usage so far (vLLM's
            `continuous_usage_stats`, with `include_usage`).
        prompt_count, generated: the prompt's tokens (from the QUEUED message) and the tokens
            generated so far, for that usage.
        echo: text that leads each choice's content (vLLM's chat `echo`), "" for none.
        prompt_logprobs: vLLM's `prompt_logprobs` (alternatives per prompt token), None: none.
        prompt_tokens: the prompt's tokens with logprobs, once they arrived.
    """

    completion_id: str
    created: int
    model: str
    finish_words: Mapping[int, str] = field(default_factory=lambda: FINISH_REASONS)
    logprobs: bool = False
    include_usage: bool = False
    role_sent: set[int] = field(default_factory=set)
    usage: pb.Usage | None = None
    tool_calls: tools.ToolCalls | None = None
    reasoning: str = ""
    reasoners: dict[int, thinking.ReasoningParser] = field(default_factory=dict)
    continuous_usage: bool = False
    prompt_count: int = 0
    generated: int = 0
    echo: str = ""
    prompt_logprobs: int | None = None
    prompt_tokens: list[pb.Token] = field(default_factory=list)

    def plain_text(self, index: int) -> bool:
        """Whether the next texts of choice `index` are content as they come: no reasoning
        parser, or its reasoning section is over (after `</think>`, or an output that did
        not open one), so `split` would give them back unchanged."""
        if not self.reasoning:
            return True
        parser = self.reasoners.get(index)
        return parser is not None and parser.done

    def split(self, index: int, text: str, *, last: bool) -> tuple[str, str]:
        """`(reasoning, content)` of the next text of choice `index` (`last`: the choice ends
        with it); `("", text)` without a reasoning parser."""
        if not self.reasoning:
            return "", text
        parser = self.reasoners.get(index)
        if parser is None:
            parser = self.reasoners[index] = thinking.ReasoningParser.named(self.reasoning)
        reasoning, content = parser.feed(text)
        if last:
            more_reasoning, more_content = parser.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content


def logprobs_content(out: pb.SequenceOutput) -> list[dict[str, Any]]:
    """OpenAI `logprobs.content` entries for the tokens of one SequenceOutput.

    Shape: `{"token": text, "logprob": float, "bytes": [int], "top_logprobs": [{"token",
    "logprob", "bytes"}]}`. The token that ended a sequence on EOS or a stop token id is left
    out, as its text is left out of `content` (the concatenated `bytes` then equal `content`).
    """
    tokens: Iterable[pb.Token] = out.tokens
    if len(out.tokens) and (out.finish_reason == pb.FINISH_REASON_EOS or out.HasField("stop_token_id")):
        tokens = out.tokens[:-1]
    return [
        {
            "token": t.text,
            "logprob": t.logprob if t.HasField("logprob") else None,
            "bytes": list(t.bytes),
            "top_logprobs": [{"token": a.text, "logprob": a.logprob, "bytes": list(a.bytes)} for a in t.top_logprobs],
        }
        for t in tokens
    ]


def prompt_logprobs_list(tokens: Sequence[pb.Token], k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` for the prompt's tokens (the core's `prompt_tokens`): per token
    None for the first (nothing precedes it), else `{token id: {"logprob", "rank",
    "decoded_token"}}` with the token itself first and then its `k` top alternatives, ranked
    1..k (vllm/entrypoints/openai/protocol.py `Logprob`, 0.10/0.11). The token's own rank is
    its place among the alternatives, or null when it is not one of them (the core does not
    count ranks further down)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for t in tokens:
        if not t.HasField("logprob"):
            out.append(None)
            continue
        top = list(t.top_logprobs)[:k]
        rank = next((i for i, a in enumerate(top, 1) if a.id == t.id), None)
        entry = {str(t.id): {"logprob": t.logprob, "rank": rank, "decoded_token": t.text}}
        for i, a in enumerate(top, 1):
            entry.setdefault(str(a.id), {"logprob": a.logprob, "rank": i, "decoded_token": a.text})
        out.append(entry)
    return out


def usage_dict(usage: pb.Usage | None) -> dict[str, Any]:
    """`{"prompt_tokens", "completion_tokens", "total_tokens"}` (seed "Usage"), and
    `"prompt_tokens_details": {"cached_tokens": N}` when N > 0 prompt tokens came from the
    engine's prefix cache (OpenAI's field; vLLM sends it only then too,
    vllm/entrypoints/openai/serving_chat.py, release 0.10/0.11).

    Raises:
        GatewayError: no usage, the final message did not come (streaming.incomplete_stream).
    """
    if usage is None:
        raise incomplete_stream()
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if usage.cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return out


def to_chunks(msg: spb.GenerateResponse, state: StreamState) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` objects for one Generate message (one per choice with news).

    A choice gets a chunk when it has new text, new tokens (with logprobs asked for), or its
    finish_reason. Its first chunk's delta carries `"role": "assistant"`; the chunk that
    finishes it carries `finish_reason` (with the last text, when there is some). Lifecycle-only
    messages give no chunk. The final message's usage is kept in `state.usage` for
    `usage_chunk`. With tools, `state.tool_calls` rewrites the chunks (content and
    `delta.tool_calls` apart, finish_reason "tool_calls"). With a reasoning parser the text is
    split first: `delta.reasoning` (vLLM's field) carries the reasoning, `delta.content` the rest.

    Raises:
        GatewayError: a finish reason without a word in `state.finish_words`.
    """
    if msg.HasField("usage"):
        state.usage = msg.usage
    if msg.HasField("prompt_token_count"):
        state.prompt_count = msg.prompt_token_count
    chunks = []
    for out in msg.outputs:
        state.generated += len(out.tokens)
        reason = finish_word(out.finish_reason, state.finish_words)
        entries = logprobs_content(out) if state.logprobs else []
        reasoning, text = state.split(out.index, out.text, last=reason is not None)
        if not text and not reasoning and not entries and reason is None:
            continue
        delta: dict[str, Any] = {}
        if out.index not in state.role_sent:
            state.role_sent.add(out.index)
            delta = {"role": "assistant", "content": state.echo + text}
        elif text or reason is None:
            delta = {"content": text}
        if reasoning:
            delta["reasoning"] = reasoning
        logprobs = {"content": entries} if state.logprobs else None
        chunks.append(_chunk(state, [_choice(out.index, delta, logprobs, reason)]))
    if state.tool_calls is not None:
        return state.tool_calls.rewrite_chunks(chunks)
    return chunks


def _choice(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, reason: str | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


def step_chunk(state: StreamState, text: str) -> dict[str, Any] | None:
    """The chunk `to_chunks` gives for a plain decode step of choice 0 (a message with `text`
    alone; core_call.Step) of a stream with `plain_deltas`, or None when it has nothing to
    say; the first delta of the choice carries the role. With a reasoning parser the text is
    split as `to_chunks` splits it; once `state.plain_text(0)`, a step's chunk is
    `content_chunk`'s, which a renderer may fill into a template instead."""
    reasoning, text = state.split(0, text, last=False)
    if not text and not reasoning:
        return None
    if 0 in state.role_sent:
        delta: dict[str, Any] = {"content": text}
    else:
        state.role_sent.add(0)
        delta = {"role": "assistant", "content": text}
    if reasoning:
        delta["reasoning"] = reasoning
    return _chunk(state, [_choice(0, delta, None, None)])


def plain_deltas(state: StreamState) -> bool:
    """Whether the stream renders plain decode steps (`step_chunk`): no logprobs to render, no
    tool calls to read out of the text (a call's arguments are parsed from the whole of it),
    no usage per chunk and no echo. A reasoning parser keeps steps: `step_chunk` splits their
    text, and after the reasoning section they are content as they come (`plain_text`)."""
    return not state.logprobs and state.tool_calls is None and not state.continuous_usage and not state.echo


def content_chunk(state: StreamState, index: int, text: str) -> dict[str, Any]:
    """The chunk of a content delta of choice `index` whose role was sent (see `step_chunk`)."""
    return _chunk(state, [_choice(index, {"content": text}, None, None)])


def usage_chunk(state: StreamState) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage` is set: empty choices, usage set.

    Raises:
        GatewayError: the final message was not seen (`usage_dict`).
    """
    chunk = _chunk(state, [])
    chunk["usage"] = usage_dict(state.usage)
    return chunk


def _chunk(state: StreamState, choices: list[dict[str, Any]]) -> dict[str, Any]:
    chunk = {
        "id": state.completion_id,
        "object": CHUNK_OBJECT,
        "created": state.created,
        "model": state.model,
        "choices": choices,
    }
    if state.continuous_usage:
        done = state.generated
        chunk["usage"] = {
            "prompt_tokens": state.prompt_count,
            "completion_tokens": done,
            "total_tokens": state.prompt_count + done,
        }
    elif state.include_usage:
        chunk["usage"] = None  # OpenAI sends null on every chunk but the usage chunk
    return chunk


def to_completion(messages: Iterable[spb.GenerateResponse], state: StreamState) -> dict[str, Any]:
    """The `chat.completion` object for a whole Generate stream (non-streaming response).

    Shape: `{id, object, created, model, choices: [{index, message: {role, content}, logprobs,
    finish_reason}], usage}` (and vLLM's `prompt_logprobs` when asked for), choices in index
    order; with a reasoning parser, `message` also
    has `reasoning` (vLLM's field: the reasoning text, or null). `messages` is a complete stream (its last
    message carries usage), as `gateways.common.streaming.collect` returns it.

    Raises:
        GatewayError: a finish reason without a word in `state.finish_words`.
    """
    text: dict[int, list[str]] = {}
    entries: dict[int, list[dict[str, Any]]] = {}
    reasons: dict[int, str | None] = {}
    for msg in messages:
        if msg.HasField("usage"):
            state.usage = msg.usage
        if msg.prompt_tokens:
            state.prompt_tokens = list(msg.prompt_tokens)
        for out in msg.outputs:
            text.setdefault(out.index, []).append(out.text)
            if state.logprobs:
                entries.setdefault(out.index, []).extend(logprobs_content(out))
            reason = finish_word(out.finish_reason, state.finish_words)
            if reason is not None or out.index not in reasons:
                reasons[out.index] = reason
    choices = [
        {
            "index": i,
            "message": _message_of(state, i, state.echo + "".join(text[i])),
            "logprobs": {"content": entries.get(i, [])} if state.logprobs else None,
            "finish_reason": reasons[i],
        }
        for i in sorted(text)
    ]
    completion = {
        "id": state.completion_id,
        "object": COMPLETION_OBJECT,
        "created": state.created,
        "model": state.model,
        "choices": choices,
        "usage": usage_dict(state.usage),
    }
    if state.prompt_logprobs is not None:
        completion["prompt_logprobs"] = prompt_logprobs_list(state.prompt_tokens, state.prompt_logprobs)
    if state.tool_calls is not None:
        return state.tool_calls.rewrite_completion(completion)
    return completion


def _message_of(state: StreamState, index: int, text: str) -> dict[str, Any]:
    if not state.reasoning:
        return {"role": "assistant", "content": text}
    reasoning, content = state.split(index, text, last=True)
    return {"role": "assistant", "content": content, "reasoning": reasoning or None}


def state_for(
    req: ChatCompletionRequest,
    *,
    completion_id: str,
    created: int,
    model: str,
    finish_words: Mapping[int, str] = FINISH_REASONS,
    reasoning: str = "",
) -> StreamState:
    """A StreamState for a checked request (logprobs, include_usage and tool calls taken from it;
    `reasoning`: the reasoning parser's name, "" for none)."""
    mode = tool_mode(req)
    ended = frozenset(
        finish_words[r] for r in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_STOP_SEQUENCE) if r in finish_words
    )
    return StreamState(
        completion_id=completion_id,
        created=created,
        model=model,
        finish_words=finish_words,
        logprobs=bool(req.logprobs),
        include_usage=bool(req.stream) and req.include_usage,
        tool_calls=tools.ToolCalls(mode, completion_id, _named(req), ended) if mode is not None else None,
        reasoning=reasoning,
        continuous_usage=bool(req.stream and req.stream_options and req.stream_options.continuous_usage_stats)
        and req.include_usage,
        echo=_echo(req),
        prompt_logprobs=req.prompt_logprobs,
    )


def _echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the final message's text when it is the assistant's (the reply's
    role), else nothing."""
    last = req.messages[-1] if req.messages else None
    if not req.echo or last is None or last.role != "assistant":
        return ""
    if isinstance(last.content, str):
        return last.content
    return "".join(p.text for p in last.content or () if isinstance(p, TextPart))
