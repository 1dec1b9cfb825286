from google.protobuf import any_pb2 as _any_pb2
from trellis.generate.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "text", "token_ids", "messages", "sampling", "stopping", "output", "session_id", "guided_decoding", "tenant", "priority", "adapter", "trace_context")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GUIDED_DECODING_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    token_ids: _generate_pb2.TokenIds
    messages: _generate_pb2.ChatMessages
    sampling: _generate_pb2.SamplingParams
    stopping: _generate_pb2.StoppingParams
    output: _generate_pb2.OutputOptions
    session_id: str
    guided_decoding: _generate_pb2.GuidedDecoding
    tenant: str
    priority: int
    adapter: str
    trace_context: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_generate_pb2.TokenIds, _Mapping]] = ..., messages: _Optional[_Union[_generate_pb2.ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[_generate_pb2.StoppingParams, _Mapping]] = ..., output: _Optional[_Union[_generate_pb2.OutputOptions, _Mapping]] = ..., session_id: _Optional[str] = ..., guided_decoding: _Optional[_Union[_generate_pb2.GuidedDecoding, _Mapping]] = ..., tenant: _Optional[str] = ..., priority: _Optional[int] = ..., adapter: _Optional[str] = ..., trace_context: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "state", "outputs", "prompt_text", "prompt_tokens", "usage", "seed", "effective_sampling", "timing", "session_continued", "prompt_token_count")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    SESSION_CONTINUED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: _generate_pb2.GenerateState
    outputs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.SequenceOutput]
    prompt_text: str
    prompt_tokens: _containers.RepeatedCompositeFieldContainer[_generate_pb2.Token]
    usage: _generate_pb2.Usage
    seed: int
    effective_sampling: _generate_pb2.SamplingParams
    timing: _generate_pb2.Timing
    session_continued: bool
    prompt_token_count: int
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[_generate_pb2.GenerateState, str]] = ..., outputs: _Optional[_Iterable[_Union[_generate_pb2.SequenceOutput, _Mapping]]] = ..., prompt_text: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[_Union[_generate_pb2.Token, _Mapping]]] = ..., usage: _Optional[_Union[_generate_pb2.Usage, _Mapping]] = ..., seed: _Optional[int] = ..., effective_sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., timing: _Optional[_Union[_generate_pb2.Timing, _Mapping]] = ..., session_continued: _Optional[bool] = ..., prompt_token_count: _Optional[int] = ...) -> None: ...

class MultiplexGenerateRequest(_message.Message):
    __slots__ = ("starts", "cancels")
    STARTS_FIELD_NUMBER: _ClassVar[int]
    CANCELS_FIELD_NUMBER: _ClassVar[int]
    starts: _containers.RepeatedCompositeFieldContainer[MultiplexStart]
    cancels: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, starts: _Optional[_Iterable[_Union[MultiplexStart, _Mapping]]] = ..., cancels: _Optional[_Iterable[int]] = ...) -> None: ...

class MultiplexStart(_message.Message):
    __slots__ = ("id", "request", "steps")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    id: int
    request: GenerateRequest
    steps: bool
    def __init__(self, id: _Optional[int] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., steps: _Optional[bool] = ...) -> None: ...

class MultiplexGenerateResponse(_message.Message):
    __slots__ = ("events", "steps")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[MultiplexEvent]
    steps: Steps
    def __init__(self, events: _Optional[_Iterable[_Union[MultiplexEvent, _Mapping]]] = ..., steps: _Optional[_Union[Steps, _Mapping]] = ...) -> None: ...

class Steps(_message.Message):
    __slots__ = ("ids", "texts", "token_ids", "logprobs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., texts: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class MultiplexEvent(_message.Message):
    __slots__ = ("id", "responses", "status")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    id: int
    responses: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    status: Status
    def __init__(self, id: _Optional[int] = ..., responses: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., status: _Optional[_Union[Status, _Mapping]] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    details: _containers.RepeatedCompositeFieldContainer[_any_pb2.Any]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., details: _Optional[_Iterable[_Union[_any_pb2.Any, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_name", "model_version", "engine", "max_context_length", "max_new_tokens", "default_max_new_tokens", "vocab_size", "has_chat_template", "accepts_images", "max_num_beams", "max_top_logprobs", "max_stop_sequences", "greedy_defaults", "sampling_defaults", "unsupported_sampling_fields", "max_n", "guided_decoding", "max_input_tokens", "adapters", "max_loras", "model_aliases")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BEAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    GREEDY_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    UNSUPPORTED_SAMPLING_FIELDS_FIELD_NUMBER: _ClassVar[int]
    MAX_N_FIELD_NUMBER: _ClassVar[int]
    GUIDED_DECODING_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ALIASES_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    engine: str
    max_context_length: int
    max_new_tokens: int
    default_max_new_tokens: int
    vocab_size: int
    has_chat_template: bool
    accepts_images: bool
    max_num_beams: int
    max_top_logprobs: int
    max_stop_sequences: int
    greedy_defaults: _generate_pb2.SamplingParams
    sampling_defaults: _generate_pb2.SamplingParams
    unsupported_sampling_fields: _containers.RepeatedScalarFieldContainer[str]
    max_n: int
    guided_decoding: _containers.RepeatedScalarFieldContainer[str]
    max_input_tokens: int
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    max_loras: int
    model_aliases: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[str] = ..., engine: _Optional[str] = ..., max_context_length: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., default_max_new_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., accepts_images: _Optional[bool] = ..., max_num_beams: _Optional[int] = ..., max_top_logprobs: _Optional[int] = ..., max_stop_sequences: _Optional[int] = ..., greedy_defaults: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., sampling_defaults: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., unsupported_sampling_fields: _Optional[_Iterable[str]] = ..., max_n: _Optional[int] = ..., guided_decoding: _Optional[_Iterable[str]] = ..., max_input_tokens: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., max_loras: _Optional[int] = ..., model_aliases: _Optional[_Iterable[str]] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "path", "rank", "resident", "running", "waiting")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    resident: bool
    running: int
    waiting: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., resident: _Optional[bool] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "max_loras")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    max_loras: int
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., max_loras: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: AdapterInfo
    def __init__(self, adapter: _Optional[_Union[AdapterInfo, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "messages")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    text: str
    messages: _generate_pb2.ChatMessages
    def __init__(self, text: _Optional[str] = ..., messages: _Optional[_Union[_generate_pb2.ChatMessages, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "rendered_prompt", "spans")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RENDERED_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    rendered_prompt: str
    spans: _containers.RepeatedCompositeFieldContainer[TokenSpan]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., rendered_prompt: _Optional[str] = ..., spans: _Optional[_Iterable[_Union[TokenSpan, _Mapping]]] = ...) -> None: ...

class TokenSpan(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...
