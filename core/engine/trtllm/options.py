"""Our TensorRT-LLM options, typed, and the one mapping from them to upstream config objects.

`TrtllmOptions.from_config` reads the core's flags (`--max-batch-size`, `--max-queue-size`,
`--trt-*`); `executor_config()` builds the executor's `ExecutorConfig` and `llm_kwargs()` the
keywords of `tensorrt_llm.LLM(...)`. Nothing else in the engines reads CoreConfig's `trt_*`
fields.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from core.config import CoreConfig
from core.engine.trtllm.bindings import BindingApi, Bindings, LlmApi
from core.engine.trtllm.engine_dir import EngineLayout
from core.engine.trtllm.lora import HF_TO_TRTLLM
from core.engine.trtllm.reuse import EVENT_BUFFER_MAX_SIZE
from core.lora import startup_adapters

log = logging.getLogger(__name__)

SchedulerPolicy = Literal["guaranteed_no_evict", "max_utilization", "static_batch"]
Sampler = Literal["trtllm", "torch", "torch-legacy"]
"""The PyTorch backend's sampler: "trtllm" (the C++ TRTLLMSampler), "torch" (TorchSampler with
penalties, min_p and per-request seeds: PRs #16485, #16590, #17172, the only sampler after
PR #18232) or "torch-legacy" (TorchSampler before them: see `llm.TORCH_SAMPLER_GAPS`)."""

#: The first release without TRTLLMSampler and `sampler_type` (PR #18232, 2026-08-26; the 1.4
#: line from 1.4.0rc4). Its TorchSampler carries PRs #16485, #16590 and #17172, all merged before.
TORCH_SAMPLER_ONLY_FROM = "1.3.0rc26"
GuidedBackend = Literal["xgrammar", "llguidance", "none"]


@dataclass(frozen=True)
class TrtllmOptions:
    """Options of both TensorRT-LLM engines (see docs/tensorrt-llm.md for the flags).

    Attributes:
        max_batch_size: runtime cap of sequences in the batch (the engine's build value bounds it).
        max_queue_size: requests waiting before RESOURCE_EXHAUSTED (0: unlimited).
        max_num_tokens: batched tokens per step (None: the engine's value).
        kv_cache_free_gpu_memory_fraction: share of free GPU memory for the KV cache.
        enable_block_reuse: KV-cache block reuse across requests (--trt-enable-block-reuse and
            --prefix-cache: either one off turns it off).
        scheduler_policy: capacity scheduler policy (executor only).
        enable_chunked_context: chunked prefill (executor only).
        enable_chunked_prefill: chunked prefill where the LLM takes `enable_chunked_prefill`
            (LLM API only); off, prompts are limited to the LLM's `max_num_tokens`.
        iter_stats_max_iterations: iteration stats kept by the executor.
        request_stats_max_iterations: request stats kept; > 0 gives exact SCHEDULED/PREFILLED.
        await_timeout_ms: timeout of each await_responses call of the awaiter thread.
        tensor_parallel_size, pipeline_parallel_size: parallelism of the LLM API engine.
        max_n: largest n / best_of per request.
        guided_decoding_backend: the runtime's grammar backend for guided decoding ("none": off).
        max_loras: LoRA adapters the executor's PEFT cache holds at once (`--max-loras`; 0:
            no adapters), see `peft_cache_config`.
        max_lora_rank: `--max-lora-rank` (the LLM API's `LoraConfig.max_lora_rank`; an
            engine directory records its own).
        lora_dirs: the adapters registered at start (core.lora.startup_adapters), whose
            directories the LLM API's `LoraConfig(lora_dir=...)` names.
        lora_management: `--enable-lora-management` (the LLM then takes a LoraConfig even
            with no adapter at start).
    """

    max_batch_size: int = 32
    max_queue_size: int = 256
    max_num_tokens: int | None = None
    kv_cache_free_gpu_memory_fraction: float = 0.9
    enable_block_reuse: bool = True
    scheduler_policy: SchedulerPolicy = "guaranteed_no_evict"
    enable_chunked_context: bool = False
    enable_chunked_prefill: bool = True
    iter_stats_max_iterations: int = 1000
    request_stats_max_iterations: int = 0
    await_timeout_ms: int = 5
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_n: int = 16
    guided_decoding_backend: GuidedBackend = "xgrammar"
    max_loras: int = 4
    max_lora_rank: int = 16
    lora_dirs: tuple[str, ...] = ()
    lora_management: bool = False

    @classmethod
    def from_config(cls, config: CoreConfig) -> TrtllmOptions:
        """Options of a CoreConfig.

        Raises:
            ValueError: an unknown scheduler policy name.
        """
        policies: dict[str, SchedulerPolicy] = {
            "guaranteed_no_evict": "guaranteed_no_evict",
            "max_utilization": "max_utilization",
            "static_batch": "static_batch",
        }
        policy = policies.get(config.trt_scheduler_policy)
        if policy is None:
            raise ValueError(f"unknown --trt-scheduler-policy {config.trt_scheduler_policy!r}")
        backends: dict[str, GuidedBackend] = {"xgrammar": "xgrammar", "llguidance": "llguidance", "none": "none"}
        backend = backends.get(config.trt_guided_decoding_backend)
        if backend is None:
            raise ValueError(f"unknown --trt-guided-decoding-backend {config.trt_guided_decoding_backend!r}")
        return cls(
            max_batch_size=config.max_batch_size,
            max_queue_size=config.max_queue_size,
            max_num_tokens=config.trt_max_num_tokens or None,
            kv_cache_free_gpu_memory_fraction=config.trt_kv_cache_free_gpu_memory_fraction,
            # One switch for every engine's prefix reuse (--no-prefix-cache), and the TensorRT-LLM one.
            enable_block_reuse=config.trt_enable_block_reuse and config.prefix_cache,
            scheduler_policy=policy,
            enable_chunked_context=config.trt_enable_chunked_context,
            enable_chunked_prefill=config.trt_enable_chunked_prefill,
            iter_stats_max_iterations=config.trt_iter_stats_max_iterations,
            request_stats_max_iterations=config.trt_request_stats_max_iterations,
            await_timeout_ms=max(1, config.trt_await_timeout_ms),
            tensor_parallel_size=config.trt_tensor_parallel_size,
            pipeline_parallel_size=config.trt_pipeline_parallel_size,
            max_n=config.max_n,
            guided_decoding_backend=backend,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            lora_dirs=tuple(path for _, path in startup_adapters(config.model, config.lora_modules)),
            lora_management=config.enable_lora_management,
        )


def guided_decoding_config(tl: Bindings, api: BindingApi, opts: TrtllmOptions, tokenizer_info: dict[str, Any]) -> Any:
    """The executor's `GuidedDecodingConfig` (XGrammar, described by `tokenizer_info`:
    mapping.xgrammar_tokenizer_info), or None when guided decoding is off or the release has
    none (before 0.16).

    Raises:
        RuntimeError: --trt-guided-decoding-backend llguidance, which the C++ runtime refuses
            ("LLGuidance is not supported for guided decoding in C++ runtime.",
            `batch_manager/guidedDecoder.cpp`).
    """
    if opts.guided_decoding_backend == "none" or not api.guide_types:
        return None
    if opts.guided_decoding_backend == "llguidance":
        raise RuntimeError(
            "--trt-guided-decoding-backend llguidance works with --engine trtllm-llm only; the C++ executor's "
            "guided decoding has the xgrammar backend"
        )
    backend = tl.GuidedDecodingConfig.GuidedDecodingBackend.XGRAMMAR
    return tl.GuidedDecodingConfig(backend, **tokenizer_info)


def executor_config(
    tl: Bindings, api: BindingApi, opts: TrtllmOptions, layout: EngineLayout, guided: Any = None
) -> Any:
    """The executor's `ExecutorConfig`.

    Optional fields go through the constructor, where every release that has them takes them
    (0.11 takes max_batch_size there but has no property for it); a release without one gets
    the engine's value, and without max_queue_size the engine bounds its own queue. Block reuse
    is turned off with a warning when the engine lacks paged context FMHA; with it on, KV cache
    events are kept (`event_buffer_max_size`, reuse.EVENT_BUFFER_MAX_SIZE) where the release
    has them (`api.kv_events`). `guided` is the
    `guided_decoding_config` (`guided_decoding_config()`; None: left out).
    `normalize_log_probs` is always False where the release has it: normalized, the runtime
    reports each token's logprob in the top-k/top-p truncated distribution, 0.0 for every
    greedy token (`ExecutorConfig` defaulted to True until PR #12366, March 2026;
    triton-inference-server/tensorrtllm_backend issue #276, NVIDIA/TensorRT-LLM issue #2406).

    Raises:
        RuntimeError: chunked context asked of an engine without paged context FMHA, or a
            scheduler policy this release does not have.
    """
    try:
        policy = getattr(tl.CapacitySchedulerPolicy, opts.scheduler_policy.upper())
    except AttributeError:
        raise RuntimeError(
            f"--trt-scheduler-policy {opts.scheduler_policy} is not available in this TensorRT-LLM release"
        ) from None
    reuse = opts.enable_block_reuse
    if reuse and not layout.paged_context_fmha:
        log.warning("KV-cache block reuse needs an engine built with --use-paged-context-fmha; disabled")
        reuse = False
    if opts.enable_chunked_context and not layout.paged_context_fmha:
        raise RuntimeError(
            "--trt-enable-chunked-context needs an engine built with paged context FMHA "
            "(scripts/build_trtllm_engine.py --use-paged-context-fmha)"
        )
    wanted: dict[str, int | None] = {
        "max_batch_size": min(opts.max_batch_size, layout.max_batch_size),
        "max_num_tokens": opts.max_num_tokens,
        "max_queue_size": opts.max_queue_size or None,
    }
    optional: dict[str, Any] = {} if guided is None else {"guided_decoding_config": guided}
    peft = peft_cache_config(tl, opts, layout)
    if peft is not None:
        optional["peft_cache_config"] = peft
    if api.normalize_log_probs:
        optional["normalize_log_probs"] = False
    for name, value in wanted.items():
        if value is None:
            continue
        if name in api.executor_config_fields:
            optional[name] = value
        elif name != "max_queue_size":  # the engine bounds its own queue instead
            log.warning("this TensorRT-LLM release has no ExecutorConfig.%s; using the engine's value", name)
    return tl.ExecutorConfig(
        max_beam_width=1,
        scheduler_config=tl.SchedulerConfig(policy),
        kv_cache_config=tl.KvCacheConfig(
            enable_block_reuse=reuse,
            free_gpu_memory_fraction=opts.kv_cache_free_gpu_memory_fraction,
            **({"event_buffer_max_size": EVENT_BUFFER_MAX_SIZE} if reuse and api.kv_events else {}),
        ),
        enable_chunked_context=opts.enable_chunked_context,
        iter_stats_max_iterations=opts.iter_stats_max_iterations,
        request_stats_max_iterations=opts.request_stats_max_iterations,
        **optional,
    )


def peft_cache_config(tl: Bindings, opts: TrtllmOptions, layout: EngineLayout) -> Any:
    """The executor's `PeftCacheConfig` for an engine built with the LoRA plugin, None
    otherwise (or with --max-loras 0).

    Sized in the cache's own unit, "module layers" (one module of one layer at
    `max_adapter_size`; `PeftCacheConfig(num_host_module_layer, num_device_module_layer,
    optimal_adapter_size, max_adapter_size, ...)`, bindings of 0.11 to 1.3,
    cpp/include/tensorrt_llm/executor/executor.h): `--max-loras` adapters of every layer and
    every module the engine adapts, on the device and on the host. Beyond that the cache
    evicts the least recently used task no request uses, and that task's next request is
    answered "not found in cache" (core.engine.trtllm.lora).
    """
    if not layout.lora_modules or opts.max_loras <= 0:
        return None
    module_layers = opts.max_loras * max(1, layout.num_layers) * len(layout.lora_modules)
    return tl.PeftCacheConfig(
        num_host_module_layer=module_layers,
        num_device_module_layer=module_layers,
        optimal_adapter_size=layout.max_lora_rank,
        max_adapter_size=layout.max_lora_rank,
    )


def llm_serves_lora(api: LlmApi, opts: TrtllmOptions) -> bool:
    """Whether the LLM API engine serves LoRA adapters: the release has `LoRARequest` and a
    `lora_config` LLM argument, --max-loras > 0, and there are adapters at start or
    --enable-lora-management."""
    return (
        api.lora_request is not None
        and api.lora_config is not None
        and "lora_config" in api.llm_args
        and opts.max_loras > 0
        and bool(opts.lora_dirs or opts.lora_management)
    )


def llm_lora_config(api: LlmApi, opts: TrtllmOptions) -> Any:
    """The LLM's `LoraConfig` (examples/llm-api/llm_multilora.py: `LoraConfig(lora_dir=[...],
    max_lora_rank=64, max_loras=3, max_cpu_loras=3)`): the adapters of the start, which the
    LLM reads their target modules from; with none (run-time loading only) every module the
    HF-to-TensorRT-LLM map knows (`lora_target_modules`), as the LLM cannot infer them."""
    extra: dict[str, Any] = {} if opts.lora_dirs else {"lora_target_modules": sorted(set(HF_TO_TRTLLM.values()))}
    return api.lora_config(
        lora_dir=list(opts.lora_dirs),
        max_lora_rank=opts.max_lora_rank,
        max_loras=opts.max_loras,
        max_cpu_loras=opts.max_loras,
        **extra,
    )


EXECUTOR_ONLY = (
    ("--trt-scheduler-policy", "scheduler_policy", "guaranteed_no_evict"),
    ("--trt-enable-chunked-context", "enable_chunked_context", False),
    ("--trt-request-stats-max-iterations", "request_stats_max_iterations", 0),
)


def llm_kwargs(api: LlmApi, opts: TrtllmOptions, *, tokenizer_dir: str) -> tuple[dict[str, Any], Sampler]:
    """Keywords of `tensorrt_llm.LLM(model, **kwargs)` and the sampler they select.

    The sampler is chosen by what the release has (`select_sampler`). Chunked prefill is
    turned on where the LLM takes `enable_chunked_prefill`, unless `opts.enable_chunked_prefill`
    is off (then it is sent as False): without it `llm.py` `_check_arguments` refuses any
    prompt longer than `max_num_tokens` (8192 by default) on the PyTorch backend, however long
    the context; upstream turns it off again, with a warning, for attention backends that
    cannot chunk (`_torch/pyexecutor/py_executor_creator.py`).
    Block reuse follows `opts.enable_block_reuse`; with it on, KV cache events are kept
    (`event_buffer_max_size`) where the release has them (`api.kv_events`).
    Executor-only flags that were changed are logged as ignored. Guided decoding goes on with
    `guided_decoding_backend` (`llmapi/llm_args.py`: "xgrammar" or "llguidance", the latter
    on the PyTorch backend only) where the release takes it, with the LLM's tokenizer loaded.
    """
    ignored = [flag for flag, name, default in EXECUTOR_ONLY if getattr(opts, name) != default]
    if ignored:
        log.warning("trtllm-llm engine: %s apply to --engine trtllm only; ignored", ", ".join(ignored))
    kwargs: dict[str, Any] = {
        "tokenizer": tokenizer_dir,
        "skip_tokenizer_init": True,
        "tensor_parallel_size": opts.tensor_parallel_size,
        "pipeline_parallel_size": opts.pipeline_parallel_size,
        "max_batch_size": opts.max_batch_size,
        "kv_cache_config": api.kv_cache_config(
            free_gpu_memory_fraction=opts.kv_cache_free_gpu_memory_fraction,
            enable_block_reuse=opts.enable_block_reuse,
            **({"event_buffer_max_size": EVENT_BUFFER_MAX_SIZE} if opts.enable_block_reuse and api.kv_events else {}),
        ),
    }
    if opts.max_num_tokens:
        kwargs["max_num_tokens"] = opts.max_num_tokens
    if llm_serves_lora(api, opts):
        kwargs["lora_config"] = llm_lora_config(api, opts)
    if "enable_chunked_prefill" in api.llm_args:
        kwargs["enable_chunked_prefill"] = opts.enable_chunked_prefill
    if opts.guided_decoding_backend != "none" and "guided_decoding_backend" in api.llm_args:
        kwargs["guided_decoding_backend"] = opts.guided_decoding_backend
        # The grammar backend is described by the LLM's own tokenizer (`llmapi/llm.py`:
        # GuidedDecodingConfig(**_xgrammar_tokenizer_info(self.tokenizer))), which
        # skip_tokenizer_init leaves unloaded; token ids in and detokenize=False still hold.
        kwargs["skip_tokenizer_init"] = False
    switch, sampler = select_sampler(api)
    return kwargs | switch, sampler


def select_sampler(api: LlmApi) -> tuple[dict[str, Any], Sampler]:
    """The LLM keywords that pick the sampler, and the sampler the release will run, by era
    (`llmapi/llm_args.py` and `_torch/pyexecutor/_util.py` of each):

      * `sampler_type` with a TRTLLMSampler member (1.1 after PR #6831 to the releases before
        PR #18232; deprecated by PR #11938, March 2026): ask for "TRTLLMSampler", which honours
        penalties, min_p and per-request seeds where TorchSampler long did not;
      * `use_torch_sampler` (the 1.1 pre-releases between PR #6216 and PR #6831): TRTLLMSampler
        is the default; `use_torch_sampler=False` says so;
      * `enable_trtllm_sampler` (1.0, `docs/source/1.0/features/sampling.md`): ask for it;
      * none of them from TORCH_SAMPLER_ONLY_FROM on (also a `sampler_type` without a
        TRTLLMSampler member): TorchSampler is the only sampler and has penalties, min_p and
        per-request seeds;
      * none of them before: the early TorchSampler without those ("torch-legacy").
    """
    args = api.llm_args
    if "sampler_type" in args and (not api.sampler_types or "TRTLLMSampler" in api.sampler_types):
        return {"sampler_type": "TRTLLMSampler"}, "trtllm"
    if "use_torch_sampler" in args:
        return {"use_torch_sampler": False}, "trtllm"
    if "enable_trtllm_sampler" in args:
        return {"enable_trtllm_sampler": True}, "trtllm"
    if args and release_at_least(api.version, TORCH_SAMPLER_ONLY_FROM):
        return {}, "torch"
    return {}, "torch-legacy"


def release_at_least(version: str, first: str) -> bool:
    """Whether a TensorRT-LLM `__version__` (PEP 440: "1.3.0rc26") is `first` or later;
    False for an unparsable one ("unknown")."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) >= Version(first)
    except InvalidVersion:
        return False
