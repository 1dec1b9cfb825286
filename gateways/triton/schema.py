"""Wire shapes of Triton's generate extension and the KServe v2 metadata routes.

Request (seed `triton-generate-extension-v2.md`, "Generate Request JSON Object")::

    {"id": $string #optional, "text_input": $string, "parameters": {$name: $string|$number|$boolean} #optional}

Any other top-level property is a parameter too (the seed's note: "Any additional properties in
the request object are passed either as parameters or tensors"). Parameters are typed as the
TensorRT-LLM ensemble declares its inputs (`all_models/inflight_batcher_llm/ensemble/config.pbtxt`):
integers, floats, booleans, and word lists (a string or an array of strings). This module checks
only shapes and JSON types (`Kind`, `check_value`); value ranges are the core's
(`core/validation.py`). The accepted parameters and what they set are the field table in
translate.py.

The KServe v2 server/model metadata objects are pydantic models, rendered with `dump()`. The
generate response objects are plain dicts built in translate.py (`ResponseRenderer`), since
one is built per streamed token.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from gateways.common.schema import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, json_type
from gateways.common.status import GatewayError

#: Top-level members with a meaning of their own; every other top-level member is a parameter.
RESERVED_MEMBERS = ("id", "text_input", "parameters")


class Kind(enum.Enum):
    """JSON type a parameter must have."""

    INT32 = "int32"  # a JSON number with an integral value that fits 32 bits
    INT64 = "int64"  # likewise, 64 bits
    FLOAT = "float"  # any JSON number
    BOOL = "bool"  # true or false
    WORDS = "words"  # a string or an array of strings
    STRING = "string"  # a string
    STRINGS = "strings"  # an array of strings
    JSON = "json"  # an object, or a string holding one (a JSON Schema)
    INT32S = "int32s"  # an array of INT32 values


#: TensorRT-LLM ensemble / BLS inputs this server cannot honour. The value is the one setting
#: that changes nothing (accepted), or None when any value is refused. They are refused even
#: with --ignore-unknown-parameters: a client that asks for them expects an effect.
UNSUPPORTED: dict[str, Any] = {
    "num_return_sequences": 1,
    "return_context_logits": False,
    "return_generation_logits": False,
    "return_perf_metrics": False,
    "return_kv_cache_reuse_stats": False,
    "return_num_input_tokens": False,
    "return_num_output_tokens": False,
    "early_stopping": None,
    "beam_search_diversity_rate": None,
    "runtime_top_p_min": None,
    "runtime_top_p_decay": None,
    "runtime_top_p_reset_ids": None,
    "no_repeat_ngram_size": None,
    "embedding_bias_words": None,
    "embedding_bias_weights": None,
    "prompt_embedding_table": None,
    "prompt_vocab_size": None,
    "prompt_table_extra_id": None,
    "lora_task_id": None,
    "lora_weights": None,
    "lora_config": None,
}


@dataclass(frozen=True)
class RequestEnvelope:
    """The request body split into its parts.

    Attributes:
        id: the client's request id (None when the body has none).
        text_input: the prompt.
        parameters: every parameter, from `parameters` and from extra top-level members, by the
            name the client used.
    """

    id: str | None
    text_input: str
    parameters: Mapping[str, Any]


def parse_envelope(body: Any) -> RequestEnvelope:
    """Check the body's shape: an object with a string `text_input`, an optional string `id` and
    an optional `parameters` object; extra top-level members join the parameters.

    Raises:
        GatewayError: INVALID_ARGUMENT naming the offending member; also when a parameter is
            given both inside `parameters` and at the top level.
    """
    if not isinstance(body, dict):
        raise GatewayError.invalid(
            f"The request body must be a JSON object with 'text_input', got {json_type(body)}.", "body"
        )
    if "text_input" not in body:
        raise GatewayError.invalid('The request has no \'text_input\'; send {"text_input": "..."}.', "text_input")
    text = body["text_input"]
    if not isinstance(text, str):
        raise GatewayError.invalid(f"'text_input' must be a string, got {json_type(text)}.", "text_input")
    rid = body.get("id")
    if "id" in body and not isinstance(rid, str):
        raise GatewayError.invalid(f"'id' must be a string, got {json_type(rid)}.", "id")
    params = body.get("parameters", {})
    if not isinstance(params, dict):
        raise GatewayError.invalid(
            f"'parameters' must be an object of name/value pairs, got {json_type(params)}.", "parameters"
        )
    merged = dict(params)
    for name, value in body.items():
        if name in RESERVED_MEMBERS:
            continue
        if name in merged:
            raise GatewayError.invalid(
                f"Parameter '{name}' is given both in 'parameters' and at the top level; give it once.", name
            )
        merged[name] = value
    return RequestEnvelope(id=rid, text_input=text, parameters=merged)


def check_value(name: str, kind: Kind, value: Any) -> Any:
    """A parameter value of the right JSON type, as the Python value to use.

    Integers may be written as integral JSON numbers (7 or 7.0; a value like 7.5 is refused),
    because JSON itself does not tell them apart. Numbers must not be strings and booleans must be
    JSON booleans, as Triton's typed inputs require. A word list is a string or an array of
    strings; empty strings are dropped (the ensemble's `"stop_words": ""` means "none").

    Raises:
        GatewayError: INVALID_ARGUMENT naming the parameter.
    """
    if kind is Kind.BOOL:
        if not isinstance(value, bool):
            raise GatewayError.invalid(f"Parameter '{name}' must be a boolean, got {json_type(value)}.", name)
        return value
    if kind is Kind.STRING:
        if not isinstance(value, str):
            raise GatewayError.invalid(f"Parameter '{name}' must be a string, got {json_type(value)}.", name)
        return value
    if kind is Kind.STRINGS:
        if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
            raise GatewayError.invalid(f"Parameter '{name}' must be an array of strings, got {json_type(value)}.", name)
        return value
    if kind is Kind.JSON:
        if not isinstance(value, dict | str):
            raise GatewayError.invalid(
                f"Parameter '{name}' must be a JSON Schema (an object or its JSON text), got {json_type(value)}.", name
            )
        return value
    if kind is Kind.INT32S:
        if not isinstance(value, list):
            raise GatewayError.invalid(
                f"Parameter '{name}' must be an array of integers, got {json_type(value)}.", name
            )
        return [check_value(name, Kind.INT32, v) for v in value]
    if kind is Kind.WORDS:
        if isinstance(value, str):
            return [value] if value else []
        if isinstance(value, list) and all(isinstance(w, str) for w in value):
            return [w for w in value if w]
        raise GatewayError.invalid(
            f"Parameter '{name}' must be a string or an array of strings, got {json_type(value)}.", name
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        what = "an integer" if kind is not Kind.FLOAT else "a number"
        raise GatewayError.invalid(f"Parameter '{name}' must be {what}, got {json_type(value)}.", name)
    if kind is Kind.FLOAT:
        try:
            return float(value)
        except OverflowError:
            raise GatewayError.invalid(f"Parameter '{name}' is too large to be a number.", name) from None
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise GatewayError.invalid(f"Parameter '{name}' must be an integer, got {value!r}.", name)
        value = int(value)
    lo, hi = (INT32_MIN, INT32_MAX) if kind is Kind.INT32 else (INT64_MIN, INT64_MAX)
    if not lo <= value <= hi:
        bits = 32 if kind is Kind.INT32 else 64
        raise GatewayError.invalid(f"Parameter '{name}' must be a {bits}-bit integer, got {value}.", name)
    return value


# ----------------------------------------------------------------------------- metadata


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def dump(self) -> dict[str, Any]:
        """The JSON object, without members left unset (None)."""
        return self.model_dump(exclude_none=True)


class TensorMetadata(_Wire):
    """KServe v2 `$metadata_tensor`: name, datatype and shape (-1: variable)."""

    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(_Wire):
    """KServe v2 `$metadata_model_response` (GET /v2/models/{model}[/versions/{version}])."""

    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ServerMetadata(_Wire):
    """KServe v2 `$metadata_server_response` (GET /v2)."""

    name: str
    version: str
    extensions: list[str]
