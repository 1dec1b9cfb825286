"""Wire models of the WebSocket `/ws` batch protocol (docs/websocket.md; its origin is
alexandriaproject-io/llm-inference).

A client text frame is one JSON object `{prompts: [{request_id, prompt}], only_new_tokens,
stream_response, generation_config}`. This module checks JSON shapes and types only:
value ranges are the core's, checked once for every schema. A frame is accepted whole or refused whole;
`parse_frame` raises a GatewayError whose message names the offending field
(`prompts[2].request_id: must be a string`), which routes.py sends back as `[{"error": ...}]`.

Unknown keys are refused rather than ignored, so that a sampling option this protocol does not
carry (`seed`, `stop`, ...) is never silently dropped.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateways.common.framing import MAX_JSON_DEPTH, loads
from gateways.common.schema import Int32, field_path
from gateways.common.status import GatewayError


class GenerationConfig(BaseModel):
    """`generation_config` (seed "generation_config"): each field unset (absent or null) takes
    the gateway's ".env" default, else the core's engine default.

    Attributes:
        num_beams: beam-search width (the HF engine serves only 1).
        do_sample: sample (true) or greedy (false).
        temperature: softmax temperature.
        top_p: nucleus sampling mass.
        top_k: keep the k most likely tokens (0 disables).
        max_new_tokens: new tokens per prompt (per request, for a continued session).
        repetition_penalty: multiplicative penalty on repeated tokens (1 disables).
        length_penalty: beam-search length penalty (only 1 without beam search).
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    num_beams: Int32 | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    max_new_tokens: Int32 | None = None
    repetition_penalty: float | None = None
    length_penalty: float | None = None


class PromptItem(BaseModel):
    """One entry of `prompts` (seed "prompts").

    Attributes:
        request_id: non-empty id; names the prompt's events and is its continue-generation key.
        prompt: raw prompt text; ignored when the core holds a session for request_id. An empty
            prompt is allowed only to continue a session.
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    request_id: Annotated[str, Field(min_length=1)]
    prompt: str


class WsRequest(BaseModel):
    """A batch frame (seed "Queue generation payload").

    Attributes:
        prompts: one or more prompts with distinct request_ids.
        only_new_tokens: texts without (true, default) or with (false) the prompt in front.
        stream_response: send PROGRESS events (true, default).
        generation_config: per-batch generation settings (None: all defaults).
        priority: scheduling priority of the batch's prompts, lower first (the core's
            --scheduling-policy priority; None: 0).
        model: the served model's name or one of its LoRA adapters' (vLLM's convention: the
            adapter is chosen by model name); None: the served model.
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    model: Annotated[str, Field(min_length=1)] | None = None
    prompts: Annotated[list[PromptItem], Field(min_length=1)]
    only_new_tokens: bool | None = None
    stream_response: bool | None = None
    generation_config: GenerationConfig | None = None
    priority: Int32 | None = None

    @property
    def new_tokens_only(self) -> bool:
        """only_new_tokens with its default (true) applied."""
        return self.only_new_tokens is not False

    @property
    def streaming(self) -> bool:
        """stream_response with its default (true) applied."""
        return self.stream_response is not False


# pydantic error types -> the phrase a client reads after the field path.
_PHRASES = {
    "missing": "is required",
    "extra_forbidden": "is not a field of this protocol",
    "string_type": "must be a string",
    "string_too_short": "must not be empty",
    "bool_type": "must be true or false",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "list_type": "must be an array",
    "too_short": "must not be empty",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "dict_type": "must be an object",
    "greater_than_equal": "must fit in a 32-bit signed integer",
    "less_than_equal": "must fit in a 32-bit signed integer",
}


def first_error(error: ValidationError) -> tuple[str, str]:
    """The first offending field's path and what is wrong with it, e.g.
    `("prompts[0].prompt", "must be a string")`."""
    first = error.errors(include_url=False)[0]
    return field_path(first["loc"]), _PHRASES.get(first["type"], first["msg"])


def parse_frame(text: str, *, max_prompts: int, max_depth: int = MAX_JSON_DEPTH) -> WsRequest:
    """Parse and shape-check one text frame.

    Args:
        text: the frame's payload.
        max_prompts: most prompts accepted in one frame (gateway option).
        max_depth: deepest nesting of arrays and objects (--max-json-depth).

    Raises:
        GatewayError: INVALID_ARGUMENT for a frame that is not JSON, not an object of this
            protocol's shape, has more than `max_prompts` prompts, or repeats a request_id.
    """
    obj = loads(text, what="The frame", max_depth=max_depth)
    if not isinstance(obj, dict):
        raise GatewayError.invalid("The frame must be a JSON object with a 'prompts' array.")
    try:
        req = WsRequest.model_validate(obj)
    except ValidationError as e:
        path, phrase = first_error(e)
        raise GatewayError.invalid(f"{path}: {phrase}." if path else f"{phrase}.", param=path or None) from None
    if len(req.prompts) > max_prompts:
        raise GatewayError.invalid(
            f"prompts: the batch has {len(req.prompts)} prompts; at most {max_prompts} are accepted per frame.",
            param="prompts",
        )
    seen: set[str] = set()
    for i, item in enumerate(req.prompts):
        if item.request_id in seen:
            raise GatewayError.invalid(
                f"prompts[{i}].request_id: '{item.request_id}' appears more than once in the batch; "
                "request_ids must be distinct.",
                param=f"prompts[{i}].request_id",
            )
        seen.add(item.request_id)
    return req
