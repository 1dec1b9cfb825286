"""OpenAI legacy completions <-> the core's Generate contract, as pure functions.

Request: `to_generate_requests` maps a checked CompletionRequest to one GenerateRequest per
prompt through the field table `FIELDS`. Response: `to_chunks` turns one prompt's Generate
message into `text_completion` chunks (streaming), `to_completion` turns the complete streams of
every prompt into one `text_completion` object, `usage_chunk` is the `include_usage` chunk.

Shapes are the openai SDK's (openai-python 3.x `src/openai/types/completion.py`,
`completion_choice.py`, `completion_usage.py`): `{id, object: "text_completion", created,
model, choices: [{index, text, logprobs, finish_reason}], usage}`; streamed chunks have the same
shape (finish_reason null until a choice ends, `usage` null on every chunk but the usage chunk
when `stream_options.include_usage` is set). Choice `index` is `prompt * n + sequence`, as
OpenAI and vLLM number the choices of a prompt list. `logprobs` is `{tokens, token_logprobs,
top_logprobs, text_offset}`: the token texts, their logprobs, per token a map of the top
alternatives' texts to logprobs, and each token's character offset in the choice's text.
With `echo`, the prompt's tokens lead them (the first with a null logprob and null
alternatives, as OpenAI's legacy engines rendered it); with `max_tokens: 0` they are all there
is (vLLM's prompt scoring). `prompt_logprobs` (vLLM's extension) adds each choice's
`prompt_logprobs` list (`chat.translate.prompt_logprobs_list`).
Finish reasons are the chat route's (`chat.translate.FINISH_REASONS`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.chat import vllm
from gateways.common.chat.completion_schema import DEFAULT_MAX_TOKENS, CompletionRequest
from gateways.common.chat.translate import (
    FINISH_REASONS,
    logprobs_content,
    prompt_logprobs_list,
    stop_list,
    token_id_keys,
    usage_dict,
)
from gateways.common.fields import Field, FieldTable, by_rule, same_names, true_or_unset
from gateways.common.guided import response_format_guide
from gateways.common.streaming import finish_word

OBJECT = "text_completion"


#: The request fields and the GenerateRequest paths they set. `by_rule` rows are set by
#: `to_generate_requests` itself: the prompt (text or token ids), do_sample (follows
#: temperature), output.logprobs (set when `logprobs` is given).
FIELDS = FieldTable(
    (
        *by_rule("prompt", "text", "token_ids"),
        Field("model", "model"),
        Field("priority", "priority"),
        *same_names(
            "", "sampling", ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "n", "best_of")
        ),
        *by_rule("temperature", "sampling.do_sample"),
        Field("logit_bias", "sampling.logit_bias", token_id_keys),
        *same_names("", "stopping", ("ignore_eos",)),
        Field("max_tokens", "stopping.max_new_tokens"),
        Field("stop", "stopping.stop", stop_list),
        *by_rule("logprobs", "output.logprobs"),
        Field("logprobs", "output.top_logprobs"),
        Field("echo", "output.echo", true_or_unset),
        *by_rule("prompt_logprobs", "output.prompt_logprobs"),
        *by_rule("response_format", "guided_decoding.json_object", "guided_decoding.json_schema"),
        *vllm.FIELDS,
    )
)


def to_generate_requests(req: CompletionRequest, *, completion_id: str) -> list[spb.GenerateRequest]:
    """One GenerateRequest per prompt (request ids `<completion_id>-<prompt index>`).

    Rules: `do_sample` is true unless temperature is 0 (OpenAI samples by default);
    `max_tokens` unset is OpenAI's 16; `logprobs: k` asks for logprobs with k alternatives;
    `echo` asks for the prompt's text (`prompt_text`), and with `logprobs` for the prompt's
    logprobs too (`prompt_logprobs`, as does vLLM's `prompt_logprobs`); `max_tokens: 0` with
    `echo` asks for one token, which the response leaves out (the core generates at least one).
    """
    base = spb.GenerateRequest(
        sampling=pb.SamplingParams(do_sample=req.temperature != 0),
        stopping=pb.StoppingParams(max_new_tokens=DEFAULT_MAX_TOKENS),
        output=pb.OutputOptions(logprobs=req.logprobs is not None),
    )
    FIELDS.apply(vars(req), base)
    if req.prompt_alternatives is not None:
        base.output.prompt_logprobs = req.prompt_alternatives
    if req.score_only:
        base.stopping.max_new_tokens = 1
    guide = response_format_guide(req.response_format) or vllm.guide(req)  # the schema allows one
    if guide is not None:
        base.guided_decoding.CopyFrom(guide)
    if req.stream and req.stream_options is not None and req.stream_options.continuous_usage_stats:
        base.output.tokens = True  # counted for the usage of each chunk
    out = []
    for i, prompt in enumerate(req.prompts):
        one = spb.GenerateRequest()
        one.CopyFrom(base)
        one.request_id = f"{completion_id}-{i}"
        if isinstance(prompt, str):
            one.text = prompt
        else:
            one.token_ids.ids.extend(prompt)
        out.append(one)
    return out


def client_names(req: CompletionRequest | None) -> dict[str, str]:
    """OpenAI's parameter name for each GenerateRequest path the core may name in an error."""
    given = [name for name, value in req if value is not None] if req is not None else []
    return FIELDS.names(given)


@dataclass
class CompletionState:
    """What a response needs across the messages of its Generate streams.

    Attributes:
        completion_id, created, model: the same on every chunk.
        n: choices per prompt (choice index = prompt * n + sequence index).
        logprobs: the alternatives per token the client asked for (`logprobs`), None: none.
        include_usage: whether chunks carry `usage`.
        echo_logprobs: whether the prompt's tokens lead each choice's logprobs (`echo`).
        prompt_logprobs: vLLM's `prompt_logprobs` (alternatives per prompt token), None: none.
        score_only: the generated token is left out (`echo` with `max_tokens: 0`).
        echo: prompt index -> its text while it waits to lead each of its choices' text.
        prompt_tokens: prompt index -> its tokens with logprobs, once they arrived.
        continuous_usage: whether every chunk carries the usage so far, summed over the
            prompts (vLLM's `continuous_usage_stats`, with `include_usage`).
        prompt_counts: prompt index -> its prompt tokens (from its QUEUED message).
        generated: the tokens generated so far, over every prompt.
        started: choice indexes whose first chunk was sent.
        offsets: choice index -> characters of its text so far (logprobs' text_offset).
        usage: prompt index -> its final usage, once it arrived.
    """

    completion_id: str
    created: int
    model: str
    n: int = 1
    logprobs: int | None = None
    include_usage: bool = False
    echo_logprobs: bool = False
    prompt_logprobs: int | None = None
    score_only: bool = False
    echo: dict[int, str] = field(default_factory=dict)
    prompt_tokens: dict[int, list[pb.Token]] = field(default_factory=dict)
    continuous_usage: bool = False
    prompt_counts: dict[int, int] = field(default_factory=dict)
    generated: int = 0
    started: set[int] = field(default_factory=set)
    offsets: dict[int, int] = field(default_factory=dict)
    usage: dict[int, pb.Usage] = field(default_factory=dict)


def state_for(req: CompletionRequest, *, completion_id: str, created: int, model: str) -> CompletionState:
    """A CompletionState for a checked request."""
    return CompletionState(
        completion_id=completion_id,
        created=created,
        model=model,
        n=req.n or 1,
        logprobs=req.logprobs,
        include_usage=bool(req.stream) and req.include_usage,
        echo_logprobs=bool(req.echo) and req.logprobs is not None,
        prompt_logprobs=req.prompt_logprobs,
        score_only=req.score_only,
        continuous_usage=bool(req.stream and req.stream_options and req.stream_options.continuous_usage_stats)
        and req.include_usage,
    )


def _logprobs(out: pb.SequenceOutput, offset: int) -> dict[str, Any]:
    """The completions `logprobs` object of one SequenceOutput's tokens, offsets from `offset`."""
    entries = logprobs_content(out)
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def _prompt_logprobs(tokens: list[pb.Token], k: int) -> dict[str, Any]:
    """The completions `logprobs` object of the prompt's tokens (offsets from 0, `k`
    alternatives each); the first token has neither a logprob nor alternatives (OpenAI's legacy
    shape: `null`)."""
    offsets = []
    offset = 0
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob if t.HasField("logprob") else None for t in tokens],
        "top_logprobs": [
            {a.text: a.logprob for a in list(t.top_logprobs)[:k]} if t.HasField("logprob") else None for t in tokens
        ],
        "text_offset": offsets,
    }


def _choices(
    prompt: int, msg: spb.GenerateResponse, state: CompletionState, *, final_only: bool
) -> list[dict[str, Any]]:
    """The choices one message gives (those with text, tokens or their end)."""
    if msg.HasField("usage"):
        state.usage[prompt] = msg.usage
    if msg.HasField("prompt_text"):
        state.echo[prompt] = msg.prompt_text
    if msg.prompt_tokens:
        state.prompt_tokens[prompt] = list(msg.prompt_tokens)
    if msg.HasField("prompt_token_count"):
        state.prompt_counts[prompt] = msg.prompt_token_count
    choices = []
    for out in msg.outputs:
        state.generated += len(out.tokens)
        index = prompt * state.n + out.index
        if state.score_only:  # the token generated is not the client's: its end is the budget's
            generated = out.finish_reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_STOP_SEQUENCE)
            ended = pb.FINISH_REASON_LENGTH if generated else out.finish_reason
            out = pb.SequenceOutput(index=out.index, finish_reason=ended)
        reason = finish_word(out.finish_reason, FINISH_REASONS)
        text = out.text
        first = index not in state.started
        if first:
            state.started.add(index)
            text = state.echo.get(prompt, "") + text
            state.offsets[index] = len(text) - len(out.text)
            if state.echo_logprobs:  # offsets go on from the prompt's tokens (their texts may not spell it)
                state.offsets[index] = sum(len(t.text) for t in state.prompt_tokens.get(prompt, []))
        offset = state.offsets[index]
        logprobs = _logprobs(out, offset) if state.logprobs is not None else None
        if logprobs is not None and first and state.echo_logprobs:
            logprobs = _joined(_prompt_logprobs(state.prompt_tokens.get(prompt, []), state.logprobs or 0), logprobs)
        state.offsets[index] = offset + len(out.text)
        if not text and not (logprobs and logprobs["tokens"]) and reason is None and not final_only:
            continue
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if first and state.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_list(state.prompt_tokens.get(prompt, []), state.prompt_logprobs)
        choices.append(choice)
    return choices


def _joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two completions `logprobs` objects one after the other."""
    return {key: first[key] + then[key] for key in first}


def to_chunks(prompt: int, msg: spb.GenerateResponse, state: CompletionState) -> list[dict[str, Any]]:
    """The `text_completion` chunks for one message of prompt `prompt`'s stream (one chunk per
    choice with news; none for lifecycle-only messages).

    Raises:
        GatewayError: a finish reason without an OpenAI word.
    """
    return [_chunk(state, [choice]) for choice in _choices(prompt, msg, state, final_only=False)]


def usage_chunk(state: CompletionState, prompts: int) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage` is set: empty choices, usage summed
    over the prompts.

    Raises:
        GatewayError: a prompt's final message was not seen.
    """
    chunk = _chunk(state, [])
    chunk["usage"] = _usage(state, prompts)
    return chunk


def _usage(state: CompletionState, prompts: int) -> dict[str, Any]:
    """`usage_dict` summed over the prompts (cached tokens too)."""
    total: dict[str, Any] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cached = 0
    for i in range(prompts):
        one = usage_dict(state.usage.get(i))
        if state.score_only:
            one["total_tokens"] -= one["completion_tokens"]
            one["completion_tokens"] = 0
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            total[key] += one[key]
        cached += one.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    if cached:
        total["prompt_tokens_details"] = {"cached_tokens": cached}
    return total


def _chunk(state: CompletionState, choices: list[dict[str, Any]]) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": state.completion_id,
        "object": OBJECT,
        "created": state.created,
        "model": state.model,
        "choices": choices,
    }
    if state.continuous_usage:
        prompt = sum(state.prompt_counts.values())
        chunk["usage"] = {
            "prompt_tokens": prompt,
            "completion_tokens": state.generated,
            "total_tokens": prompt + state.generated,
        }
    elif state.include_usage:
        chunk["usage"] = None
    return chunk


def to_completion(streams: Sequence[Iterable[spb.GenerateResponse]], state: CompletionState) -> dict[str, Any]:
    """The `text_completion` object for the complete streams of every prompt, in prompt order.

    Raises:
        GatewayError: a finish reason without an OpenAI word, or a stream without its final
            message.
    """
    merged: dict[int, dict[str, Any]] = {}
    for prompt, messages in enumerate(streams):
        for msg in messages:
            for choice in _choices(prompt, msg, state, final_only=True):
                into = merged.get(choice["index"])
                if into is None:
                    merged[choice["index"]] = choice
                    continue
                into["text"] += choice["text"]
                into["finish_reason"] = choice["finish_reason"] or into["finish_reason"]
                if into["logprobs"] is not None:
                    for key, values in choice["logprobs"].items():
                        into["logprobs"][key] += values
    return {
        "id": state.completion_id,
        "object": OBJECT,
        "created": state.created,
        "model": state.model,
        "choices": [merged[i] for i in sorted(merged)],
        "usage": _usage(state, len(streams)),
    }
