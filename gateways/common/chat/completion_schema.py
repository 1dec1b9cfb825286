"""Wire model of OpenAI's legacy completions request, `POST /v1/completions`.

The field table is the openai SDK's `CompletionCreateParams` (openai-python 3.x,
`src/openai/types/completion_create_params.py`), checked with the chat route's rules
(gateways.common.chat.schema): strict JSON types, OpenAI's own narrower ranges (temperature <=
2), unknown fields refused with the field named, general ranges (the number of stop strings
included) left to the core. `prompt` is a string, a list of strings, a list of token ids or a list of token-id
lists; each prompt is one request to the core.

Refused with the field named: `suffix` (insertion needs a fill-in-the-middle model), and
`prompt_logprobs` with `stream` (vLLM refuses it too: the prompt's logprobs are not streamed).

Prompt scoring, as vLLM serves it (vllm/entrypoints/openai/serving_completion.py, 0.10/0.11):
`echo` with `logprobs` renders the prompt's tokens before the generated ones in `logprobs`;
`max_tokens: 0` with `echo` scores the prompt without generating (lm-eval's loglikelihood
requests); `prompt_logprobs: k` (vLLM's extension) adds the per-choice `prompt_logprobs` list.

`parse_completion_request(body)` is the entry point; it raises GatewayError
(INVALID_ARGUMENT) with `param` set to the offending field.
"""

from __future__ import annotations

from typing import Annotated, Any

import grpc
from pydantic import Field, ValidationError, field_validator

from gateways.common.chat import vllm
from gateways.common.chat.schema import (
    IGNORED_FIELDS,
    MAX_TEMPERATURE,
    StreamOptions,
    Wire,
    check_logit_bias,
    to_gateway_error,
)
from gateways.common.guided import ResponseFormat
from gateways.common.schema import Int32, Int64, screen_fields
from gateways.common.status import GatewayError

_INVALID = grpc.StatusCode.INVALID_ARGUMENT

#: OpenAI's default `max_tokens` for completions (the chat route leaves it to the core).
DEFAULT_MAX_TOKENS = 16

#: A prompt: text, token ids, or a batch of either.
Prompt = str | list[str] | list[Int32] | list[list[Int32]]


class CompletionRequest(vllm.VllmExtras, Wire):
    """A completions request body (openai SDK `CompletionCreateParams`), with vLLM's extras
    (gateways.common.chat.vllm) and its completions-only ones: `prompt_logprobs`,
    `response_format` (as on chat).

    Unset fields are None (the core's engine defaults apply), except `max_tokens`
    (DEFAULT_MAX_TOKENS, OpenAI's) and sampling, which is on unless temperature is 0.
    `logprobs` is the number of alternatives per token (0: the chosen token's logprob only).
    """

    prompt: Prompt
    model: str | None = None
    best_of: Int32 | None = None
    echo: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    max_tokens: Int32 | None = None
    n: Int32 | None = None
    seed: Int64 | None = None
    # vLLM's extension: the scheduling priority, lower first (the core's --scheduling-policy).
    priority: Int32 | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: Annotated[float, Field(le=MAX_TEMPERATURE, ge=0.0)] | None = None
    top_p: float | None = None
    user: str | None = None
    ignore_eos: bool | None = None
    response_format: ResponseFormat | None = None

    _logit_bias = field_validator("logit_bias")(check_logit_bias)

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per core request, in order (choice index = prompt * n + index)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [[x for x in p if isinstance(x, int)]]
        return [x for x in p if isinstance(x, str | list)]

    @property
    def score_only(self) -> bool:
        """Whether the prompt is scored without generating (`echo` with `max_tokens: 0`, vLLM's
        rule); the core then generates one token, which the response leaves out."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def prompt_alternatives(self) -> int | None:
        """Alternatives per prompt token the core is asked for: the larger of `prompt_logprobs`
        and, with `echo`, `logprobs`; None: the prompt's logprobs are not needed."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


def parse_completion_request(body: Any) -> CompletionRequest:
    """Check a parsed JSON body and return it as a CompletionRequest.

    Raises:
        GatewayError: INVALID_ARGUMENT, `param` naming the field, `reason` UNKNOWN_PARAMETER,
            UNSUPPORTED_PARAMETER or INVALID_ARGUMENT.
    """
    checked = screen_fields(
        body,
        CompletionRequest.model_fields,
        ignored=IGNORED_FIELDS | vllm.IGNORED,
        unsupported=_UNSUPPORTED,
        neutral=_neutral,
    )
    if "prompt" not in checked:
        raise GatewayError.invalid("Missing required parameter: 'prompt'.", param="prompt")
    try:
        req = CompletionRequest.model_validate(checked)
    except ValidationError as e:
        raise to_gateway_error(e) from None
    if isinstance(req.prompt, list) and (not req.prompt or any(x == [] for x in req.prompt)):
        raise GatewayError.invalid("The prompt must not be an empty list.", param="prompt")
    if req.suffix:
        raise _unsupported("suffix", "inserting text before a suffix is not supported")
    if req.prompt_logprobs is not None and req.stream:
        raise GatewayError.invalid(
            "The parameter 'prompt_logprobs' is not available when 'stream' is true.", param="prompt_logprobs"
        )
    guided = vllm.guide(req) is not None  # two guides are refused here
    if guided and req.response_format is not None and req.response_format.type != "text":
        given = next(name for name in (*vllm.VLLM_GUIDES, "structured_outputs") if getattr(req, name) is not None)
        raise GatewayError.invalid(
            f"{given} cannot be combined with a response_format: both would constrain the output.", param=given
        )
    if req.stream_options is not None and not req.stream:
        raise GatewayError.invalid(
            "The parameter 'stream_options' is only allowed when 'stream' is true.", param="stream_options"
        )
    return req


#: vLLM's parameters the core cannot honour (add_special_tokens false: the core always adds
#: the tokenizer's special tokens to a text prompt; true is vLLM's default for completions).
_UNSUPPORTED = {
    **vllm.UNSUPPORTED,
    "add_special_tokens": "leaving out the tokenizer's special tokens is not supported; send token ids",
}


def _neutral(name: str, value: Any) -> bool:
    if name == "add_special_tokens":
        return value is None or value is True
    return vllm.neutral(name, value)


def _unsupported(name: str, why: str) -> GatewayError:
    return GatewayError(
        _INVALID,
        f"The parameter '{name}' is not supported by this server: {why}.",
        param=name,
        reason="UNSUPPORTED_PARAMETER",
    )
