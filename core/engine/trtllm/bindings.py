"""Importing TensorRT-LLM and detecting what the installed release offers.

Binding names changed across releases, so nothing is assumed: every name is probed once at
start and recorded in `BindingApi` / `LlmApi`. The shapes probed for, as read in upstream
source (NVIDIA/TensorRT-LLM):
  * 0.11 (`cpp/tensorrt_llm/pybind/executor/bindings.cpp`, main at 0.11.0.dev2024062500, the
    0.11 branch point): `Request(input_token_ids, max_new_tokens, streaming, ...)` and
    `SamplingConfig(beam_width, top_k, ..., random_seed, temperature, min_length, ...)` are
    positional-or-keyword with the old names only; no num_return_sequences; `Result` has no
    finish_reasons/sequence_index; `Response` has no client_id; `ExecutorConfig` takes
    max_batch_size in its constructor but has no such property, and has neither
    max_num_tokens nor max_queue_size; `CapacitySchedulerPolicy` lacks STATIC_BATCH.
  * 0.14-0.15 (same file, keyword-only `Request(input_token_ids, *, max_tokens=None,
    max_new_tokens=None, ...)` logging "max_new_tokens is being deprecated"): FinishReason
    with NOT_FINISHED/END_ID/STOP_WORDS/LENGTH, Result.finish_reasons/sequence_index/
    is_sequence_final, num_return_sequences on Request (not yet on SamplingConfig).
  * 1.x (`cpp/tensorrt_llm/pybind/executor/request.cpp`, and the nanobind copy):
    `Request(input_token_ids, max_tokens, *, ...)`, FinishReason adds TIMED_OUT/CANCELLED,
    SamplingConfig has num_return_sequences and min_p.
  * Guided decoding: `GuidedDecodingParams(guide_type, guide=None)` with
    `GuidedDecodingParams.GuideType` (JSON, JSON_SCHEMA, REGEX, EBNF_GRAMMAR; STRUCTURAL_TAG
    from 1.0) and `Request(..., guided_decoding_params=...)` (`request.cpp`), and
    `GuidedDecodingConfig(backend, encoded_vocab=None, tokenizer_str=None, stop_token_ids=None)`
    with `GuidedDecodingConfig.GuidedDecodingBackend` (XGRAMMAR; LLGUIDANCE from 1.0, which the
    C++ runtime refuses: `batch_manager/guidedDecoder.cpp`) as
    `ExecutorConfig(guided_decoding_config=...)` (`executorConfig.cpp`). First released in
    0.16.0 ("Added guided decoding support with XGrammar backend", docs/source/release-notes.md);
    0.18.x builds on 0.17.0; Triton's tensorrtllm_backend sends them from v0.19.0.
The executor class itself is gone after v1.3.0rc20; the LLM API is then the only way in.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

INSTALL_HINT = "pip install 'trellis[trtllm]'"

Bindings = Any
"""The `tensorrt_llm.bindings.executor` module (untyped: TensorRT-LLM ships no stubs)."""

EXECUTOR_CONFIG_FIELDS = ("max_batch_size", "max_num_tokens", "max_queue_size")


def import_bindings() -> Bindings:
    """Import `tensorrt_llm.bindings.executor`.

    Raises:
        RuntimeError: TensorRT-LLM is missing (the message names the `trtllm` extra), the
            installed release no longer has the executor (removed after v1.3.0rc20), or it is
            older than 0.11 (its `SchedulerPolicy` API is not supported).
    """
    try:
        tl = importlib.import_module("tensorrt_llm.bindings.executor")
    except ImportError as e:
        raise RuntimeError(
            f"--engine trtllm needs TensorRT-LLM, which is not installed ({e}). On a machine with an NVIDIA GPU run "
            f"{INSTALL_HINT} (releases 0.11 to 1.2.x or 1.3.0rc20 have the executor); see docs/tensorrt-llm.md."
        ) from e
    if not hasattr(tl, "Executor"):
        raise RuntimeError(
            f"The installed TensorRT-LLM ({release_of(tl)}) no longer ships the C++ executor (removed after "
            "v1.3.0rc20); serve it with --engine trtllm-llm, or install a release up to 1.2.x for --engine trtllm."
        )
    if not hasattr(tl, "CapacitySchedulerPolicy"):
        raise RuntimeError(
            "The installed TensorRT-LLM is older than 0.11 (its executor has SchedulerPolicy, not "
            f"CapacitySchedulerPolicy); --engine trtllm needs 0.11 or later: {INSTALL_HINT}."
        )
    return tl


def release_of(module: Any) -> str:
    """The module's `__version__` (the executor bindings have one from 0.12), else "unknown"."""
    return str(getattr(module, "__version__", "unknown"))


@dataclass(frozen=True)
class BindingApi:
    """Names and features of the installed executor bindings, detected once.

    Attributes:
        max_tokens: Request keyword for the number of tokens to generate.
        seed, min_tokens: SamplingConfig keywords.
        num_return_sequences: SamplingConfig takes num_return_sequences (n > 1 possible).
        min_p: SamplingConfig takes min_p.
        finish_reasons: Result carries finish_reasons; otherwise the engine infers them.
        executor_config_fields: optional ExecutorConfig constructor keywords that exist.
        guide_types: the GuidedDecodingParams.GuideType names of the release (empty: no
            guided decoding, before 0.16).
        normalize_log_probs: ExecutorConfig takes normalize_log_probs (every release with the
            executor; `executorConfig.cpp`, default True until PR #12366, March 2026).
        perf_metrics: `OutputConfig(return_perf_metrics=...)` exists and a `Result` carries
            `request_perf_metrics` (0.16 and later: `request.cpp`; Triton's tensorrtllm_backend
            reads `result.request_perf_metrics.kv_cache_metrics` from v0.16.0).
        kv_events: `KvCacheConfig(event_buffer_max_size=...)` and
            `Executor.get_kv_cache_event_manager()` exist (`executorConfig.cpp`, `executor.cpp`).
        priority: Request takes `priority` (a float in [0, 1], default 0.5, higher first:
            `executor.h` `Request::kDefaultPriority`, and `insertRequestInOrder` in
            `cpp/tensorrt_llm/executor/requestUtils.cpp` keeps the executor's queue in
            descending priority, arrival order among equals; 0.14 on, not 0.11).
    """

    max_tokens: str = "max_tokens"
    seed: str = "seed"
    min_tokens: str = "min_tokens"
    num_return_sequences: bool = True
    min_p: bool = True
    finish_reasons: bool = True
    executor_config_fields: frozenset[str] = frozenset(EXECUTOR_CONFIG_FIELDS)
    guide_types: frozenset[str] = frozenset()
    normalize_log_probs: bool = True
    perf_metrics: bool = True
    kv_events: bool = True
    priority: bool = True


def _accepts(ctor: Callable[..., object], *args: object, **kwargs: object) -> bool:
    try:
        ctor(*args, **kwargs)
    except TypeError:  # pybind11/nanobind: "incompatible constructor arguments"
        return False
    return True


def detect_api(tl: Bindings) -> BindingApi:
    """Probe the bindings: try the recent name, fall back on TypeError."""
    sc = tl.SamplingConfig
    fields = frozenset(
        name for name in EXECUTOR_CONFIG_FIELDS if _accepts(tl.ExecutorConfig, max_beam_width=1, **{name: 1})
    )
    max_tokens = "max_tokens" if _accepts(tl.Request, input_token_ids=[0], max_tokens=1) else "max_new_tokens"
    return BindingApi(
        max_tokens=max_tokens,
        seed="seed" if _accepts(sc, beam_width=1, seed=1) else "random_seed",
        min_tokens="min_tokens" if _accepts(sc, beam_width=1, min_tokens=1) else "min_length",
        num_return_sequences=_accepts(sc, beam_width=1, num_return_sequences=1),
        min_p=_accepts(sc, beam_width=1, min_p=0.0),
        finish_reasons=hasattr(tl.Result(), "finish_reasons"),
        executor_config_fields=fields,
        guide_types=_guide_types(tl),
        normalize_log_probs=_accepts(tl.ExecutorConfig, max_beam_width=1, normalize_log_probs=False),
        perf_metrics=_accepts(tl.OutputConfig, return_perf_metrics=True)
        and hasattr(tl.Result(), "request_perf_metrics"),
        kv_events=_accepts(tl.KvCacheConfig, event_buffer_max_size=1)
        and hasattr(tl.Executor, "get_kv_cache_event_manager"),
        priority=_accepts(tl.Request, input_token_ids=[0], **{max_tokens: 1}, priority=0.5),
    )


def _guide_types(tl: Bindings) -> frozenset[str]:
    """GuideType names, when the release has both guided decoding classes."""
    params = getattr(tl, "GuidedDecodingParams", None)
    if params is None or not hasattr(tl, "GuidedDecodingConfig"):
        return frozenset()
    return frozenset(str(name) for name in params.GuideType.__members__)


# ------------------------------------------------------------------------------------ LLM API


@dataclass(frozen=True)
class LlmApi:
    """The installed LLM API (`tensorrt_llm.LLM`, 1.x).

    Attributes:
        llm: the `LLM` class.
        sampling_params: the `SamplingParams` class.
        kv_cache_config: `tensorrt_llm.llmapi.KvCacheConfig`.
        request_error: `tensorrt_llm.executor.utils.RequestError` (a RuntimeError subclass,
            raised for one request's failure), or None where the release has none.
        guided_decoding_params: `tensorrt_llm.sampling_params.GuidedDecodingParams` (also
            exported by `tensorrt_llm.llmapi`), or None where the release has none.
        llm_args: field names `LLM(**kwargs)` accepts (its pydantic args model forbids
            others); empty when they cannot be read.
        version: `tensorrt_llm.__version__`.
        sampler_types: the members of `tensorrt_llm.llmapi.llm_args.SamplerType` (the values
            `sampler_type` takes, 1.1 to the releases before PR #18232); empty where the
            release has no such enum.
        perf_metrics: `SamplingParams` has `return_perf_metrics` (1.0 and later: "Add
            request_perf_metrics to LLMAPI", 1.0 release notes), so each CompletionOutput can
            carry `request_perf_metrics`.
        kv_events: `KvCacheConfig` has `event_buffer_max_size` and `LLM` has
            `get_kv_cache_events` (`llmapi/llm.py`, `llmapi/llm_args.py`).
        lora_request: `tensorrt_llm.executor.LoRARequest(lora_name, lora_int_id, lora_path)`
            (`executor/request.py`), or None where the release has none.
        lora_config: the LLM's `LoraConfig(lora_dir, max_lora_rank, max_loras,
            max_cpu_loras, ...)` (`tensorrt_llm/lora_helper.py` in 1.x, `lora_manager.py`
            before), or None where the release has none.
    """

    llm: Any
    sampling_params: Any
    kv_cache_config: Any
    request_error: type[BaseException] | None
    llm_args: frozenset[str]
    version: str
    guided_decoding_params: Any = None
    sampler_types: frozenset[str] = frozenset()
    perf_metrics: bool = False
    kv_events: bool = False
    lora_request: Any = None
    lora_config: Any = None


def import_llm_api() -> LlmApi:
    """`LLM`, `SamplingParams`, `KvCacheConfig` and `RequestError` of the installed release.

    Raises:
        RuntimeError: TensorRT-LLM is missing (the message names the `trtllm` extra).
    """
    try:
        top = importlib.import_module("tensorrt_llm")
        llmapi = importlib.import_module("tensorrt_llm.llmapi")
    except ImportError as e:
        raise RuntimeError(
            f"--engine trtllm-llm needs TensorRT-LLM 1.x, which is not installed ({e}). On a machine with an NVIDIA "
            f"GPU run {INSTALL_HINT}; see docs/tensorrt-llm.md."
        ) from e
    request_error: type[BaseException] | None = None
    try:
        request_error = importlib.import_module("tensorrt_llm.executor.utils").RequestError
    except (ImportError, AttributeError):
        executor_pkg = importlib.import_module("tensorrt_llm.executor")
        request_error = getattr(executor_pkg, "RequestError", None)
    return LlmApi(
        llm=top.LLM,
        sampling_params=top.SamplingParams,
        kv_cache_config=llmapi.KvCacheConfig,
        request_error=request_error,
        llm_args=_llm_arg_names(llmapi),
        version=release_of(top),
        guided_decoding_params=getattr(llmapi, "GuidedDecodingParams", None),
        sampler_types=_sampler_types(),
        perf_metrics="return_perf_metrics" in _field_names(top.SamplingParams),
        kv_events="event_buffer_max_size" in _field_names(llmapi.KvCacheConfig)
        and hasattr(top.LLM, "get_kv_cache_events"),
        lora_request=getattr(importlib.import_module("tensorrt_llm.executor"), "LoRARequest", None),
        lora_config=_first_attr(("tensorrt_llm.lora_helper", "tensorrt_llm.lora_manager"), "LoraConfig"),
    )


def _first_attr(modules: tuple[str, ...], name: str) -> Any:
    """`name` from the first of `modules` that has it (None when none does)."""
    for module in modules:
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    return None


def _field_names(cls: Any) -> frozenset[str]:
    """Field names of a dataclass (`SamplingParams`) or a pydantic model (`KvCacheConfig`)."""
    fields = getattr(cls, "__dataclass_fields__", None) or getattr(cls, "model_fields", None) or {}
    return frozenset(str(k) for k in fields)


def _sampler_types() -> frozenset[str]:
    """Members of `llmapi/llm_args.py` `SamplerType` (TRTLLMSampler, TorchSampler, auto)."""
    try:
        enum = importlib.import_module("tensorrt_llm.llmapi.llm_args").SamplerType
    except (ImportError, AttributeError):
        return frozenset()
    return frozenset(str(name) for name in getattr(enum, "__members__", {}))


def _llm_arg_names(llmapi: Any) -> frozenset[str]:
    """Field names of the LLM's args model (`TorchLlmArgs` in 1.x, `LlmArgs` before)."""
    for name in ("TorchLlmArgs", "LlmArgs"):
        args = getattr(llmapi, name, None)
        fields = getattr(args, "model_fields", None)
        if isinstance(fields, dict):
            return frozenset(str(k) for k in fields)
    return frozenset()
