"""TensorRT-LLM executor engine (`trellis-core --engine trtllm --model <engine dir>`).

Drives TensorRT-LLM's C++ in-flight batching executor (`tensorrt_llm.bindings.executor`) over
a prebuilt TensorRT engine directory. Token level only: the tokenizer, detokenization, stop
strings, logprob formatting and sessions are the core's shared request pipeline.

  * TensorRT-LLM is imported lazily (`import core` never needs it); without it the factory
    raises RuntimeError naming `pip install 'trellis[trtllm]'`.
  * Binding names changed across releases: everything is passed by keyword and the names are
    detected once at start (`bindings.detect_api`). Releases 0.11 to 1.2.x and 1.3.0rc<=20
    have the executor; later ones only the LLM API (`--engine trtllm-llm`).
  * One awaiter thread loops `await_responses(timeout)` (which releases the GIL) and hands
    each batch to the event loop with `call_soon_threadsafe`; enqueues are serialized under
    a lock; a cancelled request calls `cancel_request` at once and its final response is
    consumed before its bookkeeping is dropped.
  * Lifecycle: QUEUED at enqueue; SCHEDULED and PREFILLED from request stats when
    `--trt-request-stats-max-iterations` > 0, otherwise both at the first token response (the
    executor reports nothing earlier, so queue time then includes prefill time).
  * Multi-GPU engines run under `mpirun` in leader mode: rank 0 serves gRPC, the other ranks
    construct the executor and wait in `shutdown()` (`run_if_follower_rank`).
  * Guided decoding: where the release has it (0.16 and later), the executor gets a
    `GuidedDecodingConfig` for XGrammar built from the tokenizer at start, and a guided request
    its `GuidedDecodingParams` (mapping.EXECUTOR_GUIDE_TYPES), once XGrammar compiled it here
    (guides.XGrammarCheck: the runtime's failure would fail the whole batch); earlier releases
    list no guide kinds, so the core refuses guided requests before they reach the engine.
  * Logprobs are the model's: `ExecutorConfig(normalize_log_probs=False)` wherever the
    release has it (options.executor_config).
  * KV-cache block reuse (on unless --no-trt-enable-block-reuse or --no-prefix-cache): where
    the release reports per-request perf metrics (0.16 and later), every request asks for
    them and its reused prompt tokens (reuse.reused_tokens: reused blocks x the engine's
    tokens_per_block, at most the prompt length - 1) go out as `cached_tokens` and into the
    prefix cache counters; earlier releases report 0. Where the release keeps KV cache events,
    the awaiter thread drains them with each response batch and counts the blocks stored and
    removed (reuse.ReuseCounter).
  * LoRA (engines built with `--lora_plugin`, core.engine.trtllm.lora): each registered
    adapter (`<engine dir>/adapters/`, `--lora-modules`, LoadAdapter) gets a task id and its
    PEFT weights converted to the executor's layout at registration; a request naming it
    carries `LoraConfig(task_id, weights, config)` the first time that task goes to the
    executor and `LoraConfig(task_id)` after, and a request answered "LoRA task <id> not
    found in cache" (evicted from the PEFT cache) is enqueued again once with the weights.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.engine.base import EngineLifecycle, OutputStream, prompt_logprobs
from core.engine.trtllm.bindings import Bindings, detect_api, import_bindings, release_of
from core.engine.trtllm.defaults import resolve_trtllm_sampling
from core.engine.trtllm.engine_dir import EngineLayout, read_engine_layout
from core.engine.trtllm.guides import XGrammarCheck, import_xgrammar
from core.engine.trtllm.lora import TrtAdapter, is_cache_miss, read_adapter
from core.engine.trtllm.mapping import (
    EXECUTOR_GUIDE_TYPES,
    RuntimeFinish,
    binding_call,
    classify_enqueue_error,
    classify_error,
    embedding_bias,
    executor_priority,
    guide_text,
    guided_kinds,
    local_stop_tokens,
    new_logprobs,
    sampling_kwargs,
    special_ids,
    stop_words_for,
    xgrammar_tokenizer_info,
)
from core.engine.trtllm.options import TrtllmOptions, executor_config, guided_decoding_config
from core.engine.trtllm.reuse import ReuseCounter, perf_reused_blocks, reused_tokens
from core.engine.trtllm.sequence import SequenceTracker
from core.errors import CoreError, EngineDead, InvalidArgument, NotReady, Overloaded
from core.lora import AdapterSpec, AdapterStatus, adapter_exists, unknown_adapter
from core.types import (
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    PromptTokenInfo,
    RequestState,
    ResolvedSampling,
    SamplingOptions,
    SequenceStep,
)

if TYPE_CHECKING:
    from core.config import CoreConfig
    from core.engine.base import Engine
    from core.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_STATE_RANK = {RequestState.QUEUED: 1, RequestState.SCHEDULED: 2, RequestState.PREFILLED: 3}
_FINISH: dict[str, RuntimeFinish] = {
    "END_ID": "END_ID",
    "STOP_WORDS": "STOP_WORDS",
    "LENGTH": "LENGTH",
    "TIMED_OUT": "TIMED_OUT",
    "CANCELLED": "CANCELLED",
}


# ------------------------------------------------------------------------------------ live state


@dataclass(eq=False)
class _Live:
    request: EngineRequest
    rid: int
    seqs: list[SequenceTracker]
    enqueued: float
    outputs: OutputStream | None = None  # set right after enqueue
    state: int = 1
    cancel_sent: bool = False
    executor_done: bool = False
    prompt_info_sent: bool = False
    cached: int | None = None  # reused prompt tokens, once the runtime reported them
    adapter: TrtAdapter | None = None
    kwargs: dict[str, Any] | None = None  # the Request's keywords, kept to resend with LoRA weights
    lora_resent: bool = False


# ------------------------------------------------------------------------------------ factory


def build(config: CoreConfig, tokenizer: Tokenizer) -> Engine:
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
    return int(MPI.COMM_WORLD.Get_rank()), int(MPI.COMM_WORLD.Get_size())


def run_if_follower_rank(config: CoreConfig) -> bool:
    """On MPI ranks other than 0 of a multi-GPU engine, run this rank's share of the executor
    until the leader shuts down, and return True; return False on rank 0 or without MPI.

    Leader mode: every rank constructs the Executor; only rank 0 can enqueue, the others wait
    in `shutdown()` (what Triton does). Start all ranks with
    `mpirun -n <tp*pp> trellis-core --engine trtllm --model <dir>`.
    """
    rank, size = _mpi_rank_and_size()
    if size <= 1 or rank == 0:
        return False
    from core.engine.registry import tokenizer_path
    from core.tokenizer import Tokenizer

    tl = import_bindings()
    api = detect_api(tl)
    layout = read_engine_layout(config.model)
    opts = TrtllmOptions.from_config(config)
    tokenizer = Tokenizer.load(tokenizer_path(config))
    info = xgrammar_tokenizer_info(tokenizer, special_ids(tokenizer).end_id)
    guided = guided_decoding_config(tl, api, opts, info)  # every rank builds the same config
    executor = tl.Executor(layout.engine_dir, tl.ModelType.DECODER_ONLY, executor_config(tl, api, opts, layout, guided))
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

    def __init__(self, bindings: Bindings, layout: EngineLayout, tokenizer: Tokenizer, options: TrtllmOptions):
        super().__init__()
        self._tl = bindings
        self.api = detect_api(bindings)
        self.layout = layout
        self.options = options
        self._ids = special_ids(tokenizer)
        self._tokenizer = tokenizer
        guides = options.guided_decoding_backend == "xgrammar" and self.api.guide_types
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
            guided_decoding=guided_kinds(self.api.guide_types) if guides else frozenset(),
        )
        # The executor bounds its queue where ExecutorConfig can (0.12+); 0.11 needs us to.
        self._local_queue_limit = (
            None
            if "max_queue_size" in self.api.executor_config_fields or not options.max_queue_size
            else options.max_queue_size
        )
        self._executor: Any = None
        self._guides: XGrammarCheck | None = None  # set at start, where the import's seconds are spent
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._enqueue_lock = threading.Lock()
        self._live: dict[int, _Live] = {}
        self._by_name: dict[str, _Live] = {}
        # Reuse is reported where the release has per-request perf metrics and the engine
        # records its block size; otherwise cached_tokens stays 0 (never an estimate).
        self._reuse_reported = (
            options.enable_block_reuse
            and layout.paged_context_fmha
            and self.api.perf_metrics
            and layout.tokens_per_block is not None
        )
        self._reuse = ReuseCounter() if options.enable_block_reuse and layout.paged_context_fmha else None
        self._events: Any = None  # the executor's KVCacheEventManager, where the release keeps events
        # LoRA: adapters by name; task ids are never reused, so a name registered again with
        # other weights cannot hit the cache entry of the old ones.
        self.max_loras = options.max_loras if layout.lora_modules else 0
        self._adapters: dict[str, TrtAdapter] = {}
        self._task_ids = itertools.count(1)
        self._sent_tasks: set[int] = set()

    # ---------------------------------------------------------------- adapters

    def has_adapter(self, name: str) -> bool:
        """Whether the adapter `name` is registered."""
        return name in self._adapters

    def adapters(self) -> list[AdapterStatus]:
        """Every registered adapter with its requests in the executor; resident: its weights
        went to the executor (which may have evicted them since; they are sent again then)."""
        queued_rank = _STATE_RANK[RequestState.SCHEDULED]
        out = []
        for name in sorted(self._adapters):
            adapter = self._adapters[name]
            mine = [live for live in self._live.values() if live.adapter is adapter]
            waiting = sum(1 for live in mine if live.state < queued_rank)
            resident = adapter.task_id in self._sent_tasks
            out.append(AdapterStatus(adapter.spec, resident, len(mine) - waiting, waiting))
        return out

    async def load_adapter(self, spec: AdapterSpec) -> None:
        """Register an adapter: read its weights and convert them to the executor's layout
        (core.engine.trtllm.lora.convert); nothing reaches the executor before a request.

        Raises:
            AdapterExists: the name is registered already.
            InvalidArgument: the weights do not fit the engine (modules it was not built to
                adapt, layers, rank above its max_lora_rank) or cannot be read.
        """
        if spec.name in self._adapters:
            raise adapter_exists(spec.name)
        adapter = await asyncio.to_thread(read_adapter, spec, next(self._task_ids), self.layout)
        if spec.name in self._adapters:  # registered meanwhile
            raise adapter_exists(spec.name)
        self._adapters[spec.name] = adapter

    async def unload_adapter(self, name: str) -> None:
        """Unregister an adapter; requests in the executor finish with it (the executor's
        cache drops its weights when it needs the room).

        Raises:
            AdapterNotFound: `name` is not registered.
        """
        if self._adapters.pop(name, None) is None:
            raise unknown_adapter(name)

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
        info = xgrammar_tokenizer_info(self._tokenizer, self._ids.end_id)
        guided = guided_decoding_config(self._tl, self.api, self.options, info)
        config = executor_config(self._tl, self.api, self.options, self.layout, guided)
        if guided is not None:
            self._guides = XGrammarCheck(await asyncio.to_thread(import_xgrammar))
        tl = self._tl
        self._executor = await asyncio.to_thread(tl.Executor, self.layout.engine_dir, tl.ModelType.DECODER_ONLY, config)
        if not self._executor.can_enqueue_requests():
            raise RuntimeError(f"rank {rank} cannot enqueue requests; only MPI rank 0 serves gRPC")
        if self._reuse is not None and self.api.kv_events:
            self._events = self._executor.get_kv_cache_event_manager()  # None: events not kept
        if self._reuse is not None and not self._reuse_reported:
            log.info(
                "trtllm engine: per-request KV-cache reuse is not reported (this release has no request perf "
                "metrics, or the engine's config.json has no tokens_per_block); cached_tokens is 0"
            )
        self._started = self._alive = True
        self._thread = threading.Thread(target=self._await_loop, name="trtllm-awaiter", daemon=True)
        self._thread.start()
        log.info(
            "trtllm engine: %s (TensorRT-LLM %s, max_input_len %d, max_seq_len %d, names %s)",
            self.layout.engine_dir,
            release_of(tl) if hasattr(tl, "__version__") else (self.layout.version or "?"),
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
        """TensorRT-LLM's defaults (core.engine.trtllm.defaults)."""
        return resolve_trtllm_sampling(opts, random_seed=random_seed)

    def stats(self) -> EngineStats:
        """Requests in the executor: queued (not yet seen scheduled) and active; with block
        reuse on, the prefix cache counters (reuse.ReuseCounter)."""
        queued = sum(1 for live in self._live.values() if live.state < _STATE_RANK[RequestState.SCHEDULED])
        prefix = self._reuse.stats() if self._reuse is not None else None
        return EngineStats(active=len(self._live) - queued, queued=queued, prefix_cache=prefix)

    def iteration_stats(self) -> list[str]:
        """Drain the executor's latest iteration stats as JSON strings."""
        if self._executor is None or not self._alive:
            return []
        return [str(s.to_json_str()) for s in self._executor.get_latest_iteration_stats()]

    # ---------------------------------------------------------------- requests

    def generate(self, request: EngineRequest) -> OutputStream:
        """Enqueue a request and stream its outputs; see core.engine.base.Engine for the contract.

        Raises:
            NotReady / EngineDead: the engine is not serving.
            InvalidArgument: the request id is already running.
            InvalidArgument: the bindings refuse a value (naming its field where one is at
                fault), a logit_bias id beyond the model's vocabulary, or a guide XGrammar
                cannot compile (guides.XGrammarCheck).
            Overloaded: the executor's queue (or ours, on releases without one) is full.
            EngineFailure: the executor refused the request.
        """
        outputs = self._submit(request).outputs
        assert outputs is not None
        return outputs

    def _closed(self, live: _Live, finished: bool) -> None:
        """The consumer is done: cancel an unfinished request (its bookkeeping stays until the
        executor's final response) and free its id at once."""
        if not finished:
            self._cancel(live)
        if self._by_name.get(live.request.request_id) is live:
            del self._by_name[live.request.request_id]

    def abort(self, request_id: str) -> None:
        """Cancel at once (no polling period); the executor ends it within one step."""
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
        adapter = None
        if req.adapter:
            adapter = self._adapters.get(req.adapter)
            if adapter is None:
                raise unknown_adapter(req.adapter)
        tl = self._tl
        ids = self._ids
        stop_words = stop_words_for(req, ids.extra_eos)
        sampling = binding_call(
            tl.SamplingConfig,
            "sampling parameters",
            "sampling",
            **sampling_kwargs(req.sampling, self.api, n=req.num_sequences, min_new_tokens=req.min_new_tokens),
        )
        output = binding_call(
            tl.OutputConfig,
            "output options",
            "output",
            return_log_probs=req.logprobs,
            return_context_logits=req.prompt_logprobs is not None,
            exclude_input_from_output=True,
            **({"return_perf_metrics": True} if self._reuse_reported else {}),
        )
        kwargs: dict[str, object] = {
            "input_token_ids": list(req.prompt_ids),
            self.api.max_tokens: req.max_new_tokens,
            "streaming": True,
            "sampling_config": sampling,
            "output_config": output,
            "end_id": -1 if req.ignore_eos else ids.end_id,  # -1: no end token (what the LLM API sends)
            "pad_id": ids.pad_id,
        }
        if req.priority and self.api.priority:
            kwargs["priority"] = executor_priority(req.priority)
        if stop_words:
            kwargs["stop_words"] = stop_words
        if req.bad_words_ids:
            kwargs["bad_words"] = [list(w) for w in req.bad_words_ids]
        if req.logit_bias:
            kwargs["embedding_bias"] = binding_call(
                embedding_bias, "logit_bias", "sampling.logit_bias", bias=req.logit_bias, width=self.layout.vocab_size
            )
        if req.guide is not None:
            if req.guide.kind not in self.info.guided_decoding:
                raise InvalidArgument(f"The trtllm engine does not support {req.guide.kind}.", field=req.guide.field)
            if self._guides is not None:  # before the runtime, where a failure fails the whole batch
                self._guides.check(req.guide)
            guide_type = getattr(tl.GuidedDecodingParams.GuideType, EXECUTOR_GUIDE_TYPES[req.guide.kind])
            kwargs["guided_decoding_params"] = binding_call(
                tl.GuidedDecodingParams, "guide", req.guide.field, guide_type=guide_type, guide=guide_text(req.guide)
            )
        executor_request = self._executor_request(kwargs, adapter, with_weights=False)
        local_stops = local_stop_tokens(req, ids.extra_eos) if req.min_new_tokens > 0 else frozenset()
        seqs = [
            SequenceTracker(
                i,
                req,
                ids.end_id,
                ids.extra_eos,
                stop_words=stop_words,
                local_stops=local_stops,
                max_seq_len=self.layout.max_seq_len,
            )
            for i in range(req.num_sequences)
        ]
        with self._enqueue_lock:
            if self._local_queue_limit is not None and self.stats().queued >= self._local_queue_limit:
                raise Overloaded(
                    f"The server is at capacity ({self._local_queue_limit} requests waiting); retry later."
                )
            if adapter is not None and adapter.task_id not in self._sent_tasks:
                executor_request = self._executor_request(kwargs, adapter, with_weights=True)
            try:
                rid = int(self._executor.enqueue_request(executor_request))
            except Exception as e:
                raise classify_enqueue_error(e, stopping=self._stopping) from e
            if adapter is not None:
                self._sent_tasks.add(adapter.task_id)
            live = _Live(request=req, rid=rid, seqs=seqs, enqueued=time.monotonic(), adapter=adapter, kwargs=kwargs)
            queued = EngineOutput(req.request_id, state=RequestState.QUEUED, time=live.enqueued)
            live.outputs = OutputStream(queued, functools.partial(self._closed, live))
            self._live[rid] = live
            self._by_name[req.request_id] = live
        return live

    def _executor_request(self, kwargs: dict[str, Any], adapter: TrtAdapter | None, *, with_weights: bool) -> Any:
        """The executor's Request; with an adapter, its `LoraConfig` (the weights only when
        `with_weights`: the PEFT cache keeps them under the task id)."""
        if adapter is not None:
            lora = (
                {"task_id": adapter.task_id, "weights": adapter.weights, "config": adapter.config}
                if with_weights
                else {"task_id": adapter.task_id}
            )
            kwargs = {**kwargs, "lora_config": binding_call(self._tl.LoraConfig, "LoRA adapter", "adapter", **lora)}
        return binding_call(self._tl.Request, "request", None, **kwargs)

    def _resend_with_weights(self, live: _Live) -> bool:
        """Enqueue a request again with its adapter's weights after the executor answered
        that its task is not in the PEFT cache (peftCacheManager.cpp); once per request.
        False when that is not possible (resent already, or the executor refuses)."""
        if live.adapter is None or live.kwargs is None or live.lora_resent or live.cancel_sent:
            return False
        live.lora_resent = True
        with self._enqueue_lock:
            try:
                request = self._executor_request(live.kwargs, live.adapter, with_weights=True)
                rid = int(self._executor.enqueue_request(request))
            except Exception as e:
                log.warning("request %s: resending LoRA weights failed: %s", live.request.request_id, e)
                return False
            self._live.pop(live.rid, None)
            live.rid = rid
            self._live[rid] = live
        log.info(
            "request %s: LoRA task %d was not in the executor's cache; sent its weights again",
            live.request.request_id,
            live.adapter.task_id,
        )
        return True

    # ---------------------------------------------------------------- awaiter thread

    def _await_loop(self) -> None:
        executor = self._executor
        timeout = datetime.timedelta(milliseconds=self.options.await_timeout_ms)
        want_stats = self.options.request_stats_max_iterations > 0
        while not self._stopping:
            try:
                responses = executor.await_responses(timeout=timeout)
                stats = list(executor.get_latest_request_stats()) if want_stats else []
                if self._events is not None and self._reuse is not None:
                    self._reuse.on_events(self._events.get_latest_events(datetime.timedelta(0)))
            except Exception as e:
                if not self._stopping:
                    log.error("TensorRT-LLM executor failed: %s", e)
                    self._post(self._die, e)
                return
            if responses or stats:
                self._post(self._dispatch, list(responses), stats)

    def _post(self, fn: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
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
            self._put(live, EngineOutput(live.request.request_id, error=error, finished=True, time=now))
        self._live.clear()
        self._by_name.clear()

    @staticmethod
    def _put(live: _Live, out: EngineOutput) -> None:
        assert live.outputs is not None
        live.outputs.put(out)

    def _forget(self, live: _Live) -> None:
        live.executor_done = True
        self._live.pop(live.rid, None)
        if self._by_name.get(live.request.request_id) is live:
            del self._by_name[live.request.request_id]

    def _dispatch(self, responses: list[Any], stats: list[Any]) -> None:
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
        grouped: dict[int, list[Any]] = {}
        for r in responses:  # several responses of one id in one batch stay in order
            grouped.setdefault(r.request_id, []).append(r)
        for rid, batch in grouped.items():
            found = self._live.get(rid)
            if found is not None:
                self._handle(found, batch, now)

    def _note_reuse(self, live: _Live, perf: Any) -> None:
        """Take a request's reused tokens from a result's KV cache metrics (on every result
        once the context blocks are allocated; the largest seen wins). The request is counted
        in the prefix cache counters when it ends."""
        blocks = perf_reused_blocks(perf)
        if blocks is None:
            return
        cached = reused_tokens(blocks, self.layout.tokens_per_block, len(live.request.prompt_ids))
        live.cached = max(live.cached or 0, cached)

    def _advance(self, live: _Live, state: RequestState, now: float) -> None:
        rank = _STATE_RANK[state]
        if rank > live.state:
            live.state = rank
            self._put(live, EngineOutput(live.request.request_id, state=state, time=now))

    def _handle(self, live: _Live, batch: list[Any], now: float) -> None:
        """Turn one batch of a request's responses into EngineOutputs."""
        req = live.request
        steps: dict[int, SequenceStep] = {}
        trailing: list[SequenceStep] = []  # END_ID finishes, sent after their tokens
        prompt_info: list[PromptTokenInfo] | None = None
        executor_final = False
        stopped_locally = False
        for response in batch:
            if response.has_error():
                message = str(response.error_msg)
                if is_cache_miss(message) and self._resend_with_weights(live):
                    return
                self._forget(live)
                error = classify_error(message)
                self._put(live, EngineOutput(req.request_id, error=error, finished=True, time=now))
                return
            res = response.result
            executor_final = executor_final or bool(res.is_final)
            if self._reuse_reported:
                self._note_reuse(live, getattr(res, "request_perf_metrics", None))
            if req.prompt_logprobs is not None and not live.prompt_info_sent:
                logits = getattr(res, "context_logits", None)  # on every result when asked
                if logits is not None:
                    prompt_info = prompt_logprobs(logits, req.prompt_ids, req.prompt_logprobs, self.info.vocab_size)
                    live.prompt_info_sent = True
            index = int(getattr(res, "sequence_index", 0) or 0)
            if index >= len(live.seqs):
                continue
            seq = live.seqs[index]
            tokens = [int(t) for t in res.output_token_ids[0]] if res.output_token_ids else []
            lps: list[float | None] | None = None
            if req.logprobs:
                values = new_logprobs(res.log_probs[0] if res.log_probs else None, seq.received, len(tokens))
                if values is None and tokens:
                    log.warning("request %s: logprobs missing from a response; reported as unknown", req.request_id)
                lps = list(values) if values is not None else [None] * len(tokens)
            finals = getattr(res, "finish_reasons", None)
            name = str(getattr(finals[0], "name", "")) if finals else ""
            advance = seq.advance(
                tokens,
                lps,
                final=bool(getattr(res, "is_sequence_final", res.is_final)),
                finish=_FINISH.get(name),  # None: no reason (0.11 results, or NOT_FINISHED)
                cancel_sent=live.cancel_sent,
            )
            stopped_locally = stopped_locally or advance.stopped_locally
            if advance.step is not None:
                merged = steps.get(index)
                if merged is None:
                    steps[index] = advance.step
                elif not advance.step.token_ids and advance.step.finish_reason is FinishReason.EOS:
                    trailing.append(advance.step)  # an excluded end token after earlier tokens of this batch
                else:
                    merged.token_ids += advance.step.token_ids
                    if merged.logprobs is not None and advance.step.logprobs is not None:
                        merged.logprobs += advance.step.logprobs
                    merged.finish_reason, merged.stop_token_id = advance.step.finish_reason, advance.step.stop_token_id
            if advance.trailing is not None:
                trailing.append(advance.trailing)
        outputs = [
            EngineOutput(req.request_id, sequences=list(steps.values()), time=now, cached_tokens=live.cached or 0)
        ]
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
            if self._reuse is not None and live.cached is not None:
                self._reuse.record(len(req.prompt_ids), live.cached)
            if not executor_final and (stopped_locally or all_done):  # the engine stopped it itself
                self._cancel(live)
        for out in outputs:
            if out.sequences or out.state is not None or out.finished:
                self._put(live, out)
