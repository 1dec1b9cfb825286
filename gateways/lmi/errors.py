"""LMI error shapes (DESIGN.md "Errors, per schema", LMI row; seed "Error Responses").

Before the first byte of a rolling-batch response:
- malformed payload (bad JSON, missing `inputs`, wrong types, unknown keys): 424
  `{"error": msg, "code": 424}`;
- body above the size limit: 413, unknown model on `/predictions/{name}`: 404, both in the same
  `{"error", "code"}` shape;
- a bad parameter value or a generation failure: the HTTP status of the gRPC code (DESIGN.md
  table, with RESOURCE_EXHAUSTED -> 503 as DJL answers a full job queue) and the body
  `{"generated_text": "", "details": {"finish_reason": "error", "generated_tokens": null,
  "inputs": null, "tokens": null}, "error": msg}`. DJL's documentation shows
  `generated_text: ""` while its code emits null; DESIGN.md pins the documented form, plus
  `error` so clients (the `text-generation` client reads `payload["error"]`) get the message.

After the stream started: a last record with the `id: -1` token and `finish_reason: "error"`
(in the TGI token shape under TGI compatibility), again with `error` added for the message.

Dynamic batching answers every error with `{"code": 424, "message": "invoke handler failure",
"error": msg}`: status 424, except 413 (body too large), 404 (unknown model) and 503 (core
unreachable or overloaded), which keep their status so load balancers can act on them.
"""

from __future__ import annotations

from typing import Any

import grpc
from aiohttp import web

from gateways.common.framing import dumps
from gateways.common.status import GatewayError

#: LMI's departures from the generic gRPC -> HTTP table (DESIGN.md: "LMI: 503, as DJL does").
LMI_STATUS_OVERRIDES = {grpc.StatusCode.RESOURCE_EXHAUSTED: 503}

MALFORMED_PAYLOAD = "MALFORMED_PAYLOAD"
PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
MODEL_NOT_FOUND = "MODEL_NOT_FOUND"

# Reasons rendered in the `{"error", "code"}` shape, with their HTTP status.
_SHAPE_ERRORS = {MALFORMED_PAYLOAD: 424, PAYLOAD_TOO_LARGE: 413, MODEL_NOT_FOUND: 404}
# Statuses a dynamic-batch error keeps instead of 424.
_DYNAMIC_KEPT = {413, 404, 503}

# Core field paths -> LMI parameter names (for messages). "sampling.n" and "output.*" depend on
# which LMI field the client used; see `lmi_param`.
_PARAM_NAMES = {
    "text": "inputs",
    "sampling.do_sample": "parameters.do_sample",
    "sampling.temperature": "parameters.temperature",
    "sampling.top_k": "parameters.top_k",
    "sampling.top_p": "parameters.top_p",
    "sampling.min_p": "parameters.min_p",
    "sampling.typical_p": "parameters.typical_p",
    "sampling.repetition_penalty": "parameters.repetition_penalty",
    "sampling.presence_penalty": "parameters.presence_penalty",
    "sampling.frequency_penalty": "parameters.frequency_penalty",
    "sampling.length_penalty": "parameters.length_penalty",
    "sampling.early_stopping": "parameters.early_stopping",
    "sampling.seed": "parameters.seed",
    "sampling.num_beams": "parameters.num_beams",
    "sampling.bad_words": "parameters.bad_sequences",
    "stopping.max_new_tokens": "parameters.max_new_tokens",
    "stopping.min_new_tokens": "parameters.min_length",
    "stopping.stop": "parameters.stop_sequences",
    "stopping.stop_token_ids": "parameters.stop_token_ids",
    "stopping.ignore_eos": "parameters.ignore_eos_token",
    "stopping.include_stop_str_in_output": "parameters.include_stop_str_in_output",
    "stopping.truncate_input_tokens": "parameters.truncate",
    "output.skip_special_tokens": "parameters.skip_special_tokens",
    "output.spaces_between_special_tokens": "parameters.spaces_between_special_tokens",
}


class PayloadError(GatewayError):
    """A malformed LMI payload (bad JSON, missing `inputs`, wrong types): 424 (seed "Error Responses")."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message, param=param, reason=MALFORMED_PAYLOAD)


def payload_too_large(limit: int) -> GatewayError:
    """The error for a body above `limit` bytes (answered with 413)."""
    return GatewayError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"The request body is larger than the limit of {limit} bytes.",
        reason=PAYLOAD_TOO_LARGE,
    )


def model_not_found(name: str, served: str) -> GatewayError:
    """The error for `/predictions/{name}` naming a model that is not served (answered with 404)."""
    return GatewayError(
        grpc.StatusCode.NOT_FOUND,
        f"Model not found: '{name}'; this server serves '{served}'.",
        param="model_name",
        reason=MODEL_NOT_FOUND,
    )


def lmi_param(core_param: str | None, given: set[str]) -> str | None:
    """The LMI field a core field path stands for.

    Args:
        core_param: the GenerateRequest path the core named (e.g. "sampling.top_p"), or None.
        given: names of the `parameters` fields the client set (to tell `n` from `best_of`,
            `logprobs` from `top_n_tokens`, `prompt_logprobs` from `decoder_input_details`).

    Returns:
        e.g. "parameters.top_p"; None when the core named no field. A path without an LMI
        counterpart is returned unchanged.
    """
    if not core_param:
        return None
    if core_param in _PARAM_NAMES:
        return _PARAM_NAMES[core_param]
    if core_param == "sampling.n":
        return "parameters.n" if "n" in given or "best_of" not in given else "parameters.best_of"
    if core_param == "sampling.best_of":
        return "parameters.best_of" if "best_of" in given or "n" not in given else "parameters.n"
    if core_param in ("output.top_logprobs", "output.logprobs"):
        return "parameters.top_n_tokens" if "top_n_tokens" in given else "parameters.logprobs"
    if core_param == "output.prompt_logprobs":
        return "parameters.prompt_logprobs" if "prompt_logprobs" in given else "parameters.decoder_input_details"
    return core_param


def with_lmi_param(err: GatewayError, given: set[str]) -> GatewayError:
    """`err` with its `param` renamed to the LMI field and the message prefixed with it
    ("parameters.top_p: top_p must be in (0, 1], got 0."). Gateway-found errors, which already
    use LMI names, are returned unchanged."""
    if err.reason in _SHAPE_ERRORS or err.param is None or err.param.startswith("parameters."):
        return err
    param = lmi_param(err.param, given)
    message = err.message if err.message.startswith(f"{param}:") else f"{param}: {err.message}"
    return GatewayError(err.code, message, param=param, reason=err.reason)


def http_status(err: GatewayError) -> int:
    """The HTTP status of an error answered before the stream started (rolling batch)."""
    if err.reason in _SHAPE_ERRORS:
        return _SHAPE_ERRORS[err.reason]
    return err.http_status(LMI_STATUS_OVERRIDES)


def error_body(err: GatewayError) -> dict[str, Any]:
    """The rolling-batch JSON body of an error answered before the stream started."""
    if err.reason in _SHAPE_ERRORS:
        return {"error": err.message, "code": _SHAPE_ERRORS[err.reason]}
    return {
        "generated_text": "",
        "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None, "tokens": None},
        "error": err.message,
    }


def render_before_stream(err: GatewayError, *, dynamic: bool = False) -> web.Response:
    """The HTTP response for an error found before the first byte.

    Args:
        err: the error (gateway-found or decoded from the core's status).
        dynamic: render in the dynamic-batch shape.
    """
    if dynamic:
        status, body = dynamic_error(err)
    else:
        status, body = http_status(err), error_body(err)
    return web.Response(status=status, text=dumps(body), content_type="application/json")


def render_in_stream(err: GatewayError, *, tgi_compat: bool = False) -> dict[str, Any]:
    """The last record of a rolling-batch stream that failed after it started (framed as a
    jsonlines line or an SSE event by the caller)."""
    if tgi_compat:
        token = {"id": -1, "text": "", "logprob": -1, "special": True}
    else:
        token = {"id": -1, "text": "", "log_prob": -1, "special_token": True}
    return {
        "token": token,
        "generated_text": "",
        "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None},
        "error": err.message,
    }


def dynamic_error(err: GatewayError) -> tuple[int, dict[str, Any]]:
    """Status and body of a dynamic-batch error (also the in-band record of a failed
    dynamic-batch stream)."""
    status = http_status(err)
    status = status if status in _DYNAMIC_KEPT else 424
    return status, {"code": status, "message": "invoke handler failure", "error": err.message}
