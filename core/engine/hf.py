"""HF engine: in-flight batching of any transformers causal LM on torch (the CPU default).

The batch is iteration-level, TGI-style: a worker thread owns the running batch, one slot per
running sequence in a slot-addressed KV cache written in place (core.engine.hf_cache). At each
step boundary it applies cancellations and admits waiting requests into free slots; then one
forward computes a decode token for every running sequence and the whole prompt of every
admitted request together (packed, without padding: a prefill rides along with a decode step
instead of taking a forward of its own). A finished or cancelled sequence frees its slot at
once, without moving any KV data.

Why this instead of transformers' continuous-batching manager (`init_continuous_batching`,
transformers 5): that manager has no per-request seed, returns processed (not raw) logprobs and
no top-k alternatives, never delivers a terminal event after a cancel, and on a CPU it is
slower per token than a padded static batch of the same small model. This engine keeps the
padded batch's speed and adds what serving needs: per-request sampling parameters and seeded
generators (reproducible whatever else is in the batch), raw logprobs with top-N alternatives,
bad words, min tokens, logit bias, prompt logprobs, and bounded memory (max batch size, max
total tokens, bounded queue).

Supported models: decoder-only checkpoints with full attention whose attention modules call
transformers' AttentionInterface and whose forward takes position_ids (Llama, Mistral, Qwen2,
GPT-2, ...).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeAlias

import torch

from core.engine import hf_guided
from core.engine.base import EngineLifecycle, OutputStream, prompt_logprobs
from core.engine.hf_cache import ATTENTION, SlotKVCache, StepPlan
from core.engine.hf_config import KIND, check_request, default_threads, duplicate_id, engine_info, queue_full
from core.engine.hf_lora import AdapterWeights, LoraBank, load_weights
from core.engine.hf_prefix import BLOCK_SIZE, PrefixStore
from core.engine.hf_sampling import BatchParams, RowParams, apply_penalties, draw, filter_logits
from core.errors import EngineDead, EngineFailure, NotReady
from core.lora import MAX_LORA_RANK, AdapterSpec, AdapterStatus, adapter_exists, unknown_adapter
from core.sampling import NEUTRAL, resolve_generic
from core.scheduling import WaitingQueue, admission_cost
from core.types import (
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    PrefixCacheStats,
    RequestState,
    ResolvedSampling,
    SamplingOptions,
    SequenceStep,
)

if TYPE_CHECKING:
    from core.config import CoreConfig
    from core.tokenizer import Tokenizer

log = logging.getLogger(__name__)

#: Per row of a step: the chosen token's logprob, and its top alternatives (id, logprob).
Logprobs: TypeAlias = dict[int, float]
TopLogprobs: TypeAlias = dict[int, list[tuple[int, float]]]


def build(config: CoreConfig, tokenizer: Tokenizer) -> HfEngine:
    """The engine in this process, on a thread of its own (`--no-engine-process`; see
    core.engine.hf_process for the default)."""
    return HfEngine(config.model, **engine_kwargs(config, tokenizer))


def engine_kwargs(config: CoreConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """HfEngine's keyword arguments from the core's configuration (plain values: they also
    travel to an engine process)."""
    return dict(
        eos_token_ids=tokenizer.eos_token_ids,
        vocab_size=tokenizer.vocab_size,
        pad_token_id=tokenizer.pad_token_id,
        max_batch_size=config.max_batch_size,
        max_queue_size=config.max_queue_size,
        max_total_tokens=config.max_total_tokens,
        max_prefill_tokens=config.max_prefill_tokens,
        max_n=config.max_n,
        dtype=config.dtype,
        device=config.device,
        threads=config.threads,
        step_trace=config.hf_step_trace,
        guides=hf_guided.GuideMatchers(tokenizer.hf, tokenizer.eos_token_ids, config.guide_cache_size),
        prefix_cache_bytes=int(config.prefix_cache_mib * 2**20) if config.prefix_cache else 0,
        prefix_block_size=config.prefix_cache_block_size,
        scheduling_policy=config.scheduling_policy,
        tenant_weights=dict(config.tenant_weight),
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
    )


@dataclass(eq=False, slots=True)
class _Req:
    """A live request (owned by the worker once admitted)."""

    req: EngineRequest
    reserved_tokens: int
    outputs: OutputStream | None  # None when the outputs leave the process (see HfEngine.submit)
    rows: list[_Row] = field(default_factory=list)
    unfinished: int = 0
    admitted: bool = False
    grammar: Any = None  # the compiled guide (hf_guided), copied into each row
    lora: AdapterWeights | None = None  # its adapter (resolved at admission to the queue)
    lora_slot: int = -1  # the adapter slot its rows use (-1: none)


@dataclass(eq=False, slots=True)
class _Row:
    """One sequence of a request in the running batch."""

    owner: _Req
    index: int
    slot: int
    params: RowParams
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    finished: bool = False
    matcher: Any = None  # this row's guide state (hf_guided), advanced with each token
    lora: int = -1  # its adapter's slot (core.engine.hf_lora.LoraBank; -1: the base model)

    @property
    def history(self) -> list[int]:
        return self.owner.req.prompt_ids + self.generated


#: What a worker step hands to the event loop: (request, output) pairs, in order.
Emits: TypeAlias = list[tuple[_Req, EngineOutput]]


class HfEngine(EngineLifecycle):
    """In-flight batching engine over a transformers causal LM.

    Args:
        model_path: Hugging Face checkpoint directory.
        eos_token_ids: the model's EOS ids (a sequence ends on any of them).
        vocab_size: tokenizer vocabulary size (valid token ids are below it).
        pad_token_id: id used for left padding (any id works: padding is masked).
        max_batch_size: sequences in the running batch.
        max_queue_size: waiting requests; one more raises Overloaded (RESOURCE_EXHAUSTED).
        max_total_tokens: budget of sum(prompt + max_new_tokens) over running sequences.
        max_prefill_tokens: prompt tokens computed in one prefill step, a prompt's cached
            prefix not counted (vLLM's token budget counts the same; one longer prompt is still
            admitted alone).
        max_n: sequences per request.
        dtype: "auto" (float32 on CPU, the checkpoint's dtype elsewhere) or a torch dtype name.
        device: torch device.
        threads: torch intra-op threads (0: core.engine.hf_config.default_threads).
        guides: compiled guides for guided decoding (hf_guided); None: guided decoding is off.
        step_trace: a file that gets one line per engine step ("" for none; `--hf-step-trace`).
        prefix_cache_bytes: bound of the prefix cache (core.engine.hf_prefix) in bytes of keys
            and values; 0: no prefix cache (`--prefix-cache-mib`, `--no-prefix-cache`).
        prefix_block_size: tokens per prefix cache block (`--prefix-cache-block-size`).
        scheduling_policy: order of waiting requests, "fcfs" or "priority" (core.scheduling).
        tenant_weights: tenant -> share weight (`--tenant-weight`; others weigh 1).
        max_loras: LoRA adapter slots (`--max-loras`; 0: no adapters; core.engine.hf_lora).
        max_lora_rank: the largest adapter rank (`--max-lora-rank`).
    """

    kind = KIND

    def __init__(
        self,
        model_path: str | Path,
        *,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        pad_token_id: int | None = None,
        max_batch_size: int = 32,
        max_queue_size: int = 256,
        max_total_tokens: int = 131072,
        max_prefill_tokens: int = 4096,
        max_n: int = 16,
        dtype: str = "auto",
        device: str = "cpu",
        threads: int = 0,
        guides: hf_guided.GuideMatchers | None = None,
        step_trace: str = "",
        prefix_cache_bytes: int = 0,
        prefix_block_size: int = BLOCK_SIZE,
        scheduling_policy: str = "fcfs",
        tenant_weights: dict[str, float] | None = None,
        max_loras: int = 0,
        max_lora_rank: int = MAX_LORA_RANK,
    ):
        super().__init__()
        self._path = str(model_path)
        self.info = engine_info(
            self._path,
            vocab_size=vocab_size,
            max_n=max_n,
            max_batch_size=max_batch_size,
            guided_decoding=guides.kinds if guides is not None else frozenset(),
        )
        self._guides = guides
        self._eos = frozenset(eos_token_ids)
        self._pad = int(pad_token_id if pad_token_id is not None else next(iter(self._eos), 0))
        self._max_batch = max_batch_size
        self._max_queue = max_queue_size
        self._max_total = max_total_tokens
        self._max_prefill = max_prefill_tokens
        self._dtype_name = dtype
        self._device = torch.device(device)
        self._threads = threads
        # The transformers causal LM (loaded by start()); its forward takes keyword tensors.
        self._model: Any = None
        self._num_layers = 0
        self._trace_path = step_trace
        self._trace: TextIO | None = None  # the open step trace file
        self._traced: tuple[str, int, int, float] | None = None  # this step's forward, for its trace line
        # Where a step's time starts: the previous step's hand-over, or work arriving after a wait.
        self._step_started = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Shared between the event loop and the worker (guarded by _cv's lock, as are _alive
        # and _stopping: admission and the worker's death must not interleave).
        self._cv = threading.Condition()
        self._pending: WaitingQueue[_Req] = WaitingQueue(scheduling_policy, tenant_weights)
        self._aborts: set[str] = set()
        self._requests: dict[str, _Req] = {}
        self._running_requests = 0
        # Worker-only batch state: one slot per running sequence (see core.engine.hf_cache).
        self._slots: list[_Row | None] = [None] * max_batch_size
        # Occupied slots in slot order (kept sorted by _recompose: a decode step's logits come
        # in slot order, and are used as they are when every slot below the extent is live).
        self._live_slots: list[int] = []
        self._rows_live: list[_Row] = []  # rows of _live_slots
        self._live_idx: torch.Tensor | None = None
        self._extent = 0  # 1 + highest occupied slot: rows [0, extent) run each step
        self._cache: SlotKVCache | None = None
        self._pos = torch.zeros(max_batch_size, dtype=torch.long, device=self._device)  # next position per slot
        self._next = torch.full((max_batch_size,), self._pad, dtype=torch.long, device=self._device)  # next input
        # While a running row has a penalty: per slot, [slots, V] bool seen tokens (prompt and
        # output) and [slots, V] float output token counts.
        self._history: tuple[torch.Tensor, torch.Tensor] | None = None
        self._penalty_synced: set[int] = set()
        self._params: BatchParams | None = None
        self._sample_idx: torch.Tensor | None = None
        self._sample_params: BatchParams | None = None
        self._bias: torch.Tensor | None = None
        self._reserved = 0
        # The prefix cache (worker only; its capacity in blocks is set once a block's size is known).
        self._prefix_bytes = prefix_cache_bytes
        self._prefix: PrefixStore[torch.Tensor] | None = (
            PrefixStore(prefix_block_size) if prefix_cache_bytes > 0 else None
        )
        # LoRA adapters: the registered ones (guarded by _cv), those unregistered whose slots
        # the worker is to free (guarded by _cv), and the slots (worker only, from load()).
        self.max_loras = max_loras
        self._max_rank = max_lora_rank
        self._adapters: dict[str, AdapterWeights] = {}
        self._forgotten: list[AdapterWeights] = []
        self._bank: LoraBank | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Load the model (in a thread) and start the batching worker."""
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self.load)
        self._thread = threading.Thread(target=self.run, name="hf-engine", daemon=True)
        self._thread.start()

    def load(self) -> None:
        """Load the model (blocking); requests are admitted from now on, and run once `run`
        loops (on a thread of `start`'s, or in an engine process's main thread)."""
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(default_threads(self._threads))
        if self._dtype_name == "auto":
            dtype = torch.float32 if self._device.type == "cpu" else "auto"
        else:
            dtype = getattr(torch, self._dtype_name)
        # Every step is one packed forward over the slot cache (core.engine.hf_cache).
        model: Any = AutoModelForCausalLM.from_pretrained(self._path, dtype=dtype, attn_implementation=ATTENTION)
        model.to(self._device)
        model.eval()
        self._model = model
        if self.max_loras:
            self._bank = LoraBank(model, self.max_loras, self._max_rank)
        self._num_layers = int(model.config.get_text_config().num_hidden_layers)
        if self._trace_path:
            self._trace = open(self._trace_path, "a", buffering=1)
        self._logit_dim = int(model.get_output_embeddings().weight.shape[0])
        if self._guides is not None:
            self._guides.bind(self._logit_dim)
        log.info(
            "hf engine: loaded %s (%s, %s, %d threads)", self._path, model.dtype, self._device, torch.get_num_threads()
        )
        self._started = self._alive = True

    async def shutdown(self) -> None:
        """Stop the worker; requests still queued or running end with NotReady."""
        self.stop_soon()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._alive = False

    def stop_soon(self) -> None:
        """Refuse new requests and have the worker exit at the next step boundary (it ends the
        requests left with NotReady)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    def resolve_sampling(self, opts: SamplingOptions, *, random_seed: int) -> ResolvedSampling:
        """The generic (LMI "every rolling batch backend") defaults."""
        return resolve_generic(opts, random_seed=random_seed)

    def stats(self) -> EngineStats:
        """Requests in the running batch and in the queue, and the prefix cache's counters."""
        with self._cv:
            return EngineStats(
                active=self._running_requests, queued=len(self._pending), prefix_cache=self.prefix_stats()
            )

    # ---------------------------------------------------------------- adapters

    def has_adapter(self, name: str) -> bool:
        """Whether the adapter `name` is registered."""
        with self._cv:
            return name in self._adapters

    def adapters(self) -> list[AdapterStatus]:
        """Every registered adapter with its residency and request counts (core.lora)."""
        with self._cv:
            registered = sorted(self._adapters.items())
            running: collections.Counter[str] = collections.Counter()
            waiting: collections.Counter[str] = collections.Counter()
            for r in self._requests.values():
                if r.lora is not None:
                    (running if r.admitted else waiting)[r.lora.spec.name] += 1
        resident = self._bank.resident() if self._bank is not None else frozenset()
        return [AdapterStatus(w.spec, name in resident, running[name], waiting[name]) for name, w in registered]

    async def load_adapter(self, spec: AdapterSpec) -> None:
        """Register an adapter (its weights read on a thread); see `add_adapter`."""
        await asyncio.to_thread(self.add_adapter, spec)

    async def unload_adapter(self, name: str) -> None:
        """Unregister an adapter; see `remove_adapter`."""
        self.remove_adapter(name)

    def add_adapter(self, spec: AdapterSpec) -> None:
        """Read `spec`'s weights and register it under its name (blocking; any thread once the
        model is loaded). It takes a slot when a request first needs it.

        Raises:
            AdapterExists: the name is registered already.
            AdapterNotFound / InvalidArgument: core.engine.hf_lora.load_weights.
        """
        if not self.max_loras or self._model is None:
            raise NotReady("This engine serves no LoRA adapters (--max-loras 0) or is not loaded yet.")
        with self._cv:
            if spec.name in self._adapters:
                raise adapter_exists(spec.name)
        weights = load_weights(spec, self._model, self._max_rank, self._model.dtype)
        with self._cv:
            if spec.name in self._adapters:
                raise adapter_exists(spec.name)
            self._adapters[spec.name] = weights

    def remove_adapter(self, name: str) -> None:
        """Unregister `name`: new requests naming it fail with NOT_FOUND; those admitted
        already run with it, and its slot is freed once none runs.

        Raises:
            AdapterNotFound: `name` is not registered.
        """
        with self._cv:
            weights = self._adapters.pop(name, None)
            if weights is None:
                raise unknown_adapter(name)
            self._forgotten.append(weights)
            self._cv.notify()

    # ---------------------------------------------------------------- requests

    def generate(self, request: EngineRequest) -> OutputStream:
        """Admit a request and stream its outputs; see core.engine.base.Engine for the contract.

        Raises:
            NotReady / EngineDead: the engine is not serving.
            InvalidArgument: more sequences or batch tokens than the batch can ever hold, the id
                of a request still running, or a guide that does not compile.
            Overloaded: max_queue_size requests are already waiting.
        """
        need = check_request(request, self._max_batch, self._max_total)

        def on_close(finished: bool) -> None:
            if not finished:
                self.abort(request.request_id)

        queued = EngineOutput(request.request_id, state=RequestState.QUEUED, time=time.monotonic())
        r = _Req(request, need, OutputStream(queued, on_close), grammar=self._grammar(request))
        self._enqueue(r)
        assert r.outputs is not None
        return r.outputs

    def submit(self, request: EngineRequest) -> None:
        """Admit a request whose outputs leave through `_publish` only (no OutputStream: the
        engine process's side of core.engine.hf_process). Raises as `generate` does."""
        need = check_request(request, self._max_batch, self._max_total)
        self._enqueue(_Req(request, need, None, grammar=self._grammar(request)))

    def _grammar(self, request: EngineRequest) -> Any:
        """The compiled guide of `request` (hf_guided), None without one.

        Raises:
            InvalidArgument: the guide does not compile.
        """
        if request.guide is None or self._guides is None:
            return None
        return self._guides.compiled(request.guide)

    def _enqueue(self, r: _Req) -> None:
        request = r.req
        with self._cv:
            self._check_serving()
            if request.request_id in self._requests:
                raise duplicate_id(request.request_id)
            if request.adapter:
                r.lora = self._adapters.get(request.adapter)
                if r.lora is None:
                    raise unknown_adapter(request.adapter)
            if len(self._pending) >= self._max_queue:
                raise queue_full(self._max_queue)
            self._pending.push(r, cost=admission_cost(request), priority=request.priority, tenant=request.tenant)
            self._requests[request.request_id] = r
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        """Cancel a request at the next step boundary (no-op when unknown or finished)."""
        with self._cv:
            if request_id in self._requests:
                self._aborts.add(request_id)
                self._cv.notify()

    # ---------------------------------------------------------------- worker

    def run(self) -> None:
        """The batching loop: one step (core.engine.hf_cache.StepPlan) per iteration until stopped
        or dead."""
        self._step_started = time.perf_counter()
        try:
            with torch.inference_mode():
                while True:
                    with self._cv:
                        while not (self._stopping or self._pending or self._aborts or self._live_slots):
                            self._cv.wait()
                            self._step_started = time.perf_counter()
                        if self._stopping:
                            break
                        emits: list[tuple[_Req, EngineOutput]] = []
                        self._cancel_pending(emits)
                        aborts, self._aborts = self._aborts, set()
                        admitted = self._take_admissible()
                        self._running_requests += len(admitted)
                    if aborts:
                        self._cancel_running(aborts, emits)
                    try:
                        if admitted or self._live_slots:
                            self._step(admitted, emits)
                    except Exception as e:  # a failed step fails the requests in it, not the engine
                        log.exception("hf engine step failed")
                        self._fail_batch(admitted, e, emits)
                    self._finish_step(emits)
        except BaseException as e:  # the worker itself broke: the engine is dead
            log.exception("hf engine worker died")
            self._die(e if isinstance(e, Exception) else EngineDead(repr(e)))
            return
        finally:
            if self._trace is not None:
                self._trace.close()
        self._die(NotReady("The engine shut down; retry on another replica."))

    def _finish_step(self, emits: list[tuple[_Req, EngineOutput]]) -> None:
        """Retire the step's finished requests, write its trace line and hand its outputs over
        (the next step's time starts with the hand-over)."""
        done = [r for r, out in emits if out.finished or out.error is not None]
        if done:
            with self._cv:
                for r in done:
                    if self._requests.get(r.req.request_id) is r:
                        del self._requests[r.req.request_id]
                    if r.admitted:
                        r.admitted = False
                        self._running_requests -= 1
                        self._reserved -= r.reserved_tokens
                        served = len(r.req.prompt_ids) + sum(len(row.generated) for row in r.rows)
                        self._pending.settle(r.req.tenant, admission_cost(r.req), served)
        now = time.perf_counter()
        if self._traced is not None:
            self._write_trace(now - self._step_started)
        self._step_started = now
        if emits:
            self._publish(emits)

    def _publish(self, emits: Emits) -> None:
        """Hand one step's outputs over to their consumers (from the worker thread): here, to
        the OutputStreams on the event loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_deliver, emits)

    def _report_death(self, error: Exception) -> None:
        """Tell the serving side that the engine died of `error` (from the worker thread)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._mark_dead, error)

    def _die(self, error: Exception) -> None:
        """The worker is exiting: fail every request left with `error` when it is NotReady (an
        orderly shutdown), else with EngineDead, and report the death."""
        crashed = not isinstance(error, NotReady)
        with self._cv:
            self._alive = False
            live = list(self._requests.values())
            self._requests.clear()
            self._pending.clear()
            self._running_requests = 0
        failure = EngineDead(f"The engine stopped: {error}") if crashed else error
        now = time.monotonic()
        emits = [(r, EngineOutput(r.req.request_id, error=failure, finished=True, time=now)) for r in live]
        if emits:
            self._publish(emits)
        if crashed:
            self._report_death(error)

    def _cancel_pending(self, emits: Emits) -> None:
        """Under the lock: drop aborted requests that are still waiting."""
        if not self._aborts:
            return
        for r in self._pending.remove_if(lambda r: r.req.request_id in self._aborts):
            self._aborts.discard(r.req.request_id)
            emits.append((r, _cancelled(r)))

    def _take_admissible(self) -> list[_Req]:
        """Under the lock: admit waiting requests, in the queue's order (core.scheduling), while
        they fit the batch and token budgets; the first that does not fit waits at the head.

        A request with an adapter takes the adapter's slot (core.engine.hf_lora.LoraBank.assign:
        its own, a free one, or the least recently used one no running sequence uses); when
        every slot is in use by running sequences of other adapters, it keeps its place in the
        queue until one frees, and the requests behind it are admitted meanwhile (vLLM's
        scheduler skips a request whose adapter cannot be scheduled the same way)."""
        admitted: list[_Req] = []
        rows = len(self._live_slots)
        prefill = 0
        busy = {row.lora for row in self._rows_live if row.lora >= 0}
        bank = self._bank
        if self._forgotten and bank is not None:
            for weights in self._forgotten:
                bank.forget(weights, busy)
            self._forgotten = [w for w in self._forgotten if bank.slot_of(w) is not None]
        while (r := self._pending.peek()) is not None:
            if rows + r.req.num_sequences > self._max_batch or self._reserved + r.reserved_tokens > self._max_total:
                break
            plen = len(r.req.prompt_ids) - self._cached_tokens(r)  # after the check a full batch fails every step
            if admitted and prefill + plen > self._max_prefill:
                break
            if r.lora is not None and bank is not None:
                slot = bank.assign(r.lora, busy)
                if slot is None:
                    self._pending.set_aside()
                    continue
                r.lora_slot = slot
                busy.add(slot)
            self._pending.pop()
            r.admitted = True
            admitted.append(r)
            rows += r.req.num_sequences
            prefill += plen
            self._reserved += r.reserved_tokens
        self._pending.restore()
        return admitted

    def _cancel_running(self, ids: set[str], emits: Emits) -> None:
        owners = {id(row.owner): row.owner for row in self._rows_live if row.owner.req.request_id in ids}
        for r in owners.values():
            emits.append((r, _cancelled(r)))
        self._release([row for row in self._rows_live if row.owner.req.request_id in ids])

    def _fail_batch(self, admitted: list[_Req], error: Exception, emits: Emits) -> None:
        owners = {id(r): r for r in admitted}
        owners.update({id(row.owner): row.owner for row in self._rows_live})
        for r in owners.values():
            emits.append(
                (
                    r,
                    EngineOutput(
                        r.req.request_id,
                        error=EngineFailure(f"Generation failed: {error}"),
                        finished=True,
                        time=time.monotonic(),
                    ),
                )
            )
        self._release([row for row in self._slots if row is not None], keep_blocks=False)

    # ---------------------------------------------------------------- the step

    def _step(self, reqs: list[_Req], emits: Emits) -> None:
        """One engine step: a decode token for every running sequence and the prompt of every
        admitted request (the tokens after its cached prefix: core.engine.hf_prefix), in one
        packed forward (core.engine.hf_cache.StepPlan); then each running sequence's next token,
        and each new sequence's first token and slot; the prompts' new full blocks go to the
        prefix cache."""
        dev = self._device
        live, rows_live = self._live_slots, self._rows_live
        r_dec = len(live)
        now = time.monotonic()
        for r in reqs:
            emits.append((r, EngineOutput(r.req.request_id, state=RequestState.SCHEDULED, time=now)))
        if self._cache is None:
            self._cache = SlotKVCache(self._num_layers, self._max_batch, dev)
        cache = self._cache
        # New sequences take free slots now (n > 1 rows share their request's prompt tokens).
        free = (s for s, row in enumerate(self._slots) if row is None)
        lens = [len(r.req.prompt_ids) for r in reqs]
        new_rows: list[_Row] = []
        source: list[int] = []  # request index of each new row
        for i, r in enumerate(reqs):
            r.rows = [self._new_row(r, k, next(free)) for k in range(r.req.num_sequences)]
            r.unfinished = len(r.rows)
            new_rows += r.rows
            source += [i] * len(r.rows)
        prefixes = [self._cached_prefix(r) for r in reqs]
        cached = [sum(block.shape[3] for block in blocks) for blocks in prefixes]
        end = cache.place([(row.slot, lens[i]) for row, i in zip(new_rows, source, strict=True)], live)
        for r, n, blocks in zip(reqs, lens, prefixes, strict=True):
            if blocks:
                cache.write_prefix([row.slot for row in r.rows], end + 1 - n, blocks)
        computed = [n - c for n, c in zip(lens, cached, strict=True)]  # prompt tokens in the forward
        plan = self._plan(reqs, lens, computed, new_rows, source, end)
        ids = [self._next[self._live_idx]] if r_dec else []
        pos = [self._pos[self._live_idx]] if r_dec else []
        for r, n, c in zip(reqs, lens, cached, strict=True):
            ids.append(torch.tensor(r.req.prompt_ids[c:], dtype=torch.long, device=dev))
            pos.append(torch.arange(c, n, device=dev))
        want_prompt = any(r.req.prompt_logprobs is not None for r in reqs)
        ends = list(itertools.accumulate(computed, initial=r_dec))  # packed offset of each prompt, then N
        keep = list(range(r_dec)) + [e - 1 for e in ends[1:]]
        cache.plan = plan
        bank = self._bank
        if bank is not None:
            token_slots = [row.lora for row in rows_live]
            for r, n in zip(reqs, computed, strict=True):
                token_slots += [r.lora_slot] * n
            if any(s >= 0 for s in token_slots):
                bank.set_step(token_slots, dev)
        try:
            out = self._forward(
                "mixed" if r_dec and reqs else "decode" if r_dec else "prefill",
                r_dec + len(reqs),
                ends[-1],
                input_ids=torch.cat(ids)[None],
                position_ids=torch.cat(pos)[None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=0 if want_prompt else torch.tensor(keep, device=dev),
                slot_plan=plan,
            )
        finally:
            cache.plan = None
            if bank is not None:
                bank.clear_step()
        cache.length = end + 1
        self._store_prefixes(reqs, lens, end)
        logits = out.logits[0]
        if want_prompt:
            all_logits, logits = logits, logits[torch.tensor(keep, device=dev)]
        if r_dec:
            self._decode_tokens(logits[:r_dec], emits)
        if reqs:
            done = time.monotonic()
            for i, r in enumerate(reqs):
                info = None
                if r.req.prompt_logprobs is not None:  # computed whole: such prompts skip the cache
                    info = prompt_logprobs(all_logits[ends[i] : ends[i + 1]], r.req.prompt_ids, r.req.prompt_logprobs)
                prefilled = EngineOutput(
                    r.req.request_id,
                    state=RequestState.PREFILLED,
                    prompt_logprobs=info,
                    cached_tokens=cached[i],
                    time=done,
                )
                emits.append((r, prefilled))
            first = logits[r_dec:]
            if len(source) != len(reqs):
                first = first[torch.tensor(source, device=dev)]
            self._first_tokens(new_rows, source, lens, first.float(), emits)
        finished = [row for row in rows_live if row.finished]
        if finished or new_rows:
            if finished:
                self._release(finished)
            else:
                self._recompose()

    def _plan(
        self,
        reqs: list[_Req],
        lens: list[int],
        computed: list[int],
        new_rows: list[_Row],
        source: list[int],
        end: int,
    ) -> StepPlan:
        """The step's StepPlan: where every token's keys and values go, and the masks.

        lens: each joining prompt's tokens; computed: those of its tokens in the forward (the
        last ones; the others are its cached prefix, already in its slots)."""
        dev, cache = self._device, self._cache
        assert cache is not None
        live, extent = self._live_slots, self._extent
        r_dec = len(live)
        slots: list[int] = list(live)
        cols: list[int] = [end] * r_dec
        src: list[int] = list(range(r_dec))
        ends = list(itertools.accumulate(computed, initial=r_dec))
        for row, i in zip(new_rows, source, strict=True):
            n = computed[i]
            slots += [row.slot] * n
            cols += range(end + 1 - n, end + 1)
            src += range(ends[i], ends[i + 1])
        decode_mask = None
        first = min((cache.start[s] for s in live), default=end)
        if r_dec:
            cache.mask[:extent, end] = True
            decode_mask = cache.mask[:extent, None, None, first : end + 1]
        plan = StepPlan(
            cache=cache,
            decode_rows=r_dec,
            extent=extent,
            live_idx=None if r_dec == extent else self._live_idx,
            end=end,
            first=first,
            decode_mask=decode_mask,
            write_slots=torch.tensor(slots, device=dev),
            write_cols=torch.tensor(cols, device=dev),
            write_src=None if len(src) == ends[-1] else torch.tensor(src, device=dev),
        )
        if reqs:
            # Prompt i's computed tokens left-padded to `width` queries (a padding query repeats
            # its first computed token); keys are the `span` columns ending at `end`. Query j
            # sits in column end + 1 - width + j and key k in column end + 1 - span + k, so
            # "key column <= query column" is causal attention for every prompt at once, and the
            # slot's mask leaves out the columns before its prompt. A padding query attends to
            # its own column only (its output is dropped).
            width, span = max(computed), max(lens)
            gather = torch.tensor(
                [[ends[i] + max(0, j - (width - n)) for j in range(width)] for i, n in enumerate(computed)], device=dev
            )
            prompt_slots = torch.tensor([r.rows[0].slot for r in reqs], device=dev)
            q = torch.arange(width, device=dev)[:, None] + (span - width)
            k = torch.arange(span, device=dev)[None, :]
            real = (
                torch.arange(width, device=dev)[None, :]
                >= torch.tensor([width - n for n in computed], device=dev)[:, None]
            )  # [G, P] real queries
            keys = cache.mask[:, end + 1 - span : end + 1].index_select(0, prompt_slots)  # [G, K]
            mask = torch.where(real[:, :, None], keys[:, None, :] & (k <= q)[None], (k == q)[None])
            plan.prefill_gather = gather
            if lens != computed:  # some prompt has a cached prefix: its keys are in its slot only
                plan.prefill_slots = prompt_slots
            plan.prefill_first = end + 1 - span
            plan.prefill_mask = mask[:, None]
            plan.prefill_scatter = torch.tensor(
                [i * width + j for i, n in enumerate(computed) for j in range(width - n, width)], device=dev
            )
        return plan

    # ---------------------------------------------------------------- prefix cache

    def _cached_prefix(self, r: _Req) -> list[torch.Tensor]:
        """The cached blocks `r`'s prompt starts with (core.engine.hf_prefix.PrefixStore.lookup);
        none without a cache, or when the request wants prompt logprobs (they need the logits of
        every prompt token, so its prompt is computed whole; its blocks are still stored)."""
        if self._prefix is None or r.req.prompt_logprobs is not None:
            return []
        return self._prefix.lookup(r.req.prompt_ids, root=_root(r))

    def _cached_tokens(self, r: _Req) -> int:
        """The prompt tokens of `r` that `_cached_prefix` would find now (0 where it finds none)."""
        if self._prefix is None or r.req.prompt_logprobs is not None:
            return 0
        return self._prefix.cached_tokens(r.req.prompt_ids, root=_root(r))

    def _store_prefixes(self, reqs: list[_Req], lens: list[int], end: int) -> None:
        """Copy the joining prompts' full blocks that the prefix cache lacks out of their slots
        (their first sequence's), right after the forward that computed them."""
        store, cache = self._prefix, self._cache
        if store is None or cache is None or not reqs:
            return
        bs = store.block_size
        if self._prefix_bytes and not store.capacity:  # a block's size is known from the first step on
            store.set_capacity(self._prefix_bytes // max(1, cache.block_bytes(bs)))
        for r, n in zip(reqs, lens, strict=True):
            store.insert(
                r.req.prompt_ids, functools.partial(_read_blocks, cache, r.rows[0].slot, end + 1 - n, bs), root=_root(r)
            )

    def _store_sequence(self, row: _Row) -> None:
        """Store the full blocks of a leaving sequence beyond its prompt's: its prompt and the
        tokens it generated but the last (whose keys and values were never computed), so that
        a session's or a chat's next turn, which sends them back as its prompt, reuses them
        (vLLM caches the blocks of generated tokens too)."""
        store, cache = self._prefix, self._cache
        if store is None or cache is None or not store.capacity:
            return
        bs = store.block_size
        tokens = row.history[:-1]
        if len(tokens) // bs > len(row.owner.req.prompt_ids) // bs:
            store.insert(
                tokens,
                functools.partial(_read_blocks, cache, row.slot, cache.start[row.slot], bs),
                root=_root(row.owner),
            )

    def prefix_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counters (None: the cache is off); safe from any thread."""
        return None if self._prefix is None else self._prefix.stats()

    def _forward(self, kind: str, rows: int, tokens: int, **inputs: Any) -> Any:
        """The model's forward; with a step trace, timed for the step's line (`_write_trace`)."""
        if self._trace is None:
            return self._model(**inputs)
        t0 = time.perf_counter()
        out = self._model(**inputs)
        self._traced = (kind, rows, tokens, time.perf_counter() - t0)
        return out

    def _write_trace(self, step_s: float) -> None:
        """One line of the step trace: kind, sequences, tokens, forward seconds, and the step's
        seconds: from the end of the previous step (or an idle wait) up to handing this step's
        outputs over (the previous hand-over, admission, forward, sampling), so that the lines
        add up to the engine's busy time."""
        assert self._trace is not None and self._traced is not None
        kind, rows, tokens, forward_s = self._traced
        self._trace.write(f"{kind} {rows} {tokens} {forward_s:.6f} {step_s:.6f}\n")
        self._traced = None

    def _first_tokens(
        self, rows: list[_Row], source: list[int], lens: list[int], logits: torch.Tensor, emits: Emits
    ) -> None:
        """Sample the first token of each new sequence and put the unfinished ones in the batch."""
        params = BatchParams.from_rows([row.params for row in rows], self._device)
        seen_counts = self._penalty_rows(rows) if params.any_penalty else None
        tokens, lps, tops = self._sample(rows, logits, params, seen_counts, self._bias_for(rows))
        self._emit_tokens(rows, tokens, lps, tops, emits)
        for row, i, tok in zip(rows, source, tokens.tolist(), strict=True):
            if row.finished:
                assert self._cache is not None
                self._cache.release(row.slot)
                continue
            self._slots[row.slot] = row
            self._live_slots = [*self._live_slots, row.slot]
            self._pos[row.slot] = lens[i]
            self._next[row.slot] = tok

    def _new_row(self, r: _Req, k: int, slot: int) -> _Row:
        s, n = r.req.sampling, NEUTRAL
        params = RowParams(
            do_sample=s.do_sample,
            temperature=n.temperature if s.temperature is None else s.temperature,
            top_k=n.top_k if s.top_k is None else s.top_k,
            top_p=n.top_p if s.top_p is None else s.top_p,
            min_p=n.min_p if s.min_p is None else s.min_p,
            typical_p=n.typical_p if s.typical_p is None else s.typical_p,
            repetition_penalty=n.repetition_penalty if s.repetition_penalty is None else s.repetition_penalty,
            presence_penalty=n.presence_penalty if s.presence_penalty is None else s.presence_penalty,
            frequency_penalty=n.frequency_penalty if s.frequency_penalty is None else s.frequency_penalty,
        )
        gen = None
        if s.do_sample:
            gen = torch.Generator(device=self._device)
            gen.manual_seed((s.seed + k) & 0xFFFF_FFFF_FFFF_FFFF)
        matcher = r.grammar.deep_copy() if r.grammar is not None else None
        return _Row(r, k, slot, params, gen, matcher=matcher, lora=r.lora_slot)

    # ---------------------------------------------------------------- decode

    def _decode_tokens(self, logits: torch.Tensor, emits: Emits) -> None:
        """The next token of every running sequence from its logits ([R, V], live slot order)."""
        rows, idx, params = self._rows_live, self._live_idx, self._params
        assert idx is not None and params is not None, "decode without running rows"
        self._pos[idx] += 1
        history = self._history
        seen_counts = None if history is None else (history[0][idx], history[1][idx])
        tokens, lps, tops = self._sample(
            rows, logits.float(), params, seen_counts, self._bias, self._sample_idx, self._sample_params
        )
        self._next[idx] = tokens
        if history is not None:
            history[0][idx, tokens] = True
            history[1][idx, tokens] += 1
        self._emit_tokens(rows, tokens, lps, tops, emits)

    def _sample(
        self,
        rows: list[_Row],
        logits: torch.Tensor,
        params: BatchParams,
        seen_counts: tuple[torch.Tensor, torch.Tensor] | None,
        bias: torch.Tensor | None,
        sample_idx: torch.Tensor | None = None,
        sample_params: BatchParams | None = None,
    ) -> tuple[torch.Tensor, Logprobs | None, TopLogprobs | None]:
        """Choose the next token of every row. Returns (tokens [R] tensor, {row: logprob} or
        None, {row: top alternatives} or None).

        Args:
            rows: the rows, in logits order.
            logits: [R, V] float raw logits.
            params: the rows' parameters.
            seen_counts: [R, V] seen tokens and output counts, when a row has a penalty.
            bias: [R, V] logit bias, if any row has one.
            sample_idx, sample_params: the sampling rows and their parameters (computed when
                not given).
        """
        want_lp = [i for i, row in enumerate(rows) if row.owner.req.logprobs]
        raw_lp = logits[want_lp].log_softmax(dim=-1) if want_lp else None
        x = logits
        if params.any_penalty:
            assert seen_counts is not None, "rows with penalties come with their token history"
            x = apply_penalties(x, params, *seen_counts)
        if bias is not None:
            x = x + bias
        x = self._ban(rows, x)
        if self._guides is not None:
            x = self._guides.mask_logits(rows, x)
        tokens = x.argmax(dim=-1)
        if params.any_sample:
            if sample_idx is None or sample_params is None:
                sample_idx, sample_params = _sampling_subset(rows, params)
            probs = filter_logits(x[sample_idx], sample_params).softmax(dim=-1)
            tokens[sample_idx] = draw(probs, [rows[i].generator for i in sample_idx.tolist()])
        if raw_lp is None:
            return tokens, None, None
        sel = torch.tensor(want_lp, device=tokens.device)
        chosen = raw_lp.gather(1, tokens[sel][:, None]).squeeze(1).tolist()
        lps = dict(zip(want_lp, chosen, strict=True))
        kmax = max(rows[i].owner.req.top_logprobs for i in want_lp)
        if kmax == 0:
            return tokens, lps, None
        top_vals, top_ids = (t.tolist() for t in raw_lp.topk(kmax, dim=-1))
        tops: TopLogprobs = {}
        for j, i in enumerate(want_lp):
            k = rows[i].owner.req.top_logprobs
            tops[i] = list(zip(top_ids[j][:k], top_vals[j][:k], strict=True))
        return tokens, lps, tops

    def _ban(self, rows: list[_Row], x: torch.Tensor) -> torch.Tensor:
        """Mask bad words and, below min_new_tokens, EOS and stop tokens."""
        cloned = False
        for i, row in enumerate(rows):
            req = row.owner.req
            banned: list[int] = []
            if req.min_new_tokens and len(row.generated) < req.min_new_tokens:
                banned.extend(req.stop_token_ids)
                if not req.ignore_eos:
                    banned.extend(self._eos)
            if req.bad_words_ids:
                hist = row.history
                for word in req.bad_words_ids:
                    prefix = word[:-1]
                    if not prefix or (len(hist) >= len(prefix) and hist[-len(prefix) :] == prefix):
                        banned.append(word[-1])
            if banned:
                if not cloned:
                    x = x.clone()
                    cloned = True
                x[i, banned] = float("-inf")
        return x

    def _emit_tokens(
        self,
        rows: list[_Row],
        tokens: torch.Tensor,
        lps: Logprobs | None,
        tops: TopLogprobs | None,
        emits: Emits,
    ) -> None:
        now = time.monotonic()
        by_owner: dict[int, tuple[_Req, list[SequenceStep]]] = {}
        for i, tok in enumerate(tokens.tolist()):
            row = rows[i]
            req = row.owner.req
            row.generated.append(tok)
            if row.matcher is not None:
                row.matcher.consume_token(tok)
            step = SequenceStep(row.index, [tok])
            if lps is not None and i in lps:
                step.logprobs = [lps[i]]
                step.top_logprobs = [tops[i] if tops is not None else []]
            n = len(row.generated)
            if tok in self._eos and not req.ignore_eos and n > req.min_new_tokens:
                step.finish_reason = FinishReason.EOS
            elif tok in req.stop_token_ids and n > req.min_new_tokens:
                step.finish_reason = FinishReason.STOP_SEQUENCE
                step.stop_token_id = tok
            elif n >= req.max_new_tokens or len(req.prompt_ids) + n >= self.info.max_context_length:
                step.finish_reason = FinishReason.LENGTH
            if step.finish_reason is not None:
                row.finished = True
                row.owner.unfinished -= 1
            by_owner.setdefault(id(row.owner), (row.owner, []))[1].append(step)
        for owner, steps in by_owner.values():
            emits.append(
                (owner, EngineOutput(owner.req.request_id, sequences=steps, finished=owner.unfinished == 0, time=now))
            )

    # ---------------------------------------------------------------- batch bookkeeping

    def _release(self, rows: list[_Row], keep_blocks: bool = True) -> None:
        """Free the slots of finished or cancelled rows (no KV data moves); first, with
        `keep_blocks` (not after a failed step), their sequences' new full blocks go to the
        prefix cache (`_store_sequence`)."""
        for row in rows:
            if self._slots[row.slot] is row and self._cache is not None:
                if keep_blocks:
                    self._store_sequence(row)
                self._slots[row.slot] = None
                self._cache.release(row.slot)
                self._pos[row.slot] = 0
                self._next[row.slot] = self._pad
        self._live_slots = [s for s in self._live_slots if self._slots[s] is not None]
        self._recompose()

    def _recompose(self) -> None:
        """Rebuild per-row tensors after sequences joined or left the batch."""
        self._live_slots = live = sorted(self._live_slots)
        self._rows_live = [row for s in live if (row := self._slots[s]) is not None]
        self._extent = max(live) + 1 if live else 0
        if not live:
            self._params = self._sample_idx = self._sample_params = self._bias = None
            self._history = None
            if self._cache is not None:
                self._cache.length = 0
                self._cache.mask.zero_()
            return
        self._live_idx = torch.tensor(live, device=self._device)
        self._params = BatchParams.from_rows([row.params for row in self._rows_live], self._device)
        if self._params.any_sample:
            self._sample_idx, self._sample_params = _sampling_subset(self._rows_live, self._params)
        else:
            self._sample_idx = self._sample_params = None
        if not self._params.any_penalty:
            self._history = None
        else:
            if self._history is None:
                shape = (self._max_batch, self._logit_dim)
                self._history = (
                    torch.zeros(shape, dtype=torch.bool, device=self._device),
                    torch.zeros(shape, dtype=torch.float32, device=self._device),
                )
                self._penalty_synced = set()
            for row in self._rows_live:
                if id(row) not in self._penalty_synced:
                    seen, counts = self._penalty_rows([row])
                    self._history[0][row.slot], self._history[1][row.slot] = seen[0], counts[0]
            self._penalty_synced = {id(row) for row in self._rows_live}
        self._bias = self._bias_for(self._rows_live)

    def _penalty_rows(self, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, V] seen (prompt + output) and output counts, built from the rows' histories."""
        seen = torch.zeros((len(rows), self._logit_dim), dtype=torch.bool, device=self._device)
        counts = torch.zeros((len(rows), self._logit_dim), dtype=torch.float32, device=self._device)
        for i, row in enumerate(rows):
            seen[i, row.history] = True
            if row.generated:
                gen = torch.tensor(row.generated, device=self._device)
                counts[i].index_add_(0, gen, torch.ones(len(row.generated), device=self._device))
        return seen, counts

    def _bias_for(self, rows: list[_Row]) -> torch.Tensor | None:
        if not any(row.owner.req.logit_bias for row in rows):
            return None
        bias = torch.zeros((len(rows), self._logit_dim), dtype=torch.float32, device=self._device)
        for i, row in enumerate(rows):
            for tok, b in row.owner.req.logit_bias.items():
                bias[i, tok] = b
        return bias


def _root(r: _Req) -> int:
    """The prefix-cache root of a request's blocks: keys and values computed with an adapter
    differ from the base model's and from every other adapter's."""
    return 0 if r.lora is None else r.lora.root


def _read_blocks(cache: SlotKVCache, slot: int, col: int, bs: int, first: int, count: int) -> list[torch.Tensor]:
    """Blocks first .. first + count - 1 of the prompt in `slot` from column `col` on."""
    return cache.read_blocks(slot, col + first * bs, count, bs)


def _sampling_subset(rows: list[_Row], params: BatchParams) -> tuple[torch.Tensor, BatchParams]:
    idx = params.do_sample.nonzero().squeeze(1)
    sub = BatchParams.from_rows([rows[i].params for i in idx.tolist()], params.do_sample.device)
    return idx, sub


def _cancelled(r: _Req) -> EngineOutput:
    steps = [SequenceStep(row.index, [], finish_reason=FinishReason.CANCELLED) for row in r.rows if not row.finished]
    return EngineOutput(r.req.request_id, sequences=steps, finished=True, time=time.monotonic())


def _deliver(emits: Emits) -> None:
    for r, out in emits:
        if r.outputs is not None:
            r.outputs.put(out)
