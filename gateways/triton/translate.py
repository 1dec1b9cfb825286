"""Pure translation between Triton's generate extension and the core's Generate contract.

Data in, data out: request bodies become `spb.GenerateRequest`s through the schema's field
table (`PARAMETERS`, which also names the client's parameter when the core refuses a value),
Generate stream messages become `$generate_response` objects, GetModelInfo becomes KServe v2
metadata. No I/O, clocks or random ids here; the routes pass the request id in.

Sources: the generate extension seeds (v2 wins: `id` is echoed), the TensorRT-LLM ensemble's
inputs and outputs, and docs/architecture.md ("Sampling defaults are the engine's", "Errors").
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.fields import Field, FieldTable, Transform, by_rule, same, true_or_unset
from gateways.common.guided import trt_guide, vllm_guide
from gateways.common.status import GatewayError
from gateways.common.streaming import finish_word
from gateways.triton import schema
from gateways.triton.schema import UNSUPPORTED, Kind

#: Core FinishReason -> TensorRT-LLM LLM API `finish_reason` ("stop" covers EOS, end_id and
#: stop words, as there).
FINISH_REASONS: dict[int, str] = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_EOS: "stop",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop",
    pb.FINISH_REASON_TIME_LIMIT: "timeout",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_ERROR: "error",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSpec(Field):
    """One accepted parameter: a field table row (the canonical, TensorRT-LLM ensemble name, the
    GenerateRequest path, the transform, aliases common in TensorRT-LLM's LLM API and OpenAI),
    plus what the schema says of it.

    Attributes:
        kind: the JSON type it must have (schema.check_value).
        datatype: the KServe v2 tensor datatype reported in model metadata.
        shape: the KServe v2 tensor shape reported in model metadata.
    """

    kind: Kind
    datatype: str
    shape: tuple[int, ...] = (1,)


def _positive(value: float) -> float | None:
    """top_p <= 0 is left unset, as Triton's TensorRT-LLM backend drops it."""
    return value if value > 0 else None


def _echo(exclude_input: bool) -> bool | None:
    return True if not exclude_input else None


_WORDS: Transform = same  # a checked word list extends the repeated field (empty: nothing)

#: Accepted parameters, canonical name first. Source: the TensorRT-LLM ensemble's inputs, and
#: the aliases clients of the LLM API send. `end_id` sets two fields (see to_generate_request);
#: `pad_id` and `stream` are accepted without an effect on the core request (text output has
#: no padding; the route decides streaming).
PARAMETERS: tuple[ParamSpec, ...] = (
    ParamSpec("max_tokens", "stopping.max_new_tokens", aliases=("max_new_tokens",), kind=Kind.INT32, datatype="INT32"),
    ParamSpec("temperature", "sampling.temperature", kind=Kind.FLOAT, datatype="FP32"),
    ParamSpec("top_k", "sampling.top_k", kind=Kind.INT32, datatype="INT32"),
    ParamSpec("priority", "priority", kind=Kind.INT32, datatype="INT32"),
    ParamSpec("top_p", "sampling.top_p", _positive, kind=Kind.FLOAT, datatype="FP32"),
    ParamSpec("random_seed", "sampling.seed", aliases=("seed",), kind=Kind.INT64, datatype="INT64"),
    ParamSpec("repetition_penalty", "sampling.repetition_penalty", kind=Kind.FLOAT, datatype="FP32"),
    ParamSpec("presence_penalty", "sampling.presence_penalty", kind=Kind.FLOAT, datatype="FP32"),
    ParamSpec("frequency_penalty", "sampling.frequency_penalty", kind=Kind.FLOAT, datatype="FP32"),
    ParamSpec("length_penalty", "sampling.length_penalty", kind=Kind.FLOAT, datatype="FP32"),
    ParamSpec("min_length", "stopping.min_new_tokens", aliases=("min_tokens",), kind=Kind.INT32, datatype="INT32"),
    ParamSpec("stop_words", "stopping.stop", _WORDS, ("stop",), kind=Kind.WORDS, datatype="BYTES", shape=(-1,)),
    ParamSpec("bad_words", "sampling.bad_words", _WORDS, kind=Kind.WORDS, datatype="BYTES", shape=(-1,)),
    ParamSpec("beam_width", "sampling.num_beams", kind=Kind.INT32, datatype="INT32"),
    ParamSpec("end_id", "stopping.stop_token_ids", None, kind=Kind.INT32, datatype="INT32"),
    ParamSpec("pad_id", None, kind=Kind.INT32, datatype="INT32"),
    ParamSpec("return_log_probs", "output.logprobs", true_or_unset, kind=Kind.BOOL, datatype="BOOL"),
    ParamSpec("exclude_input_in_output", "output.echo", _echo, kind=Kind.BOOL, datatype="BOOL"),
    ParamSpec("include_stop_str_in_output", "stopping.include_stop_str_in_output", kind=Kind.BOOL, datatype="BOOL"),
    ParamSpec("stream", None, kind=Kind.BOOL, datatype="BOOL"),
    # The LoRA adapter, by the name vLLM's Triton backend gives the parameter.
    ParamSpec("lora_name", "adapter", kind=Kind.STRING, datatype="BYTES"),
    # The vLLM backend's sampling parameters (vllm/sampling_params.py names), beside TensorRT-LLM's.
    ParamSpec("ignore_eos", "stopping.ignore_eos", kind=Kind.BOOL, datatype="BOOL"),
    ParamSpec("min_p", "sampling.min_p", kind=Kind.FLOAT, datatype="FP32"),
    ParamSpec("stop_token_ids", "stopping.stop_token_ids", _WORDS, kind=Kind.INT32S, datatype="INT32", shape=(-1,)),
    ParamSpec("skip_special_tokens", "output.skip_special_tokens", kind=Kind.BOOL, datatype="BOOL"),
    ParamSpec("spaces_between_special_tokens", "output.spaces_between_special_tokens", kind=Kind.BOOL, datatype="BOOL"),
    # Guided decoding: vLLM's names, and TensorRT-LLM's ensemble inputs (gateways.common.guided).
    ParamSpec("guided_json", "guided_decoding.json_schema", None, kind=Kind.JSON, datatype="BYTES"),
    ParamSpec("guided_regex", "guided_decoding.regex", None, kind=Kind.STRING, datatype="BYTES"),
    ParamSpec("guided_choice", "guided_decoding.choice", None, kind=Kind.STRINGS, datatype="BYTES", shape=(-1,)),
    ParamSpec("guided_grammar", "guided_decoding.ebnf_grammar", None, kind=Kind.STRING, datatype="BYTES"),
    ParamSpec("guided_decoding_guide_type", "guided_decoding", None, kind=Kind.STRING, datatype="BYTES"),
    ParamSpec("guided_decoding_guide", None, None, kind=Kind.STRING, datatype="BYTES"),
)

#: Every accepted name (canonical or alias) -> its spec.
BY_NAME: dict[str, ParamSpec] = {n: p for p in PARAMETERS for n in (p.name, *p.aliases)}

#: The schema's field table: the parameters, the members outside `parameters`, and the guide
#: text of TensorRT-LLM's guided decoding inputs (named when the core refuses it).
FIELDS = FieldTable(
    (
        *by_rule("text_input", "text"),
        *by_rule("model_name", "model"),
        *PARAMETERS,
        *by_rule("guided_decoding_guide", "guided_decoding.json_schema", "guided_decoding.regex"),
        *by_rule("guided_decoding_guide", "guided_decoding.ebnf_grammar"),
    )
)

_VERSION = re.compile(r"[0-9]{1,18}")


def is_version(text: str) -> bool:
    """Whether `text` is a model version: an integer greater than 0, as Triton's model
    repository versions are (at most 18 digits, so it fits int64)."""
    return bool(_VERSION.fullmatch(text)) and int(text) != 0


@dataclass(frozen=True)
class ServedModel:
    """What the gateway serves: the core's model name and engine, and the version it answers to
    (the --model-version flag, else GetModelInfo.model_version)."""

    name: str
    version: str
    engine: str


@dataclass(frozen=True)
class Translation:
    """A request body translated for the core.

    Attributes:
        request: the Generate call to make.
        client_id: the body's `id`, echoed in every response object (None: absent).
        logprobs: `return_log_probs` was true (responses carry log probs).
        used: the parameter names as the client spelled them.
        ignored: unknown parameters accepted without effect (--ignore-unknown-parameters).
    """

    request: spb.GenerateRequest
    client_id: str | None
    logprobs: bool
    used: tuple[str, ...]
    ignored: tuple[str, ...] = ()

    @property
    def names(self) -> Mapping[str, str]:
        """Core field path -> the parameter name the client used (FIELDS.names), for error
        messages (gateways.common.fields.client_error); computed when an error needs it."""
        return FIELDS.names(self.used)


def check_target(model: str, version: str | None, served: ServedModel) -> None:
    """Check the URL's model name and optional version against the served model.

    Versions are positive integers, as Triton's model repository versions are.

    Raises:
        GatewayError: INVALID_ARGUMENT for a malformed version (400); NOT_FOUND for another
            model or version (404).
    """
    if version is not None and not is_version(version):
        raise GatewayError.invalid(
            f"Failed to get model version from specified version string '{version}': "
            "a version must be an integer greater than 0.",
            "model_version",
        )
    if model != served.name:
        raise GatewayError(
            grpc.StatusCode.NOT_FOUND,
            f"Request for unknown model: '{model}' is not found; this server serves '{served.name}'.",
            param="model_name",
        )
    if version is not None and not (is_version(served.version) and int(version) == int(served.version)):
        raise GatewayError(
            grpc.StatusCode.NOT_FOUND,
            f"Request for unknown model: '{model}' version {version} is not found; "
            f"the served version is {served.version}.",
            param="model_version",
        )


def to_generate_request(body: object, *, model: str, request_id: str, ignore_unknown: bool = False) -> Translation:
    """Translate a `$generate_request` body.

    Args:
        body: the decoded JSON body.
        model: the served model name (checked by `check_target`), sent as GenerateRequest.model.
        request_id: the core request id (unique per call; the client's `id` is only echoed,
            since clients reuse ids such as "42").
        ignore_unknown: accept unknown parameters without effect instead of refusing them.

    Mapping (PARAMETERS): max_tokens -> stopping.max_new_tokens, min_length ->
    stopping.min_new_tokens, stop_words -> stopping.stop, bad_words -> sampling.bad_words,
    random_seed -> sampling.seed, beam_width -> sampling.num_beams, return_log_probs ->
    output.logprobs, exclude_input_in_output false -> output.echo, end_id -> stopping.stop_token_ids
    with ignore_eos (the ensemble's end_id replaces the model's EOS; -1: no end token at all),
    temperature, top_k, top_p and
    the penalties -> sampling.*. do_sample is never set: the core infers it and applies the
    engine's defaults. top_p <= 0 is left unset, as Triton's TensorRT-LLM backend drops it.
    pad_id and stream have no effect (text output has no padding; the route decides streaming).
    guided_json / guided_regex / guided_choice / guided_grammar (vLLM) or
    guided_decoding_guide_type with guided_decoding_guide (TensorRT-LLM) -> guided_decoding.
    The vLLM backend's names: ignore_eos, min_p, stop_token_ids (with end_id's id after them),
    skip_special_tokens, spaces_between_special_tokens; min_tokens, seed and stop are aliases.

    Raises:
        GatewayError: INVALID_ARGUMENT for a wrong shape or JSON type, an unknown parameter
            (unless ignore_unknown), a parameter given twice (also under two aliases), or an
            unsupported TensorRT-LLM input set to a value with an effect.
    """
    env = schema.parse_envelope(body)
    values: dict[str, Any] = {}  # canonical name -> checked value
    used: list[str] = []  # the names as the client spelled them
    ignored: list[str] = []
    for name, raw in env.parameters.items():
        spec = BY_NAME.get(name)
        if spec is None:
            if name in UNSUPPORTED:
                _check_unsupported(name, raw)
            elif ignore_unknown:
                ignored.append(name)
            else:
                raise GatewayError.invalid(
                    f"Unknown parameter '{name}'. Accepted parameters: {', '.join(sorted(BY_NAME))}.", name
                )
            continue
        if spec.name in values:
            first = next(u for u in used if BY_NAME[u] is spec)
            raise GatewayError.invalid(
                f"Parameters '{first}' and '{name}' set the same thing; give only one of them.", name
            )
        values[spec.name] = schema.check_value(name, spec.kind, raw)
        used.append(name)

    req = spb.GenerateRequest(request_id=request_id, model=model, text=env.text_input)
    FIELDS.apply(values, req)
    guide = _guide(values)
    if guide is not None:
        req.guided_decoding.CopyFrom(guide)
    end_id = values.get("end_id")
    if end_id is not None:
        # The ensemble's end_id replaces the model's EOS; -1 (what TensorRT-LLM's own tests send)
        # means none: generate max_tokens tokens.
        if end_id != -1:
            req.stopping.stop_token_ids.append(end_id)
        req.stopping.ignore_eos = True
    return Translation(req, env.id, bool(values.get("return_log_probs")), tuple(used), tuple(ignored))


def _guide(values: Mapping[str, Any]) -> pb.GuidedDecoding | None:
    """The guide of the guided_* parameters, or of guided_decoding_guide_type/_guide (not both).

    Raises:
        GatewayError: INVALID_ARGUMENT naming the parameter (two guides, an unknown guide type,
            a guide without its type).
    """
    vllm = vllm_guide(values)
    guide_type = values.get("guided_decoding_guide_type")
    if guide_type is None:
        if values.get("guided_decoding_guide") is not None:
            raise GatewayError.invalid(
                "guided_decoding_guide needs guided_decoding_guide_type.", "guided_decoding_guide_type"
            )
        return vllm
    if vllm is not None:
        raise GatewayError.invalid(
            "Give either the guided_* parameters or guided_decoding_guide_type, not both.",
            "guided_decoding_guide_type",
        )
    return trt_guide(guide_type, values.get("guided_decoding_guide"))


def _check_unsupported(name: str, value: object) -> None:
    neutral = UNSUPPORTED[name]
    if neutral is not None and type(value) is type(neutral) and value == neutral:
        return
    message = f"Parameter '{name}' is not supported by this server"
    if neutral is not None:
        message += f"; only {name}={json.dumps(neutral)} is accepted"
    raise GatewayError.invalid(message + ".", name)


# ----------------------------------------------------------------------------- responses


class ResponseRenderer:
    """Builds `$generate_response` objects (seed "Generate Response JSON Object") from Generate
    stream messages: `{id?, model_name, model_version, text_output}`, plus `output_log_probs`
    (per-token natural-log probabilities, <= 0) and `cum_log_probs` (their sum) with
    `return_log_probs`, plus `finish_reason` on the last one (FINISH_REASONS). `id` is there
    only when the request had one (seed v2).

    For /generate_stream, `event(msg)` gives one object per message that carries output (the
    text delta, its tokens' log probs, the running cumulative log prob); the echoed prompt text,
    which the core sends on its first message, goes out with the first event. For /generate,
    `response(messages)` gives the single object for a complete stream.

    Args:
        model_name, model_version: the served model, echoed in every object.
        client_id: the request's `id` (None: absent).
        logprobs: the request set `return_log_probs`.
    """

    def __init__(self, model_name: str, model_version: str, *, client_id: str | None = None, logprobs: bool = False):
        self._head: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
        if client_id is not None:
            self._head = {"id": client_id, **self._head}
        self.logprobs = logprobs
        self._pending_prompt = ""
        self._cumulative = 0.0

    def event(self, msg: spb.GenerateResponse) -> dict[str, Any] | None:
        """The event for one stream message, or None when it carries no output (lifecycle states)."""
        if msg.HasField("prompt_text"):
            self._pending_prompt += msg.prompt_text
        if not msg.outputs:
            return None
        # This schema asks for one sequence, so a message has at most one output.
        out = msg.outputs[0]
        logprobs = [t.logprob for t in out.tokens if t.HasField("logprob")] if self.logprobs else []
        cumulative = out.cumulative_logprob if out.HasField("cumulative_logprob") else None
        return self._output_event(out.text, logprobs, cumulative, out.finish_reason)

    def step_event(self, text: str, logprob: float | None) -> dict[str, Any]:
        """The event of a plain decode step (core_call.Step): `event` of the message it stands
        for."""
        return self._output_event(text, [] if logprob is None else [logprob], None, 0)

    def _output_event(
        self, text: str, logprobs: list[float], cumulative: float | None, finish_reason: int
    ) -> dict[str, Any]:
        obj = {**self._head, "text_output": self._pending_prompt + text}
        self._pending_prompt = ""
        if self.logprobs:
            self._cumulative = cumulative if cumulative is not None else self._cumulative + sum(logprobs)
            obj["output_log_probs"] = logprobs
            obj["cum_log_probs"] = self._cumulative
        if finish_reason:
            obj["finish_reason"] = finish_word(finish_reason, FINISH_REASONS)
        return obj

    def plain_ready(self) -> bool:
        """Whether a plain decode step's event is `text_event(text)` now: no log probs asked
        for, no prompt text waiting to be echoed."""
        return not self.logprobs and not self._pending_prompt

    def text_event(self, text: str) -> dict[str, Any]:
        """The event of a plain decode step when `plain_ready()`."""
        return {**self._head, "text_output": text}

    def response(self, messages: Iterable[spb.GenerateResponse]) -> dict[str, Any]:
        """The single /generate object for a complete stream's messages."""
        parts: list[str] = []
        logprobs: list[float] = []
        finish = None
        cumulative = None
        for msg in messages:
            if msg.HasField("prompt_text"):
                parts.append(msg.prompt_text)
            for out in msg.outputs:
                parts.append(out.text)
                logprobs += [t.logprob for t in out.tokens if t.HasField("logprob")]
                if out.finish_reason:
                    finish = finish_word(out.finish_reason, FINISH_REASONS)
                if out.HasField("cumulative_logprob"):
                    cumulative = out.cumulative_logprob
        obj = {**self._head, "text_output": "".join(parts)}
        if self.logprobs:
            obj["output_log_probs"] = logprobs
            obj["cum_log_probs"] = sum(logprobs) if cumulative is None else cumulative
        if finish is not None:
            obj["finish_reason"] = finish
        return obj


# ----------------------------------------------------------------------------- metadata

#: Outputs as the TensorRT-LLM ensemble declares them (plus finish_reason).
OUTPUTS = (
    schema.TensorMetadata(name="text_output", datatype="BYTES", shape=[-1]),
    schema.TensorMetadata(name="output_log_probs", datatype="FP32", shape=[-1]),
    schema.TensorMetadata(name="cum_log_probs", datatype="FP32", shape=[1]),
    schema.TensorMetadata(name="finish_reason", datatype="BYTES", shape=[1]),
)


def model_metadata(served: ServedModel) -> dict[str, Any]:
    """KServe v2 model metadata: name, versions, platform ("trellis_<engine>"), and the generate
    inputs (text_input plus every canonical parameter) and outputs as tensors."""
    inputs = [schema.TensorMetadata(name="text_input", datatype="BYTES", shape=[-1])]
    inputs += [schema.TensorMetadata(name=p.name, datatype=p.datatype, shape=list(p.shape)) for p in PARAMETERS]
    return schema.ModelMetadata(
        name=served.name,
        versions=[served.version],
        platform=f"trellis_{served.engine}",
        inputs=inputs,
        outputs=list(OUTPUTS),
    ).dump()


def server_metadata(version: str) -> dict[str, Any]:
    """KServe v2 server metadata; `generate` is the only extension served."""
    return schema.ServerMetadata(name="trellis", version=version, extensions=["generate"]).dump()
