"""vLLM's extra parameters of chat and legacy completions, shared by both schemas.

The table is vLLM's OpenAI-compatible server's ("Extra Parameters", vllm/entrypoints/openai/
protocol.py `ChatCompletionRequest` / `CompletionRequest`, 0.10/0.11): what clients moving from
vLLM or SGLang send in `extra_body`. Each maps onto a GenerateRequest field the core already
has (`FIELDS`); the guided decoding ones become one guide (`guide`). Parameters of vLLM's that
ask for what the core cannot do are refused naming them, unless their value asks for nothing
(`UNSUPPORTED`, `neutral`); those without an effect on generation are accepted (`IGNORED`).

Value rules follow vLLM: `top_k` -1 (or 0) disables top-k; `truncate_prompt_tokens` keeps the
prompt's last tokens; `guided_grammar` is EBNF text; at most one guide is given (the
`guided_*` fields or `structured_outputs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic import Field as PydanticField
from trellis.generate.v1 import generate_pb2 as pb

from gateways.common.fields import Field, by_rule, same_names
from gateways.common.guided import VLLM_GUIDES, vllm_guide

__all__ = ["FIELDS", "IGNORED", "UNSUPPORTED", "VLLM_GUIDES", "StructuredOutputs", "VllmExtras", "guide", "neutral"]
from gateways.common.schema import Int32
from gateways.common.status import GatewayError


class _Wire(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class StructuredOutputs(_Wire):
    """vLLM's `structured_outputs` (`StructuredOutputsParams`, 0.11): one of `json` (a schema
    object or its text), `regex`, `choice`, `grammar` (EBNF), `json_object`."""

    json_: dict[str, Any] | str | None = PydanticField(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class VllmExtras(_Wire):
    """vLLM's sampling and output extras common to chat and completions (None: not given)."""

    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float | None = None
    min_tokens: Int32 | None = None
    stop_token_ids: list[Int32] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: Int32 | None = None
    bad_words: list[str] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


def _top_k(k: int) -> int:
    """vLLM's -1 ("all tokens") is the core's 0 (top-k off); other values go as they are."""
    return 0 if k == -1 else k


#: The extras' rows (chat and completions both add them to their tables).
FIELDS: tuple[Field, ...] = (
    Field("top_k", "sampling.top_k", _top_k),
    *same_names("", "sampling", ("min_p", "repetition_penalty", "length_penalty", "bad_words")),
    Field("min_tokens", "stopping.min_new_tokens"),
    *same_names("", "stopping", ("stop_token_ids", "include_stop_str_in_output")),
    Field("truncate_prompt_tokens", "stopping.truncate_input_tokens"),
    *same_names("", "output", ("skip_special_tokens", "spaces_between_special_tokens")),
    *by_rule("guided_json", "guided_decoding.json_schema"),
    *by_rule("guided_regex", "guided_decoding.regex"),
    *by_rule("guided_choice", "guided_decoding.choice"),
    *by_rule("guided_grammar", "guided_decoding.ebnf_grammar"),
)

#: vLLM parameters accepted without an effect here: a backend choice (the core picks its
#: own), a request id (the gateway makes one).
IGNORED = frozenset({"guided_decoding_backend", "request_id"})

#: vLLM parameters the core cannot honour, with the reason; accepted when `neutral`.
UNSUPPORTED = {
    "use_beam_search": "vLLM's beam search is not served; use n and best_of",
    "allowed_token_ids": "allowed_token_ids is not supported; use logit_bias or guided_choice",
    "logits_processors": "custom logits processors are not supported",
    "guided_whitespace_pattern": "a whitespace pattern for guided JSON is not supported",
    "return_tokens_as_token_ids": "token ids in place of token texts are not supported",
    "return_token_ids": "token ids in the response are not supported",
    "cache_salt": "prefix cache salts are not supported",
    "kv_transfer_params": "KV cache transfer is not supported",
    "vllm_xargs": "vLLM's extension arguments are not supported",
    "mm_processor_kwargs": "multimodal processor arguments are not supported",
}


def neutral(name: str, value: Any) -> bool:
    """Whether an unsupported vLLM parameter's value asks for nothing (vLLM's default)."""
    if value is None:
        return True
    if name in ("use_beam_search", "return_tokens_as_token_ids", "return_token_ids"):
        return value is False
    if name in ("logits_processors", "allowed_token_ids"):
        return bool(value == [])
    if name in ("mm_processor_kwargs", "vllm_xargs", "kv_transfer_params"):
        return bool(value == {})
    return False


def guide(extras: VllmExtras) -> pb.GuidedDecoding | None:
    """The guide of the `guided_*` fields or of `structured_outputs` (None: none).

    Raises:
        GatewayError: INVALID_ARGUMENT naming the second one when two guides are given.
    """
    values: dict[str, Any] = {name: getattr(extras, name) for name in VLLM_GUIDES}
    so = extras.structured_outputs
    if so is not None:
        given = {k: v for k, v in _structured(so).items() if v is not None}
        if len(given) > 1:
            raise GatewayError.invalid(
                "structured_outputs takes one of json, regex, choice, grammar, json_object; got "
                f"{' and '.join(sorted(given))}.",
                "structured_outputs",
            )
        first = next((name for name in VLLM_GUIDES if values[name] is not None), None)
        if given and first is not None:
            raise GatewayError.invalid(
                f"Only one guided decoding parameter may be given; got {first} and structured_outputs.",
                "structured_outputs",
            )
        if so.json_object:
            return pb.GuidedDecoding(json_object=True)
        values.update({k: v for k, v in given.items() if k in VLLM_GUIDES})
    return vllm_guide(values)


def _structured(so: StructuredOutputs) -> Mapping[str, Any]:
    """`structured_outputs` by the guided_* name of each member (json_object as itself)."""
    return {
        "guided_json": so.json_,
        "guided_regex": so.regex,
        "guided_choice": so.choice,
        "guided_grammar": so.grammar,
        "json_object": so.json_object or None,
    }
