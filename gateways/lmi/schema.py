"""LMI wire models: the request shapes of DJL-Serving's `/invocations` and `/predictions/{model}`.

Source: DJL-Serving's `lmi_input_output_schema.md` ("Rolling Batch/Continuous Batch Schema", "Dynamic
Batch/Static Batch Schema", "GenerationParameters" with the LMI-Dist, vLLM and TensorRT-LLM
additions), plus the fields of TGI's `GenerateParameters` (text-generation-inference
router/src/lib.rs) that LMI lacks (`stop` as a list, `watermark`, `grammar`, `adapter_id`), so one
model serves DJL's routes and TGI's (gateways.lmi.tgi_routes).

Only JSON shapes and types are checked here (strict: `"1"` is not an integer, `1` is not a
boolean, an integer is accepted where a float is expected). Value ranges and cross-field rules
belong to the core, which checks them once for every schema. Unknown keys are refused rather than ignored, so a
parameter we do not know is never silently dropped. Every shape or type problem raises
`PayloadError`, which the LMI schema answers with 424 `{"error", "code": 424}`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateways.common.schema import Int32, Int64, field_path, json_type
from gateways.lmi.errors import PayloadError

M = TypeVar("M", bound=BaseModel)


class GenerationParameters(BaseModel):
    """`parameters` of an LMI request (seed "GenerationParameters").

    Every field is optional; None (absent or JSON null) means "not given", so the core's engine
    defaults apply, except `max_new_tokens`, whose LMI default (30) the translation sets
    explicitly. Units: token counts in tokens of the served model, probabilities in [0, 1].
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    # Parameters of every rolling-batch backend.
    do_sample: bool | None = None
    seed: Int64 | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    top_k: Int32 | None = None
    top_p: float | None = None
    max_new_tokens: Int32 | None = None
    details: bool | None = None
    return_full_text: bool | None = None
    stop_sequences: list[str] | str | None = None
    decoder_input_details: bool | None = None
    # LMI-Dist / vLLM additions.
    typical_p: float | None = None
    truncate: Int32 | None = None
    ignore_eos_token: bool | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: Int32 | None = None
    best_of: Int32 | None = None
    num_beams: Int32 | None = None
    length_penalty: float | None = None
    early_stopping: bool | None = None
    stop_token_ids: list[Int32] | None = None
    include_stop_str_in_output: bool | None = None
    logprobs: Int32 | None = None
    prompt_logprobs: Int32 | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    # TensorRT-LLM additions. `stop` is a boolean there; TGI clients send a list of stop strings
    # under the same name, so both shapes are accepted and told apart in translate.py.
    min_length: Int32 | None = None
    bad_sequences: list[str] | None = None
    stop: bool | list[str] | None = None
    # TGI additions (top_n_tokens is also listed by LMI for TGI compatibility).
    top_n_tokens: Int32 | None = None
    watermark: bool | None = None
    grammar: dict[str, Any] | None = None
    adapter_id: str | None = None
    # vLLM's extension: the scheduling priority, lower first (the core's --scheduling-policy).
    priority: Int32 | None = None


class _Request(BaseModel):
    """What both batching schemas share: `parameters` (absent or null: all unset, so it is always
    a GenerationParameters after validation) and `stream` (None: not given)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    parameters: GenerationParameters = Field(default_factory=GenerationParameters)
    stream: bool | None = None
    # DJL's LoRA adapter selection: one name, or one per input (docs.djl.ai, "Adapters",
    # "Invoking adapters"); None: the base model.
    adapters: str | list[str] | None = None

    @field_validator("parameters", mode="before")
    @classmethod
    def _null_is_absent(cls, value: Any) -> Any:
        return {} if value is None else value


class RollingBatchRequest(_Request):
    """A rolling-batch request: `{inputs: string, parameters?, stream?}` (seed "Request Schema");
    `stream` None means false."""

    inputs: str


class DynamicBatchRequest(_Request):
    """A dynamic-batch request: `inputs` is one string or a list of strings (seed "Dynamic
    Batch/Static Batch Schema"). `stream` is accepted per request as an override of the
    gateway's `--enable-streaming` option (None: use the option)."""

    inputs: str | list[str]


def adapters_of(req: _Request, inputs: int) -> list[str]:
    """The adapter of each of `inputs` inputs ("" for the base model): `adapters` as one name
    for all of them, or a list with one name per input.

    Raises:
        PayloadError: a list whose length is not the number of inputs (param "adapters").
    """
    names = req.adapters
    if names is None:
        return [""] * inputs
    if isinstance(names, str):
        return [names] * inputs
    if len(names) != inputs:
        raise PayloadError(
            f"adapters lists {len(names)} names for {inputs} inputs; give one name, or one per input.",
            param="adapters",
        )
    return list(names)


def is_chat_request(body: Any) -> bool:
    """Whether a decoded body is a chat completions request (a JSON object with `messages`),
    which LMI serves on `/invocations` in the chat schema (DJL-Serving's `chat_input_output_schema.md`)."""
    return isinstance(body, dict) and "messages" in body


def parse_rolling(body: Any) -> RollingBatchRequest:
    """Check a decoded JSON body against the rolling-batch schema.

    Raises:
        PayloadError: not an object, `inputs` missing or not a string, an unknown key, or a value
            of the wrong JSON type (the message names the field, e.g. "parameters.top_k").
    """
    _require_object(body)
    if isinstance(body.get("inputs"), list):
        raise PayloadError(
            "inputs must be a string with rolling batching; a list of inputs needs the dynamic-batch "
            "schema (gateway option --batching dynamic).",
            param="inputs",
        )
    return _validate(RollingBatchRequest, body)


def parse_dynamic(body: Any) -> DynamicBatchRequest:
    """Check a decoded JSON body against the dynamic-batch schema.

    Raises:
        PayloadError: as `parse_rolling`; also an empty `inputs` list.
    """
    _require_object(body)
    req = _validate(DynamicBatchRequest, body)
    if isinstance(req.inputs, list) and not req.inputs:
        raise PayloadError("inputs must not be an empty list.", param="inputs")
    return req


def _require_object(body: Any) -> None:
    if not isinstance(body, dict):
        raise PayloadError(f"The request body must be a JSON object, got {json_type(body)}.")
    if "inputs" not in body:
        raise PayloadError("The request body has no 'inputs' field.", param="inputs")


def _validate(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        # For a union (str | list[str]) each member reports; the deepest location is the most specific.
        err = max(e.errors(include_url=False), key=lambda x: len(x["loc"]))
        where = field_path(err["loc"])
        if err["type"] == "extra_forbidden":
            what = "generation parameter" if where.startswith("parameters.") else "request field"
            raise PayloadError(f"{where} is not a known {what}.", param=where) from None
        raise PayloadError(f"{where}: {err['msg']}.", param=where) from None
