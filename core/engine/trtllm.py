"""TensorRT-LLM executor engine (`trellis-core --engine trtllm --model <engine dir>`).

Drives TensorRT-LLM's C++ in-flight batching executor (`tensorrt_llm.bindings.executor`) over
a prebuilt TensorRT engine directory. Token level only: the tokenizer, detokenization, stop
strings, logprob formatting and sessions are the core's shared request pipeline.

Every API fact used here is in `shared/reference/trtllm-executor.md` (cited as §N). In short:
  * TensorRT-LLM is imported lazily (`import core` never needs it); without it the factory
    raises RuntimeError naming `pip install 'trellis[trtllm]'`.
  * Binding names changed across releases (§1.6, §1.8, §7.1): everything is passed by keyword,
    and `max_tokens`/`max_new_tokens`, `seed`/`random_seed`, `min_tokens`/`min_length`,
    `num_return_sequences`, `min_p` and the ExecutorConfig fields are feature-detected once at
    start (`detect_api`). Releases 0.9 to 1.2.x and 1.3.0rc<=20 have the executor; later ones
    only the LLM API (`--engine trtllm-llm`, core.engine.trtllm_llm).
  * One awaiter thread loops `await_responses(timeout)` (which releases the GIL) and hands
    each batch to the event loop with `call_soon_threadsafe` (§1.2, §7.9); enqueues are
    serialized under a lock; a cancelled request calls `cancel_request` at once and its final
    CANCELLED response is consumed before its bookkeeping is dropped (§1.10).
  * Lifecycle: QUEUED at enqueue; SCHEDULED and PREFILLED from request stats when
    `--trt-request-stats-max-iterations` > 0, otherwise both at the first token response (the
    executor reports nothing earlier, so queue time then includes prefill time).
  * Multi-GPU engines run under `mpirun` in leader mode: rank 0 serves gRPC, the other ranks
    construct the executor and wait in `shutdown()` (`run_if_follower_rank`, §1.14).
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import importlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from core.engine.base import EngineLifecycle, OutputStream, prompt_logprobs
from core.engine.registry import ENGINE_MANIFEST
from core.engine.trtllm_defaults import resolve_trtllm_sampling
from core.errors import (
    ContextLengthExceeded,
    CoreError,
    EngineDead,
    EngineFailure,
    InvalidArgument,
    NotReady,
    Overloaded,
)
from core.types import (
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestState,
    ResolvedSampling,
    SamplingOptions,
    SequenceStep,
)

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'trellis[trtllm]'"
SEED_MASK = (1 << 64) - 1
"""The runtime's seed is an unsigned 64-bit integer; a client's signed seed is reduced to it."""
_STATE_RANK = {RequestState.QUEUED: 1, RequestState.SCHEDULED: 2, RequestState.PREFILLED: 3}


# ------------------------------------------------------------------------------------ imports


def import_bindings():
    """Import `tensorrt_llm.bindings.executor`.

    Raises:
        RuntimeError: TensorRT-LLM is missing (the message names the `trtllm` extra), or the
            installed release no longer has the executor (removed after v1.3.0rc20, §0).
    """
    try:
        tl = importlib.import_module("tensorrt_llm.bindings.executor")
    except ImportError as e:
        raise RuntimeError(
            f"--engine trtllm needs TensorRT-LLM, which is not installed ({e}). On a machine with an NVIDIA GPU run "
            f"{INSTALL_HINT} (releases 0.11 to 1.2.x or 1.3.0rc20 have the executor); see docs/tensorrt-llm.md."
        ) from e
    if not hasattr(tl, "Executor"):
        version = getattr(tl, "__version__", "unknown")
        raise RuntimeError(
            f"The installed TensorRT-LLM ({version}) no longer ships the C++ executor (removed after v1.3.0rc20); "
            "serve it with --engine trtllm-llm, or install a release up to 1.2.x for --engine trtllm."
        )
    return tl


# ------------------------------------------------------------------------------------ engine dir


@dataclass(frozen=True)
class EngineLayout:
    """Where an engine lives and the limits it was built with (§3.3, §3.4).

    Attributes:
        engine_dir: directory with config.json and rank{N}.engine.
        max_input_len: longest prompt the engine accepts.
        max_seq_len: prompt + generated tokens.
        max_batch_size, max_beam_width, max_num_tokens: build limits (max_num_tokens None = unknown).
        vocab_size: the engine's vocabulary padded to a multiple of tp (embedding_bias width).
        tp, pp: tensor and pipeline parallel sizes (one MPI rank each).
        paged_context_fmha: needed for KV-cache block reuse and chunked context.
        gather_context_logits: context logits can be returned (prompt logprobs).
        version: TensorRT-LLM version that built the engine, when recorded.
    """

    engine_dir: Path
    max_input_len: int
    max_seq_len: int
    max_batch_size: int
    max_beam_width: int
    max_num_tokens: int | None
    vocab_size: int
    tp: int = 1
    pp: int = 1
    paged_context_fmha: bool = False
    gather_context_logits: bool = False
    version: str | None = None

    @property
    def world_size(self) -> int:
        """MPI ranks the engine needs."""
        return self.tp * self.pp


def read_engine_layout(model_dir: str | Path) -> EngineLayout:
    """Read an engine directory, or a build output holding `trellis-engine.json`.

    The manifest (written by scripts/build_trtllm_engine.py) names `engine_dir` relative to
    itself; the engine's own config.json (`pretrained_config`, `build_config`) is the source of
    limits, with the manifest's values as fallback.

    Raises:
        RuntimeError: no config.json, or the limits cannot be found.
    """
    root = Path(model_dir)
    manifest: dict = {}
    engine_dir = root
    manifest_file = root / ENGINE_MANIFEST
    if manifest_file.is_file():
        manifest = json.loads(manifest_file.read_text())
        given = Path(manifest.get("engine_dir") or ".")
        engine_dir = given if given.is_absolute() else (root / given)
    config_file = engine_dir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    limits = manifest.get("limits") or {}
    if "build_config" not in config and not limits:
        raise RuntimeError(
            f"{engine_dir} is not a TensorRT-LLM engine directory (no config.json with a build_config); build one "
            "with scripts/build_trtllm_engine.py, or serve a Hugging Face checkpoint with --engine hf."
        )
    build = config.get("build_config") or {}
    pretrained = config.get("pretrained_config") or {}
    mapping = pretrained.get("mapping") or {}

    def pick(name: str, default=None):
        value = build.get(name, limits.get(name, default))
        if value is None and default is None:
            raise RuntimeError(f"{config_file}: build_config has no {name} (and {ENGINE_MANIFEST} does not say)")
        return value

    tp = int(mapping.get("tp_size", manifest.get("tp", 1)))
    pp = int(mapping.get("pp_size", manifest.get("pp", 1)))
    vocab = int(pretrained.get("vocab_size") or limits.get("vocab_size") or 0)
    if vocab <= 0:
        raise RuntimeError(f"{config_file}: pretrained_config has no vocab_size")
    plugins = build.get("plugin_config") or {}
    max_num_tokens = build.get("max_num_tokens", limits.get("max_num_tokens"))
    return EngineLayout(
        engine_dir=engine_dir,
        max_input_len=int(pick("max_input_len")),
        max_seq_len=int(pick("max_seq_len")),
        max_batch_size=int(pick("max_batch_size")),
        max_beam_width=int(pick("max_beam_width", 1)),
        max_num_tokens=int(max_num_tokens) if max_num_tokens else None,
        vocab_size=-(-vocab // tp) * tp,
        tp=tp,
        pp=pp,
        paged_context_fmha=bool(plugins.get("use_paged_context_fmha", manifest.get("use_paged_context_fmha", False))),
        gather_context_logits=bool(build.get("gather_context_logits", manifest.get("gather_context_logits", False))),
        version=config.get("version") or manifest.get("tensorrt_llm_version"),
    )


# ------------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class TrtllmOptions:
    """Executor options from CoreConfig (flags `--max-batch-size`, `--max-queue-size`, `--trt-*`).

    Attributes:
        max_batch_size: runtime cap of sequences in the batch (the engine's build value bounds it).
        max_queue_size: requests waiting in the executor before RESOURCE_EXHAUSTED (0: unlimited).
        max_num_tokens: batched tokens per step (None: the engine's value).
        kv_cache_free_gpu_memory_fraction: share of free GPU memory for the KV cache.
        enable_block_reuse: KV-cache block reuse across requests (needs paged context FMHA).
        scheduler_policy: capacity scheduler policy name (lower case).
        enable_chunked_context: chunked prefill (needs paged context FMHA).
        iter_stats_max_iterations: iteration stats kept by the executor.
        request_stats_max_iterations: request stats kept; > 0 gives exact SCHEDULED/PREFILLED.
        await_timeout_ms: timeout of each await_responses call of the awaiter thread.
        max_n: largest n / best_of per request.
    """

    max_batch_size: int = 32
    max_queue_size: int = 256
    max_num_tokens: int | None = None
    kv_cache_free_gpu_memory_fraction: float = 0.9
    enable_block_reuse: bool = True
    scheduler_policy: str = "guaranteed_no_evict"
    enable_chunked_context: bool = False
    iter_stats_max_iterations: int = 1000
    request_stats_max_iterations: int = 0
    await_timeout_ms: int = 5
    max_n: int = 16

    @classmethod
    def from_config(cls, config) -> TrtllmOptions:
        """Options of a CoreConfig."""
        return cls(
            max_batch_size=config.max_batch_size,
            max_queue_size=config.max_queue_size,
            max_num_tokens=config.trt_max_num_tokens or None,
            kv_cache_free_gpu_memory_fraction=config.trt_kv_cache_free_gpu_memory_fraction,
            enable_block_reuse=config.trt_enable_block_reuse,
            scheduler_policy=config.trt_scheduler_policy,
            enable_chunked_context=config.trt_enable_chunked_context,
            iter_stats_max_iterations=config.trt_iter_stats_max_iterations,
            request_stats_max_iterations=config.trt_request_stats_max_iterations,
            await_timeout_ms=max(1, config.trt_await_timeout_ms),
            max_n=config.max_n,
        )


@dataclass(frozen=True)
class BindingApi:
    """Names and features of the installed bindings, detected once (§1.6, §1.8, §7.1).

    Attributes:
        max_tokens: Request keyword for the number of tokens to generate.
        seed, min_tokens: SamplingConfig keywords.
        num_return_sequences: SamplingConfig takes num_return_sequences (n > 1 possible).
        min_p: SamplingConfig takes min_p.
        finish_reasons: Result carries finish_reasons (E1+); otherwise they are inferred.
        executor_config_fields: optional ExecutorConfig fields that exist.
    """

    max_tokens: str = "max_tokens"
    seed: str = "seed"
    min_tokens: str = "min_tokens"
    num_return_sequences: bool = True
    min_p: bool = True
    finish_reasons: bool = True
    executor_config_fields: frozenset[str] = frozenset({"max_batch_size", "max_num_tokens", "max_queue_size"})


def detect_api(tl) -> BindingApi:
    """Probe the bindings: try the recent name, fall back on TypeError (§1.6 "Adapter rule")."""

    def accepts(ctor: Callable, **kwargs) -> bool:
        try:
            ctor(**kwargs)
        except TypeError:
            return False
        return True

    sc = tl.SamplingConfig
    probe = tl.ExecutorConfig(max_beam_width=1)
    return BindingApi(
        max_tokens="max_tokens" if accepts(tl.Request, input_token_ids=[0], max_tokens=1) else "max_new_tokens",
        seed="seed" if accepts(sc, beam_width=1, seed=1) else "random_seed",
        min_tokens="min_tokens" if accepts(sc, beam_width=1, min_tokens=1) else "min_length",
        num_return_sequences=accepts(sc, beam_width=1, num_return_sequences=1),
        min_p=accepts(sc, beam_width=1, min_p=0.0),
        finish_reasons=hasattr(tl, "FinishReason"),
        executor_config_fields=frozenset(
            n for n in ("max_batch_size", "max_num_tokens", "max_queue_size") if hasattr(probe, n)
        ),
    )


def make_executor_config(tl, api: BindingApi, opts: TrtllmOptions, layout: EngineLayout):
    """ExecutorConfig from options (§1.3-§1.5, §1.15).

    Block reuse is turned off with a warning when the engine lacks paged context FMHA.

    Raises:
        RuntimeError: chunked context asked of an engine without paged context FMHA, or a
            scheduler policy this release does not have.
    """
    policies = getattr(tl, "CapacitySchedulerPolicy", None) or tl.SchedulerPolicy
    try:
        policy = getattr(policies, opts.scheduler_policy.upper())
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
    config = tl.ExecutorConfig(
        max_beam_width=1,
        scheduler_config=tl.SchedulerConfig(policy),
        kv_cache_config=tl.KvCacheConfig(
            enable_block_reuse=reuse, free_gpu_memory_fraction=opts.kv_cache_free_gpu_memory_fraction
        ),
        enable_chunked_context=opts.enable_chunked_context,
        iter_stats_max_iterations=opts.iter_stats_max_iterations,
        request_stats_max_iterations=opts.request_stats_max_iterations,
    )
    wanted = {
        "max_batch_size": min(opts.max_batch_size, layout.max_batch_size),
        "max_num_tokens": opts.max_num_tokens,
        "max_queue_size": opts.max_queue_size or None,
    }
    for name, value in wanted.items():
        if value is None:
            continue
        if name in api.executor_config_fields:
            setattr(config, name, value)
        elif name != "max_queue_size":  # the engine bounds its own queue instead
            log.warning("this TensorRT-LLM release has no ExecutorConfig.%s; using the engine's value", name)
    return config


# ------------------------------------------------------------------------------------ pure mapping


def sampling_kwargs(s: ResolvedSampling, api: BindingApi, *, n: int, min_new_tokens: int) -> dict[str, object]:
    """SamplingConfig keywords for resolved sampling (§1.6, §7.2-§7.4).

    Greedy sends no top_k, top_p or temperature (an all-default config is greedy); sampling
    sends them, never top_p <= 0 nor temperature 0. The seed is always sent, reduced to the
    runtime's unsigned 64 bits. min_tokens only when > 0 (the runtime's default is 1).
    """
    kw: dict[str, object] = {"beam_width": 1}
    if s.do_sample:
        if s.top_k is not None:
            kw["top_k"] = s.top_k
        if s.top_p is not None and s.top_p > 0:
            kw["top_p"] = s.top_p
        if s.temperature is not None and s.temperature > 0:
            kw["temperature"] = s.temperature
        if s.min_p is not None and api.min_p:
            kw["min_p"] = s.min_p
    kw[api.seed] = s.seed & SEED_MASK
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if value is not None:
            kw[name] = value
    if min_new_tokens > 0:
        kw[api.min_tokens] = min_new_tokens
    if n > 1:
        kw["num_return_sequences"] = n
    return kw


def stop_words_for(req: EngineRequest, extra_eos: Iterable[int]) -> list[list[int]]:
    """The `stop_words` of a request: stop strings' tokens, stop token ids and the model's EOS
    ids other than end_id as one-token words (§1.8, §7.5), without duplicates.

    Empty when min_new_tokens > 0: the executor's stop words ignore min_tokens, so the engine
    then matches single stop tokens itself and the pipeline matches stop strings.
    """
    if req.min_new_tokens > 0:
        return []
    words: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    singles = sorted(req.stop_token_ids) + ([] if req.ignore_eos else sorted(extra_eos))
    for word in [*req.stop_words_ids, *([t] for t in singles)]:
        key = tuple(word)
        if word and key not in seen:
            seen.add(key)
            words.append(list(word))
    return words


def first_stop_token(req: EngineRequest, tokens: list[int], lps: list[float] | None, *, before: int, extra_eos):
    """End a sequence at a stop token the runtime was not given.

    With min_new_tokens > 0 no stop tokens go to the runtime (its stop words ignore min_tokens,
    §7.5), so the engine looks for them itself: the first stop token id, or EOS id other than
    end_id, past min_new_tokens ends the sequence and is kept in the output, as the runtime
    keeps stop words. `before` is how many tokens of the sequence came earlier.

    Returns:
        (tokens kept, their logprobs, STOP_SEQUENCE / EOS / None, the stop token id or None).
    """
    eos = frozenset() if req.ignore_eos else extra_eos
    for i, token in enumerate(tokens):
        if before + i + 1 > req.min_new_tokens and (token in req.stop_token_ids or token in eos):
            kept, kept_lps = tokens[: i + 1], (lps[: i + 1] if lps else lps)
            if token in req.stop_token_ids:
                return kept, kept_lps, FinishReason.STOP_SEQUENCE, token
            return kept, kept_lps, FinishReason.EOS, None
    return tokens, lps, None, None


@dataclass(frozen=True)
class SpecialIds:
    """The token ids TensorRT-LLM needs besides the prompt.

    Attributes:
        end_id: the EOS id the runtime stops on (the tokenizer's EOS, else the smallest EOS id).
        pad_id: the tokenizer's pad id, else end_id.
        extra_eos: the model's other EOS ids (sent as one-token stop words).
    """

    end_id: int
    pad_id: int
    extra_eos: frozenset[int]


def special_ids(tokenizer) -> SpecialIds:
    """SpecialIds of a core.tokenizer.Tokenizer.

    Raises:
        RuntimeError: the tokenizer has no EOS token.
    """
    eos = tokenizer.hf.eos_token_id
    if eos is None:
        eos = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
    if eos is None:
        raise RuntimeError("The tokenizer has no EOS token; TensorRT-LLM needs an end_id")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return SpecialIds(int(eos), int(pad), frozenset(tokenizer.eos_token_ids) - {int(eos)})


def embedding_bias(bias: Mapping[int, float], width: int):
    """A request's logit_bias as the dense float32 tensor of `width` (the model's padded
    vocabulary) that TensorRT-LLM adds to the logits (`embedding_bias`)."""
    import torch

    tensor = torch.zeros(width, dtype=torch.float32)
    for token, value in bias.items():
        tensor[token] = value
    return tensor


def new_logprobs(values: Sequence[float] | None, received: int, count: int) -> list[float] | None:
    """Per-token logprobs of the `count` new tokens of a streaming response.

    Recent releases return every generated token's logprob so far in each response (§1.9,
    §7.8); others only the new ones. `received` is how many tokens of the sequence came before.
    None when the response carries no usable logprobs.
    """
    if values is None:
        return None
    values = list(values)
    if len(values) == count:
        return values
    if len(values) >= received + count:
        return values[received : received + count]
    return None


def classify_error(message: str) -> CoreError:
    """The core error for an executor error response (§1.12, §1.5)."""
    if "exceeds maximum input length" in message:
        return ContextLengthExceeded(f"The prompt is longer than this engine accepts: {message}")
    if "potentially greater than max input length" in message:
        return InvalidArgument(
            "With the max_utilization scheduler and no chunked context, prompt + max_new_tokens must fit the "
            f"engine's max input length; lower max_new_tokens. ({message})",
            field="stopping.max_new_tokens",
        )
    return EngineFailure(f"TensorRT-LLM failed the request: {message}")


def classify_enqueue_error(error: Exception, *, stopping: bool) -> CoreError:
    """The core error for an exception from enqueue_request (§1.2, §7.12)."""
    message = str(error)
    if "Maximum queue size" in message:
        return Overloaded("The server is at capacity (the TensorRT-LLM queue is full); retry later.")
    if "Shutdown" in message:
        return NotReady("The engine is shutting down.") if stopping else EngineDead("The executor has shut down.")
    return EngineFailure(f"TensorRT-LLM refused the request: {message}")


# ------------------------------------------------------------------------------------ live state


@dataclass(eq=False, slots=True)
class _Seq:
    generated: list[int] = field(default_factory=list)
    received: int = 0  # tokens the executor sent (logprob slicing)
    done: bool = False


@dataclass(eq=False, slots=True)
class _Live:
    request: EngineRequest
    rid: int
    seqs: list[_Seq]
    stop_words: list[list[int]]
    enqueued: float
    outputs: OutputStream | None = None  # set right after enqueue
    state: int = 1
    cancel_sent: bool = False
    executor_done: bool = False
    prompt_info_sent: bool = False


# ------------------------------------------------------------------------------------ factory


def build(config, tokenizer) -> TrtllmEngine:
    """Engine factory for `--engine trtllm` (see core.engine.registry).

    Raises:
        RuntimeError: TensorRT-LLM missing, or `config.model` is not an engine directory.
    """
    tl = import_bindings()
    layout = read_engine_layout(config.model)
    return TrtllmEngine(tl, layout, tokenizer, TrtllmOptions.from_config(config))


def _mpi_rank_and_size() -> tuple[int, int]:
    try:
        from mpi4py import MPI
    except ImportError:
        return 0, 1
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def run_if_follower_rank(config) -> bool:
    """On MPI ranks other than 0 of a multi-GPU engine, run this rank's share of the executor
    until the leader shuts down, and return True; return False on rank 0 or without MPI.

    Leader mode (§1.14): every rank constructs the Executor; only rank 0 can enqueue, the
    others wait in `shutdown()` (what Triton does). Start all ranks with
    `mpirun -n <tp*pp> trellis-core --engine trtllm --model <dir>`.
    """
    rank, size = _mpi_rank_and_size()
    if size <= 1 or rank == 0:
        return False
    tl = import_bindings()
    layout = read_engine_layout(config.model)
    opts = TrtllmOptions.from_config(config)
    executor = tl.Executor(
        layout.engine_dir, tl.ModelType.DECODER_ONLY, make_executor_config(tl, detect_api(tl), opts, layout)
    )
    log.info("rank %d of %d: TensorRT-LLM worker rank; rank 0 serves gRPC", rank, size)
    executor.shutdown()  # blocks until the leader shuts down
    return True


# ------------------------------------------------------------------------------------ engine


class TrtllmEngine(EngineLifecycle):
    """In-flight batching over TensorRT-LLM's executor (see the module docstring).

    Args:
        bindings: the `tensorrt_llm.bindings.executor` module.
        layout: the engine directory and its build limits.
        tokenizer: the served model's core.tokenizer.Tokenizer (EOS, pad and vocabulary size).
        options: executor options.
    """

    kind = "trtllm"

    def __init__(self, bindings, layout: EngineLayout, tokenizer, options: TrtllmOptions):
        super().__init__()
        self._tl = bindings
        self.api = detect_api(bindings)
        self.layout = layout
        self.options = options
        self._ids = special_ids(tokenizer)
        unsupported = {"typical_p"} | (set() if self.api.min_p else {"min_p"})
        max_batch = min(options.max_batch_size, layout.max_batch_size)
        self.info = EngineInfo(
            engine=self.kind,
            max_context_length=layout.max_seq_len,
            vocab_size=int(tokenizer.vocab_size),
            max_num_beams=1,
            max_n=min(options.max_n, max_batch) if self.api.num_return_sequences else 1,
            unsupported_sampling_fields=frozenset(unsupported),
            max_input_length=layout.max_input_len,
            max_top_logprobs=0,  # the executor returns only the chosen token's logprob
            supports_prompt_logprobs=layout.gather_context_logits,  # context logits need that build flag
        )
        # The executor bounds its queue where ExecutorConfig can (E1+); older ones need us to.
        self._local_queue_limit = (
            None
            if "max_queue_size" in self.api.executor_config_fields or not options.max_queue_size
            else options.max_queue_size
        )
        self._executor = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._enqueue_lock = threading.Lock()
        self._live: dict[int, _Live] = {}
        self._by_name: dict[str, _Live] = {}

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Create the executor (loads the engine) and start the awaiter thread.

        Raises:
            RuntimeError: bad options for this engine, a multi-GPU engine started without the
                matching `mpirun`, or the executor cannot load the engine.
        """
        self._loop = asyncio.get_running_loop()
        rank, size = _mpi_rank_and_size()
        if size != self.layout.world_size:
            raise RuntimeError(
                f"The engine in {self.layout.engine_dir} was built for {self.layout.world_size} GPUs (tp "
                f"{self.layout.tp} x pp {self.layout.pp}); start it with "
                f"`mpirun -n {self.layout.world_size} trellis-core --engine trtllm --model ...` (running {size})."
            )
        config = make_executor_config(self._tl, self.api, self.options, self.layout)
        tl = self._tl
        self._executor = await asyncio.to_thread(tl.Executor, self.layout.engine_dir, tl.ModelType.DECODER_ONLY, config)
        if not self._executor.can_enqueue_requests():
            raise RuntimeError(f"rank {rank} cannot enqueue requests; only MPI rank 0 serves gRPC")
        self._started = self._alive = True
        self._thread = threading.Thread(target=self._await_loop, name="trtllm-awaiter", daemon=True)
        self._thread.start()
        log.info(
            "trtllm engine: %s (TensorRT-LLM %s, max_input_len %d, max_seq_len %d, names %s)",
            self.layout.engine_dir,
            getattr(tl, "__version__", self.layout.version or "?"),
            self.layout.max_input_len,
            self.layout.max_seq_len,
            self.api,
        )

    async def shutdown(self) -> None:
        """Stop the awaiter and the executor; unfinished requests end with NotReady."""
        self._stopping = True
        if self._executor is not None:
            try:
                await asyncio.to_thread(self._executor.shutdown)
            except Exception as e:  # a dead executor may refuse; nothing left to free then
                log.warning("executor shutdown: %s", e)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._alive = False
        self._fail_all(NotReady("The engine shut down."))

    def resolve_sampling(self, opts: SamplingOptions, *, random_seed: int) -> ResolvedSampling:
        """TensorRT-LLM's defaults (core.engine.trtllm_defaults)."""
        return resolve_trtllm_sampling(opts, random_seed=random_seed)

    def stats(self) -> EngineStats:
        """Requests in the executor: queued (not yet seen scheduled) and active."""
        queued = sum(1 for live in self._live.values() if live.state < _STATE_RANK[RequestState.SCHEDULED])
        return EngineStats(active=len(self._live) - queued, queued=queued)

    def iteration_stats(self) -> list[str]:
        """Drain the executor's latest iteration stats as JSON strings (§1.13)."""
        if self._executor is None or not self._alive:
            return []
        return [s.to_json_str() for s in self._executor.get_latest_iteration_stats()]

    # ---------------------------------------------------------------- requests

    def generate(self, request: EngineRequest) -> OutputStream:
        """Enqueue a request and stream its outputs; see core.engine.base.Engine for the contract.

        Raises:
            NotReady / EngineDead: the engine is not serving.
            InvalidArgument: the request id is already running.
            Overloaded: the executor's queue (or ours, on releases without one) is full.
            EngineFailure: the executor refused the request.
        """
        return self._submit(request).outputs

    def _closed(self, live: _Live, finished: bool) -> None:
        """The consumer is done: cancel an unfinished request (its bookkeeping stays until the
        executor's final response, §1.10) and free its id at once."""
        if not finished:
            self._cancel(live)
        if self._by_name.get(live.request.request_id) is live:
            del self._by_name[live.request.request_id]

    def abort(self, request_id: str) -> None:
        """Cancel at once (no polling period); the executor ends it within one step (§1.10)."""
        live = self._by_name.get(request_id)
        if live is not None:
            self._cancel(live)

    def _cancel(self, live: _Live) -> None:
        if live.cancel_sent or live.executor_done or self._executor is None:
            return
        live.cancel_sent = True
        try:
            self._executor.cancel_request(live.rid)
        except Exception as e:  # after shutdown the executor raises; nothing to cancel then
            log.warning("cancel_request(%d): %s", live.rid, e)

    def _submit(self, req: EngineRequest) -> _Live:
        """Check, build and enqueue a request (raises CoreError before anything is yielded)."""
        self._check_serving()
        if req.request_id in self._by_name:
            raise InvalidArgument(f"A request with id '{req.request_id}' is already running.", field="request_id")
        tl = self._tl
        stop_words = stop_words_for(req, self._ids.extra_eos)
        sampling = tl.SamplingConfig(
            **sampling_kwargs(req.sampling, self.api, n=req.num_sequences, min_new_tokens=req.min_new_tokens)
        )
        output = tl.OutputConfig(
            return_log_probs=req.logprobs,
            return_context_logits=req.prompt_logprobs is not None,
            exclude_input_from_output=True,
        )
        kwargs: dict[str, object] = {
            "input_token_ids": list(req.prompt_ids),
            self.api.max_tokens: req.max_new_tokens,
            "streaming": True,
            "sampling_config": sampling,
            "output_config": output,
            "end_id": -1 if req.ignore_eos else self._ids.end_id,  # -1: no end token (what the LLM API sends)
            "pad_id": self._ids.pad_id,
        }
        if stop_words:
            kwargs["stop_words"] = stop_words
        if req.bad_words_ids:
            kwargs["bad_words"] = [list(w) for w in req.bad_words_ids]
        if req.logit_bias:
            kwargs["embedding_bias"] = embedding_bias(req.logit_bias, self.layout.vocab_size)
        executor_request = tl.Request(**kwargs)
        with self._enqueue_lock:
            if self._local_queue_limit is not None and self.stats().queued >= self._local_queue_limit:
                raise Overloaded(
                    f"The server is at capacity ({self._local_queue_limit} requests waiting); retry later."
                )
            try:
                rid = self._executor.enqueue_request(executor_request)
            except Exception as e:
                raise classify_enqueue_error(e, stopping=self._stopping) from e
            live = _Live(
                request=req,
                rid=rid,
                seqs=[_Seq() for _ in range(req.num_sequences)],
                stop_words=stop_words,
                enqueued=time.monotonic(),
            )
            queued = EngineOutput(req.request_id, state=RequestState.QUEUED, time=live.enqueued)
            live.outputs = OutputStream(queued, functools.partial(self._closed, live))
            self._live[rid] = live
            self._by_name[req.request_id] = live
        return live

    # ---------------------------------------------------------------- awaiter thread

    def _await_loop(self) -> None:
        executor = self._executor
        timeout = datetime.timedelta(milliseconds=self.options.await_timeout_ms)
        want_stats = self.options.request_stats_max_iterations > 0
        while not self._stopping:
            try:
                responses = executor.await_responses(timeout=timeout)
                stats = list(executor.get_latest_request_stats()) if want_stats else []
            except Exception as e:
                if not self._stopping:
                    log.error("TensorRT-LLM executor failed: %s", e)
                    self._post(self._die, e)
                return
            if responses or stats:
                self._post(self._dispatch, list(responses), stats)

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the process is exiting
            pass

    # ---------------------------------------------------------------- event-loop side

    def _die(self, error: Exception) -> None:
        if self._stopping or not self._mark_dead(error):
            return
        self._fail_all(EngineDead(f"The TensorRT-LLM executor stopped: {error}"))

    def _fail_all(self, error: CoreError) -> None:
        now = time.monotonic()
        for live in list(self._live.values()):
            live.outputs.put(EngineOutput(live.request.request_id, error=error, finished=True, time=now))
        self._live.clear()
        self._by_name.clear()

    def _forget(self, live: _Live) -> None:
        live.executor_done = True
        self._live.pop(live.rid, None)
        if self._by_name.get(live.request.request_id) is live:
            del self._by_name[live.request.request_id]

    def _dispatch(self, responses: list, stats: list) -> None:
        now = time.monotonic()
        stage = getattr(self._tl, "RequestStage", None)
        for per_iteration in stats:
            for rs in getattr(per_iteration, "request_stats", ()):
                live = self._live.get(rs.id)
                if live is None or stage is None:
                    continue
                if rs.stage == stage.CONTEXT_IN_PROGRESS:
                    self._advance(live, RequestState.SCHEDULED, now)
                elif rs.stage in (stage.GENERATION_IN_PROGRESS, stage.GENERATION_COMPLETE):
                    if live.request.prompt_logprobs is None or live.prompt_info_sent:
                        # prompt logprobs travel with PREFILLED, so that one waits for the first response
                        self._advance(live, RequestState.PREFILLED, now)
        grouped: dict[int, list] = {}
        for r in responses:  # several responses of one id in one batch stay in order (§1.11)
            grouped.setdefault(r.request_id, []).append(r)
        for rid, batch in grouped.items():
            live = self._live.get(rid)
            if live is not None:
                self._handle(live, batch, now)

    def _advance(self, live: _Live, state: RequestState, now: float) -> None:
        rank = _STATE_RANK[state]
        if rank > live.state:
            live.state = rank
            live.outputs.put(EngineOutput(live.request.request_id, state=state, time=now))

    def _handle(self, live: _Live, batch: list, now: float) -> None:
        """Turn one batch of a request's responses into EngineOutputs."""
        req = live.request
        steps: dict[int, SequenceStep] = {}
        trailing: list[SequenceStep] = []  # END_ID finishes, sent after their tokens
        prompt_info = None
        executor_final = False
        for response in batch:
            if response.has_error():
                self._forget(live)
                live.outputs.put(
                    EngineOutput(req.request_id, error=classify_error(response.error_msg), finished=True, time=now)
                )
                return
            res = response.result
            executor_final = executor_final or bool(res.is_final)
            if req.prompt_logprobs is not None and not live.prompt_info_sent:
                logits = getattr(res, "context_logits", None)
                if logits is not None:
                    prompt_info = prompt_logprobs(logits, req.prompt_ids, req.prompt_logprobs, self.info.vocab_size)
                    live.prompt_info_sent = True
            index = int(getattr(res, "sequence_index", 0) or 0)
            if index >= len(live.seqs):
                continue
            seq = live.seqs[index]
            tokens = [int(t) for t in res.output_token_ids[0]] if res.output_token_ids else []
            values = res.log_probs[0] if req.logprobs and res.log_probs else None
            lps = new_logprobs(values, seq.received, len(tokens)) if req.logprobs else None
            if req.logprobs and lps is None and tokens:
                log.warning("request %s: logprobs missing from a response; reporting 0", req.request_id)
                lps = [0.0] * len(tokens)
            seq.received += len(tokens)
            if seq.done:
                continue
            seq_final = bool(getattr(res, "is_sequence_final", res.is_final))
            step = steps.setdefault(index, SequenceStep(index, [], [] if req.logprobs else None))
            reason, stop_token, excluded_end = None, None, False
            if req.min_new_tokens > 0:
                tokens, lps, reason, stop_token = first_stop_token(
                    req, tokens, lps, before=len(seq.generated), extra_eos=self._ids.extra_eos
                )
            if reason is None and seq_final:
                reasons = getattr(res, "finish_reasons", None)
                name = getattr(reasons[0], "name", None) if reasons else None
                seq.generated += tokens
                reason, stop_token, excluded_end = self._finish(live, seq, name)
            else:
                seq.generated += tokens
            step.token_ids += tokens
            if step.logprobs is not None and lps is not None:
                step.logprobs += lps
            if reason is not None:
                seq.done = True
                if excluded_end and step.token_ids:
                    trailing.append(SequenceStep(index, [], [] if req.logprobs else None, finish_reason=reason))
                else:
                    step.finish_reason, step.stop_token_id = reason, stop_token
        outputs = [EngineOutput(req.request_id, sequences=list(steps.values()), time=now)]
        if trailing:
            outputs.append(EngineOutput(req.request_id, sequences=trailing, time=now))
        first = outputs[0]
        if prompt_info is not None or any(s.token_ids for s in first.sequences):
            if live.state < _STATE_RANK[RequestState.PREFILLED]:
                live.state = _STATE_RANK[RequestState.PREFILLED]
                first.state = RequestState.PREFILLED
            first.prompt_logprobs = prompt_info
        all_done = all(s.done for s in live.seqs)
        if executor_final:
            self._forget(live)
        if all_done or executor_final:
            outputs[-1].finished = True
            if not executor_final:  # the engine stopped it on a local stop token
                self._cancel(live)
        for out in outputs:
            if out.sequences or out.state is not None or out.finished:
                live.outputs.put(out)

    def _finish(self, live: _Live, seq: _Seq, name: str | None) -> tuple[FinishReason, int | None, bool]:
        """Map the executor's finish reason (§1.1) to (reason, stop token id, end token excluded).

        A final response without a reason (E0 results, NOT_FINISHED after a cancel in E1) is
        inferred: our cancel, else a stop word at the tail, else the length limit, else the end
        token (excluded from the output, §7.5).
        """
        if name == "END_ID":
            return FinishReason.EOS, None, True
        if name == "LENGTH":
            return FinishReason.LENGTH, None, False
        if name == "CANCELLED":
            return FinishReason.CANCELLED, None, False
        if name == "TIMED_OUT":
            return FinishReason.TIME_LIMIT, None, False
        matched = _matched_stop_word(seq.generated, live.stop_words)
        if name == "STOP_WORDS" or (matched is not None and not live.cancel_sent):
            req = live.request
            if matched is not None and len(matched) == 1:
                token = matched[0]
                if token in req.stop_token_ids:
                    return FinishReason.STOP_SEQUENCE, token, False
                if token in self._ids.extra_eos:
                    return FinishReason.EOS, None, False
            return FinishReason.STOP_SEQUENCE, None, False
        if live.cancel_sent:
            return FinishReason.CANCELLED, None, False
        if len(seq.generated) >= live.request.max_new_tokens:
            return FinishReason.LENGTH, None, False
        return FinishReason.EOS, None, True


def _matched_stop_word(generated: Sequence[int], words: Sequence[Sequence[int]]) -> list[int] | None:
    """The stop word the generated tokens end with (the longest one), or None."""
    best = None
    for word in words:
        n = len(word)
        if n and n <= len(generated) and list(generated[-n:]) == list(word) and (best is None or n > len(best)):
            best = list(word)
    return best
