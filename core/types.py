"""Engine-facing data types of the core.

Engines see only these dataclasses, never protobuf: `core.convert` builds them from a
GenerateRequest, the request pipeline turns EngineOutputs into ResponseDeltas, and
`core.convert` renders those as GenerateResponse messages. Token ids are ints of the served
model's tokenizer; times are seconds from `time.monotonic()` unless a name says otherwise.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class FinishReason(enum.Enum):
    """Why a sequence ended (mirrors trellis.generate.v1.FinishReason)."""

    LENGTH = "length"
    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    CANCELLED = "cancelled"
    TIME_LIMIT = "time_limit"
    ERROR = "error"


class RequestState(enum.Enum):
    """Lifecycle states an engine reports (mirrors trellis.generate.v1.GenerateState)."""

    QUEUED = 1
    SCHEDULED = 2
    PREFILLED = 3
    GENERATING = 4


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Sampling fields as the client sent them; None means unset (engine default applies)."""

    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    length_penalty: float | None = None
    early_stopping: bool | None = None
    seed: int | None = None
    n: int | None = None
    best_of: int | None = None
    num_beams: int | None = None


@dataclass(frozen=True, slots=True)
class ResolvedSampling:
    """Sampling parameters after the engine's defaults were applied.

    A field left None is not applied (and, for TensorRT-LLM, not sent to the runtime).
    `seed` is always set: the core draws one when the client gave none.
    """

    do_sample: bool
    seed: int
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    length_penalty: float | None = None
    early_stopping: bool | None = None
    num_beams: int = 1


#: The GuidedDecoding kinds (trellis.generate.v1.GuidedDecoding's oneof fields), in contract order.
GUIDE_KINDS = ("json_object", "json_schema", "regex", "ebnf_grammar", "lark_grammar", "choice")


@dataclass(frozen=True, slots=True)
class Guide:
    """A structured-output constraint (trellis.generate.v1.GuidedDecoding).

    Attributes:
        kind: one of GUIDE_KINDS.
        spec: the schema, regex or grammar text ("" for json_object and choice).
        choices: the alternatives of a "choice" guide (empty otherwise).
    """

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    @property
    def field(self) -> str:
        """The GenerateRequest field path errors about this guide name."""
        return f"guided_decoding.{self.kind}"


@dataclass(slots=True)
class EngineRequest:
    """One request at token level, as an engine receives it.

    Attributes:
        request_id: unique among live requests of the engine.
        prompt_ids: the full input sequence (non-empty).
        sampling: resolved sampling parameters.
        num_sequences: rows to generate (n, or best_of when larger).
        max_new_tokens: per sequence, >= 1; prompt + max_new_tokens fits the context.
        min_new_tokens: EOS and stop tokens are suppressed until this many were generated.
        stop_token_ids: tokens that end a sequence besides EOS (reported as STOP_SEQUENCE).
        ignore_eos: do not stop on the model's EOS tokens.
        stop_words_ids: stop strings tokenized without special tokens (engines that can stop
            on token sequences use them; the pipeline still matches stop text).
        bad_words_ids: token sequences that must never be generated.
        logit_bias: token id -> additive bias on the logits.
        logprobs: report the raw logprob of every generated token.
        top_logprobs: number of alternatives per generated token (0..20).
        prompt_logprobs: None, or the number of alternatives per prompt token.
        arrival_time: monotonic time the core received the request.
        guide: the structured-output constraint (a kind in EngineInfo.guided_decoding), or None.
        priority: scheduling priority, lower first (core.scheduling; 0 under fcfs).
        tenant: who the request is served for (core.scheduling fair shares); "" the default.
        adapter: the registered LoRA adapter to generate with ("": the base model).
    """

    request_id: str
    prompt_ids: list[int]
    sampling: ResolvedSampling
    max_new_tokens: int
    num_sequences: int = 1
    min_new_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    stop_words_ids: list[list[int]] = field(default_factory=list)
    bad_words_ids: list[list[int]] = field(default_factory=list)
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    arrival_time: float = 0.0
    guide: Guide | None = None
    priority: int = 0
    tenant: str = ""
    adapter: str = ""


@dataclass(slots=True)
class SequenceStep:
    """New tokens of one sequence from one engine step.

    `logprobs[i]` and `top_logprobs[i]` belong to `token_ids[i]` (raw model distribution);
    they are None unless the request asked for them, and `logprobs[i]` is None where the
    engine could not learn that token's logprob. `finish_reason` is set on the
    sequence's last step; `stop_token_id` names the token when a stop token ended it.
    """

    index: int
    token_ids: list[int]
    logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None


@dataclass(slots=True)
class PromptTokenInfo:
    """A prompt token with its logprob (None for the first) and top alternatives."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]]


@dataclass(slots=True)
class EngineOutput:
    """What an engine reports about one request at one point in time.

    `state` is set when the request enters a lifecycle state; `sequences` holds only
    sequences with news; `finished` is True on the last output of the request (every
    sequence finished, or the request was cancelled). `error` is set when the engine failed
    the request; such an output is always the last one. `preempted` is set on an output that
    only reports that the request left the running batch for the waiting queue to make room
    for another (core.scheduling); it resumes where it stopped, its stream unchanged.
    """

    request_id: str
    state: RequestState | None = None
    sequences: list[SequenceStep] = field(default_factory=list)
    prompt_logprobs: list[PromptTokenInfo] | None = None
    finished: bool = False
    cached_tokens: int = 0
    error: Exception | None = None
    time: float = 0.0
    preempted: bool = False


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Static facts and limits of a loaded engine (reported by GetModelInfo, enforced by
    core.validation).

    Attributes:
        engine: the engine kind ("hf", "trtllm", "trtllm-llm").
        max_context_length: tokens of one sequence, prompt and generated together.
        vocab_size: the tokenizer's vocabulary size; valid token ids are below it.
        max_num_beams: largest beam width (1: no beam search).
        max_n: most sequences of one request (n, or best_of when larger).
        unsupported_sampling_fields: SamplingOptions fields the engine cannot honour at a
            non-neutral value (validation refuses them).
        max_input_length: longest prompt in tokens (None: only the context bounds it).
        max_top_logprobs: most alternatives per generated token (0: the chosen token's only).
        supports_prompt_logprobs: whether OutputOptions.prompt_logprobs can be honoured.
        reproducible_seeds: whether a sampling request with the same seed and parameters
            reproduces; when False, sampling requests report no seed.
        guided_decoding: the Guide kinds (GUIDE_KINDS) the engine honours; empty: none.
        preemption: whether the engine preempts running requests for waiting ones of a higher
            priority or of a tenant under its share (core.scheduling; `--preemption`); the
            HF and TensorRT-LLM engines run every admitted request to its end.
    """

    engine: str
    max_context_length: int
    vocab_size: int
    max_num_beams: int = 1
    max_n: int = 16
    unsupported_sampling_fields: frozenset[str] = frozenset()
    max_input_length: int | None = None
    max_top_logprobs: int = 20
    supports_prompt_logprobs: bool = True
    reproducible_seeds: bool = True
    guided_decoding: frozenset[str] = frozenset()
    preemption: bool = False


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """A prefix cache's counters, in vLLM's meaning (vllm/v1/metrics/stats.py PrefixCacheStats).

    Attributes:
        queries: prompt tokens of the prompts looked up (a prompt that skipped the lookup, such
            as one asking for prompt logprobs, counts nothing).
        hits: prompt tokens whose keys and values came from the cache.
        blocks: blocks held now.
        capacity: blocks the store may hold (0 until the engine knows a block's size).
    """

    queries: int = 0
    hits: int = 0
    blocks: int = 0
    capacity: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Live counters of an engine: requests in the running batch and waiting in its queue, and
    its prefix cache's counters (None: the engine has no prefix cache, or it is off); for an
    engine in a process of its own, the times that process was restarted and the seconds it has
    gone without a step while requests were pending (0 when it steps or is idle)."""

    active: int
    queued: int
    prefix_cache: PrefixCacheStats | None = None
    restarts: int = 0
    stall_seconds: float = 0.0


# ---------------------------------------------------------------------------------------
# Request side, as converted from GenerateRequest (None = unset everywhere).


@dataclass(frozen=True, slots=True)
class ContentPart:
    """One part of a chat message: text, or an image URL (exactly one is set)."""

    text: str | None = None
    image_url: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call of an assistant turn: its id, the function's name, the arguments' JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call: name, description, parameters as JSON Schema text."""

    name: str
    description: str = ""
    parameters: str = ""


@dataclass(frozen=True, slots=True)
class ChatTemplateOptions:
    """How a chat is rendered (trellis.generate.v1.ChatMessages fields 3-5): whether the
    assistant's turn is opened, whether the last message is left open to be continued, and
    extra template variables as a JSON object's text ("" for none)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: str = ""


#: The rendering a chat gets when the request says nothing about it.
DEFAULT_TEMPLATE = ChatTemplateOptions()


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat message; `content` parts in order; `tool_calls` on assistant turns that called
    tools, `tool_call_id` on a "tool" message answering one."""

    role: str
    content: tuple[ContentPart, ...] = ()
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True, slots=True)
class StoppingOptions:
    """Stopping fields as the client sent them (see trellis.generate.v1.StoppingParams)."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    time_limit_ms: int | None = None
    truncate_input_tokens: int | None = None
    fill_context: bool | None = None


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """Output fields as the client sent them (see trellis.generate.v1.OutputOptions)."""

    logprobs: bool = False
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    tokens: bool | None = None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A whole Generate request; exactly one of text, token_ids, messages is set (or none
    when a session continues). `tools` go with `messages` to the chat template."""

    request_id: str
    model: str | None = None
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    sampling: SamplingOptions = SamplingOptions()
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    bad_words: tuple[str, ...] = ()
    stopping: StoppingOptions = StoppingOptions()
    output: OutputOptions = OutputOptions()
    session_id: str | None = None
    tools: tuple[Tool, ...] = ()
    guide: Guide | None = None
    # Who the session belongs to (core.sessions.session_key): the caller's key identity and
    # the gateway's tenant; "" for a core without keys and no tenant.
    session_scope: str = ""
    priority: int = 0
    tenant: str = ""
    adapter: str = ""
    template: ChatTemplateOptions = DEFAULT_TEMPLATE


# ---------------------------------------------------------------------------------------
# Response side, produced by the request pipeline and rendered by core.convert.


@dataclass(frozen=True, slots=True)
class TopToken:
    """An alternative token with its raw logprob."""

    id: int
    text: str
    bytes: bytes
    logprob: float
    special: bool = False


@dataclass(slots=True)
class TokenInfo:
    """A generated or prompt token as reported to clients."""

    id: int
    text: str
    bytes: bytes
    special: bool
    logprob: float | None = None
    top: list[TopToken] = field(default_factory=list)


@dataclass(slots=True)
class SequenceDelta:
    """What one sequence produced since its previous delta."""

    index: int
    text: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_sequence: str = ""
    stop_token_id: int | None = None
    cumulative_logprob: float | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Timing:
    """Milliseconds spent queued, in prefill, and in total."""

    queue_ms: float
    prefill_ms: float
    total_ms: float


@dataclass(frozen=True, slots=True)
class FinalInfo:
    """What the final message of a request carries."""

    usage: Usage
    seed: int | None
    effective: ResolvedSampling
    timing: Timing


@dataclass(slots=True)
class ResponseDelta:
    """One message of a Generate stream, before protobuf rendering."""

    state: RequestState | None = None
    sequences: list[SequenceDelta] = field(default_factory=list)
    prompt_text: str | None = None
    prompt_tokens: list[TokenInfo] | None = None
    final: FinalInfo | None = None
    session_continued: bool = False
    prompt_token_count: int | None = None
