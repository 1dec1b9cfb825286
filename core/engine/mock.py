"""Mock engine: in-flight batching with a model that costs nothing (`--engine mock`).

For load tests, overhead measurements and multi-core tests without a model, the idea of NVIDIA
Dynamo's "mocker" (docs.nvidia.com/dynamo, "Live Simulation with Mocker"), reduced to what the
core's overhead depends on: a running batch stepped at a fixed cadence, a bounded waiting queue,
and admission at step boundaries. It needs only a tokenizer.

Scheduling: one timer on the event loop drives the batch, with no task or thread per request.
At each step boundary it applies aborts, emits the step's token of every running sequence
(with PREFILLED and the first token for requests admitted at the previous boundary), and admits
waiting requests in the queue's order (core.scheduling: arrival, or priority, and tenant fair
shares) while their sequences fit `max_batch_size` (SCHEDULED). A step lasts
`step_ms`, plus `prefill_ms_per_token` for every prompt token admitted at its start. Boundaries
keep a fixed cadence while the event loop keeps up; once the loop falls a whole step behind,
the cadence restarts from the late boundary, so an overloaded host shows up as longer steps
(the `steps` counter and the clients' time per output token tell the achieved rate).

Tokens: every sequence draws from its own `random.Random`, keyed by the prompt (greedy, so
equal prompts give equal outputs, as a deterministic model would) or by the prompt, the seed
and the sequence index (sampling), so a seeded request reproduces whatever else is in the
batch. Draws are uniform over the vocabulary's non-special tokens that are whole UTF-8 text on
their own, so every token streams as one text delta. At each token, EOS is drawn with
probability `eos_probability` (a request stops on it unless ignore_eos is set or fewer than
min_new_tokens were generated); stop token ids end a sequence when drawn (never below
min_new_tokens), and max_new_tokens and the context length bound it. The draws of a sequence
do not depend on its stopping options, so the same seed gives the same prefix with or without
them.

Logprobs are synthetic but well-formed, from a second generator per sequence: each step has a
geometric distribution over ranks, P(rank i) = a (1 - a)^i with a in [0.4, 0.95) drawn per step;
the chosen token is rank 0 when greedy and a rank drawn from that distribution when sampling;
top_logprobs lists ranks 0..k-1 (the chosen token at its rank, distinct other tokens
elsewhere), so values are <= 0, sorted descending, and the chosen logprob equals its entry.
Prompt logprobs are built the same way from the prompt.

Scripted replies (`--mock-script FILE`, for tests of what gateways read out of a model's text:
reasoning tags, tool calls): FILE is a JSON list of `{"when": str, "reply": str}`. A request
whose prompt, decoded, contains a `when` (the first that matches) generates the tokens of its
`reply` (the tokenizer's split, so a tag like `<think>` may come in several tokens), then EOS
unless ignore_eos (then draws go on as usual); max_new_tokens still cuts it, stop token ids do
not. Other requests draw as usual.

LoRA adapters (`--max-loras`, default 4; core.lora): registered by their adapter_config.json
alone (no weights are read), and a request with an adapter draws from generators keyed by the
adapter's name as well, so each adapter gives its own deterministic output for a prompt.
Residency is the HF engine's (core.lora.AdapterSlots, shared with core.engine.hf_lora):
`max_loras` slots; a request's adapter takes its slot at admission (its own, a free one, or
the least recently used one no running request uses); when every slot holds another adapter
with running requests, the request keeps its place in the queue while those behind it are
admitted (core.scheduling.WaitingQueue.set_aside), and runs once a slot frees. An unregistered
adapter's slot frees once no running request uses it; requests queued with it still run.

Preemption and a full queue (core.scheduling; `--no-preemption` turns the first off): at a step
boundary where the request to admit next does not fit the full batch, up to
MAX_PREEMPTIONS_PER_STEP running requests of a lower priority, or of a tenant over its share of
the batch, go back to the waiting queue at their place, keeping their sequences, drawn tokens and
generators, and continue where they stopped once admitted again (their re-prefill, prompt and
generated tokens, costs `prefill_ms_per_token` as any prompt; their tenant is charged once, at
the first admission). A request arriving at a full queue displaces the newest waiting request of
the tenant most over its share of the queue when its own tenant is under its share: the displaced
one ends with the queue-full error.

Sampling parameters other than do_sample and seed (temperature, top_k, top_p, penalties,
logit_bias, bad_words) are validated and reported as usual but do not shape the draws. Guided
decoding is not honoured: EngineInfo.guided_decoding is empty, so the core refuses a guided
request (INVALID_ARGUMENT) rather than return draws that ignore the guide.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import math
import random
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from core.engine.base import EngineLifecycle, OutputStream
from core.errors import EngineFailure, InvalidArgument, NotReady, Overloaded
from core.lora import MAX_LORAS, AdapterSlots, AdapterSpec, AdapterStatus, adapter_exists, unknown_adapter
from core.sampling import resolve_generic
from core.scheduling import MAX_PREEMPTIONS_PER_STEP, Running, WaitingQueue, admission_cost
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
    from core.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_CONTEXT_LENGTH = 4096
MAX_TOP_LOGPROBS = 20
# Cap on the rank of a sampled token in the synthetic distribution (P(rank >= 64) < 0.6^64).
_MAX_RANK = 64
_LOGPROB_SALT = 0x5EED_10C9_2B0B
# Tokens drawn ahead per sequence at a time: the draws of a step are a list look-up, and a
# request cancelled early wastes few.
_DRAW_AHEAD = 64


def build(config: CoreConfig, tokenizer: Tokenizer) -> MockEngine:
    """Engine factory for `--engine mock` (see core.engine.registry).

    Raises:
        ValueError: a mock flag out of range, or a tokenizer without ordinary tokens.
    """
    return MockEngine(
        tokenizer,
        step_ms=config.mock_step_ms,
        prefill_ms_per_token=config.mock_prefill_ms_per_token,
        eos_probability=config.mock_eos_probability,
        max_context_length=config.mock_context_length or context_length_of(config.model),
        max_batch_size=config.max_batch_size,
        max_queue_size=config.max_queue_size,
        max_n=config.max_n,
        script=load_script(config.mock_script) if config.mock_script else (),
        scheduling_policy=config.scheduling_policy,
        tenant_weights=dict(config.tenant_weight),
        max_loras=config.max_loras,
        preemption=config.preemption,
    )


def load_script(path: str | Path) -> list[tuple[str, str]]:
    """The `(when, reply)` pairs of a `--mock-script` file (the module docstring).

    Raises:
        ValueError: the file cannot be read or is not a list of `{"when": str, "reply": str}`.
    """
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the mock script {path}: {e}") from None
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and set(e) == {"when", "reply"} and all(isinstance(v, str) for v in e.values())
        for e in entries
    ):
        raise ValueError(f'the mock script {path} must be a JSON list of {{"when": str, "reply": str}}')
    return [(e["when"], e["reply"]) for e in entries]


def context_length_of(model_dir: str | Path) -> int:
    """The context length named by `model_dir/config.json` (max_position_embeddings,
    n_positions or max_seq_len), else DEFAULT_CONTEXT_LENGTH (e.g. a tokenizer-only directory)."""
    path = Path(model_dir) / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError):
            cfg = {}
        for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
            value = cfg.get(key) if isinstance(cfg, dict) else None
            if isinstance(value, int) and value > 1:
                return value
    return DEFAULT_CONTEXT_LENGTH


@dataclass(eq=False, slots=True)
class _Row:
    """One sequence of a running request.

    `tokens` holds its draws, emitted ones and the next ones drawn ahead (`_draw`), and ends at
    the sequence's last token once that is known (`end` > 0 then, with its finish).
    """

    index: int
    rng: random.Random
    lp_rng: random.Random | None
    tokens: list[int] = field(default_factory=list)
    generated: int = 0
    end: int = 0
    reason: FinishReason | None = None
    stop_token_id: int | None = None
    finished: bool = False


@dataclass(eq=False, slots=True)
class _Req:
    """A live request: waiting in the queue, then in the running batch."""

    req: EngineRequest
    outputs: OutputStream
    sampled: bool
    stops_on_eos: bool
    limit: int = 0
    rows: list[_Row] = field(default_factory=list)
    unfinished: int = 0
    prefilled: bool = False
    cancelled: bool = False
    scripted: list[int] | None = None
    seq: int = 0  # arrival number in the waiting queue (a preempted request keeps it)
    lora: AdapterSpec | None = None  # its adapter (resolved when it is queued)
    lora_slot: int = -1  # the adapter slot it runs in (-1: none)


class MockEngine(EngineLifecycle):
    """In-flight batching engine whose model step only waits (see the module docstring).

    Args:
        tokenizer: the served tokenizer (vocabulary, special tokens, EOS ids).
        step_ms: duration of one decode step in milliseconds (0: steps run back to back).
        prefill_ms_per_token: extra step time per prompt token admitted at the step's start.
        eos_probability: per-token probability of drawing EOS, in [0, 1].
        max_context_length: tokens of one sequence, prompt and generated together.
        max_batch_size: sequences in the running batch.
        max_queue_size: waiting requests; one more raises Overloaded (RESOURCE_EXHAUSTED).
        max_n: sequences per request.
        script: scripted replies, `(when, reply)` pairs (the module docstring).
        scheduling_policy: order of waiting requests, "fcfs" or "priority" (core.scheduling).
        tenant_weights: tenant -> share weight (`--tenant-weight`; others weigh 1).
        max_loras: adapter slots (0: no LoRA adapters); any number may be registered, this
            many run at once (the module docstring).
        preemption: whether running requests are preempted for waiting ones that the queue
            would serve first (the module docstring).

    Attributes:
        steps: engine steps completed since start (steps that had requests in the batch).
        step_cpu_s: CPU seconds the event loop's thread spent in step boundaries since start
            (drawing tokens and handing every output to its stream): the engine's own cost.

    Raises:
        ValueError: an argument out of range, or no ordinary token in the vocabulary.
    """

    kind = "mock"

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        step_ms: float = 10.0,
        prefill_ms_per_token: float = 0.0,
        eos_probability: float = 0.0,
        max_context_length: int = DEFAULT_CONTEXT_LENGTH,
        max_batch_size: int = 32,
        max_queue_size: int = 256,
        max_n: int = 16,
        script: list[tuple[str, str]] | tuple[()] = (),
        scheduling_policy: str = "fcfs",
        tenant_weights: dict[str, float] | None = None,
        max_loras: int = MAX_LORAS,
        preemption: bool = True,
    ) -> None:
        super().__init__()
        if not (math.isfinite(step_ms) and step_ms >= 0):
            raise ValueError(f"mock step time must be >= 0 ms, got {step_ms}")
        if not (math.isfinite(prefill_ms_per_token) and prefill_ms_per_token >= 0):
            raise ValueError(f"mock prefill time per token must be >= 0 ms, got {prefill_ms_per_token}")
        if not 0.0 <= eos_probability <= 1.0:
            raise ValueError(f"mock EOS probability must be in [0, 1], got {eos_probability}")
        if max_context_length < 2:
            raise ValueError(f"mock context length must be at least 2 tokens, got {max_context_length}")
        if max_batch_size < 1 or max_queue_size < 0:
            raise ValueError("max batch size must be >= 1 and max queue size >= 0")
        self._vocab = _ordinary_tokens(tokenizer)
        if not self._vocab:
            raise ValueError("the tokenizer has no ordinary (non-special, whole UTF-8) token to generate")
        self._nvocab = len(self._vocab)
        eos = sorted(tokenizer.eos_token_ids)
        primary = getattr(tokenizer.hf, "eos_token_id", None)
        self._eos_id: int | None = primary if isinstance(primary, int) and primary in eos else (eos[0] if eos else None)
        self._step_s = step_ms / 1000.0
        self._prefill_s = prefill_ms_per_token / 1000.0
        self._eos_p = eos_probability if self._eos_id is not None else 0.0
        self._tokenizer = tokenizer
        self._script = list(script)
        self._ctx = max_context_length
        self._max_batch = max_batch_size
        self._max_queue = max_queue_size
        self.info = EngineInfo(
            engine=self.kind,
            max_context_length=max_context_length,
            vocab_size=tokenizer.vocab_size,
            max_num_beams=1,
            max_n=min(max_n, max_batch_size),
            max_top_logprobs=min(MAX_TOP_LOGPROBS, self._nvocab - 1),
            preemption=preemption,
        )
        self.steps = 0
        self.step_cpu_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.Handle | None = None
        self._deadline = 0.0
        self._requests: dict[str, _Req] = {}
        self._pending: WaitingQueue[_Req] = WaitingQueue(scheduling_policy, tenant_weights)
        self._running: list[_Req] = []
        self._running_rows = 0
        self._aborts: set[str] = set()
        self.max_loras = max_loras
        self._adapters: dict[str, AdapterSpec] = {}
        self._slots: AdapterSlots[AdapterSpec] = AdapterSlots(max(1, max_loras))
        self._forgotten: list[AdapterSpec] = []  # unregistered, their slots to free once idle

    # ---------------------------------------------------------------- adapters

    def has_adapter(self, name: str) -> bool:
        """Whether the adapter `name` is registered."""
        return name in self._adapters

    def adapters(self) -> list[AdapterStatus]:
        """Every registered adapter with its residency and running and waiting requests."""
        running = collections.Counter(r.lora.name for r in self._running if r.lora is not None)
        waiting = collections.Counter(r.lora.name for r in self._pending if r.lora is not None)
        held = {id(spec) for spec in self._slots.held()}
        return [
            AdapterStatus(spec, id(spec) in held, running[name], waiting[name])
            for name, spec in sorted(self._adapters.items())
        ]

    async def load_adapter(self, spec: AdapterSpec) -> None:
        """Register an adapter (its config was checked by core.lora.read_spec; no weights).

        Raises:
            AdapterExists: the name is registered already.
        """
        if spec.name in self._adapters:
            raise adapter_exists(spec.name)
        self._adapters[spec.name] = spec

    async def unload_adapter(self, name: str) -> None:
        """Unregister an adapter (running requests finish with it).

        Raises:
            AdapterNotFound: `name` is not registered.
        """
        spec = self._adapters.pop(name, None)
        if spec is None:
            raise unknown_adapter(name)
        self._forgotten.append(spec)
        self._free_forgotten(self._busy_slots())

    def _busy_slots(self) -> set[int]:
        """The adapter slots running requests use."""
        return {r.lora_slot for r in self._running if r.lora_slot >= 0}

    def _free_forgotten(self, busy: set[int]) -> None:
        """Free the slots of unregistered adapters that no running request uses."""
        for spec in self._forgotten:
            self._slots.forget(spec, busy)
        self._forgotten = [spec for spec in self._forgotten if self._slots.slot_of(spec) is not None]

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start serving on the running event loop (nothing to load)."""
        self._loop = asyncio.get_running_loop()
        self._started = self._alive = True
        log.info(
            "mock engine: step %.3g ms, prefill %.3g ms/token, EOS probability %g, context %d, %d ordinary tokens",
            self._step_s * 1000,
            self._prefill_s * 1000,
            self._eos_p,
            self._ctx,
            self._nvocab,
        )

    async def shutdown(self) -> None:
        """Stop stepping; requests still queued or running end with NotReady."""
        self._stopping = True
        self._alive = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        error = NotReady("The engine shut down; retry on another replica.")
        now = time.monotonic()
        for r in self._requests.values():
            r.outputs.put(EngineOutput(r.req.request_id, error=error, finished=True, time=now))
        self._requests.clear()
        self._pending.clear()
        self._running = []
        self._running_rows = 0
        self._aborts.clear()

    def resolve_sampling(self, opts: SamplingOptions, *, random_seed: int) -> ResolvedSampling:
        """The generic (LMI "every rolling batch backend") defaults, as the HF engine."""
        return resolve_generic(opts, random_seed=random_seed)

    def stats(self) -> EngineStats:
        """Requests in the running batch and in the queue."""
        return EngineStats(active=len(self._running), queued=len(self._pending))

    # ---------------------------------------------------------------- requests

    def generate(self, request: EngineRequest) -> OutputStream:
        """Queue a request and stream its outputs; see core.engine.base.Engine for the contract.

        Raises:
            NotReady / EngineDead: the engine is not serving.
            InvalidArgument: more sequences than the batch holds, or a duplicate request id.
            Overloaded: max_queue_size requests are already waiting and the request's tenant
                holds its share of them (else the newest waiting request of the tenant most over
                its share ends with this error instead: core.scheduling.WaitingQueue.make_room).
        """
        self._check_serving()
        seqs = request.num_sequences
        if seqs > self._max_batch:
            raise InvalidArgument(
                f"The request asks for {seqs} sequences, more than the batch holds ({self._max_batch}).",
                field="sampling.n",
            )
        if request.request_id in self._requests:
            raise InvalidArgument(f"A request with id '{request.request_id}' is already running.", field="request_id")
        lora = self._adapters.get(request.adapter) if request.adapter else None
        if request.adapter and lora is None:
            raise unknown_adapter(request.adapter)
        if len(self._pending) >= self._max_queue:
            self._make_room(request.tenant)
        request_id = request.request_id

        def on_close(finished: bool) -> None:
            if not finished:
                self.abort(request_id)

        queued = EngineOutput(request_id, state=RequestState.QUEUED, time=time.monotonic())
        r = _Req(
            request,
            OutputStream(queued, on_close),
            sampled=request.sampling.do_sample,
            stops_on_eos=not request.ignore_eos and self._eos_p > 0.0,
            lora=lora,
        )
        if self._script:
            r.scripted = self._scripted(request)
        self._requests[request_id] = r
        r.seq = self._pending.push(r, cost=admission_cost(request), priority=request.priority, tenant=request.tenant)
        if self._timer is None and self._loop is not None:  # idle: the next step starts now
            self._deadline = self._loop.time()
            self._timer = self._loop.call_soon(self._boundary)
        return r.outputs

    def _scripted(self, request: EngineRequest) -> list[int] | None:
        """The tokens of the scripted reply to `request`, or None."""
        prompt = self._tokenizer.decode(request.prompt_ids)
        for when, reply in self._script:
            if when in prompt:
                tokens = self._tokenizer.encode(reply, add_special_tokens=False)
                if not request.ignore_eos and self._eos_id is not None:
                    tokens.append(self._eos_id)
                return tokens
        return None

    def abort(self, request_id: str) -> None:
        """Cancel a request at the next step boundary (no-op when unknown or finished)."""
        if request_id in self._requests:
            self._aborts.add(request_id)

    # ---------------------------------------------------------------- stepping

    def _boundary(self) -> None:
        """End the current step and start the next one (runs on the event loop's timer)."""
        self._timer = None
        loop = self._loop
        if self._stopping or loop is None:
            return
        cpu0 = time.thread_time()
        now = time.monotonic()
        admitted_tokens = 0
        try:
            if self._aborts:
                self._apply_aborts(now)
            if self._running:
                self.steps += 1
                self._emit_step(now)
            if self._pending:
                admitted_tokens = self._admit(now)
        except Exception as e:  # a failed step fails the requests in it, not the engine
            log.exception("mock engine step failed")
            self._fail_running(e, now)
        self.step_cpu_s += time.thread_time() - cpu0
        if not (self._running or self._pending):
            return  # idle: generate() wakes the engine
        duration = self._step_s + self._prefill_s * admitted_tokens
        now_l = loop.time()
        nxt = self._deadline + duration
        if nxt < now_l:  # more than a step behind: this step stretched, restart the cadence
            nxt = now_l + duration
        self._deadline = nxt
        self._timer = loop.call_at(nxt, self._boundary)

    def _apply_aborts(self, now: float) -> None:
        aborted = [self._requests.pop(rid) for rid in self._aborts if rid in self._requests]
        self._aborts.clear()
        for r in aborted:
            r.cancelled = True
            r.outputs.put(_cancelled(r, now))
        for r in self._pending.remove_if(lambda r: r.cancelled):
            if r.rows:  # waiting after a preemption: charged at its first admission
                self._settle(r)
        kept = [r for r in self._running if not r.cancelled]
        if len(kept) != len(self._running):
            for r in self._running:
                if r.cancelled:
                    self._settle(r)
            self._running = kept
            self._running_rows = sum(len(r.rows) for r in kept)

    def _emit_step(self, now: float) -> None:
        """One token for every unfinished sequence in the batch; finished requests leave it.

        Per sequence this is a look-up in its drawn-ahead tokens (`_draw` refills them every
        _DRAW_AHEAD tokens) and the SequenceStep and EngineOutput the engine contract asks for."""
        done = False
        next_token = self._next_token
        for r in self._running:
            rows = r.rows
            if len(rows) == 1:
                steps = [next_token(r, rows[0])]
            else:
                steps = [next_token(r, row) for row in rows if not row.finished]
            out = EngineOutput(r.req.request_id, None, steps, None, r.unfinished == 0, 0, None, now)
            if not r.prefilled:
                r.prefilled = True
                out.state = RequestState.PREFILLED
                if r.req.prompt_logprobs is not None:
                    out.prompt_logprobs = self._prompt_logprobs(r.req)
            r.outputs.put(out)
            if out.finished:
                done = True
                del self._requests[r.req.request_id]
                self._settle(r)
        if done:
            self._running = [r for r in self._running if r.unfinished]
            self._running_rows = sum(len(r.rows) for r in self._running)

    def _settle(self, r: _Req) -> None:
        """Correct the tenant's charge for a request that left the batch to what it served."""
        served = len(r.req.prompt_ids) + sum(row.generated for row in r.rows)
        self._pending.settle(r.req.tenant, admission_cost(r.req), served)

    def _admit(self, now: float) -> int:
        """Move waiting requests into the batch, in the queue's order, while their sequences
        fit (the first that does not waits at the head, so a large request is never starved);
        a request whose adapter gets no slot keeps its place while those behind it are
        admitted (core.engine.hf `_take_admissible` does the same). Preempts for a head that
        does not fit where core.scheduling's rule allows; a preempted request gives up its
        adapter slot and takes one again when it is admitted again. Returns the prompt tokens
        admitted (a resumed request's prompt and generated tokens)."""
        tokens = 0
        pending = self._pending
        preemptions = 0
        busy = self._busy_slots()
        if self._forgotten:
            self._free_forgotten(busy)
        while (head := pending.peek()) is not None:
            if self._running_rows + head.req.num_sequences > self._max_batch:
                if not self.info.preemption or preemptions == MAX_PREEMPTIONS_PER_STEP:
                    break
                done = self._preempt_for(head, MAX_PREEMPTIONS_PER_STEP - preemptions, now)
                if not done:
                    break
                preemptions += done
                busy = self._busy_slots()
                continue
            if head.lora is not None:
                slot = self._slots.assign(head.lora, busy)
                if slot is None:
                    pending.set_aside()
                    continue
                head.lora_slot = slot
                busy.add(slot)
            r = pending.pop()
            if r.rows:  # resumed after a preemption
                self._running.append(r)
                self._running_rows += len(r.rows)
                tokens += len(r.req.prompt_ids) + sum(row.generated for row in r.rows)
                continue
            r.rows = _rows(r.req, with_logprobs=r.req.logprobs)
            r.limit = max(1, min(r.req.max_new_tokens, self._ctx - len(r.req.prompt_ids)))
            r.unfinished = len(r.rows)
            self._running.append(r)
            self._running_rows += len(r.rows)
            tokens += len(r.req.prompt_ids)
            r.outputs.put(EngineOutput(r.req.request_id, state=RequestState.SCHEDULED, time=now))
        pending.restore()
        return tokens

    # ---------------------------------------------------------------- preemption, full queue

    def _preempt_for(self, head: _Req, limit: int, now: float) -> int:
        """Preempt up to `limit` running requests so that `head` fits (core.scheduling's rule;
        requests admitted at this boundary, not yet prefilled, are left alone). Returns how
        many were preempted (0: none, the rule frees too little)."""
        running = [Running(r.req.priority, r.req.tenant, len(r.rows), r.seq, r.prefilled) for r in self._running]
        victims = self._pending.preemption_victims(
            running,
            head_rows=head.req.num_sequences,
            free_rows=self._max_batch - self._running_rows,
            batch_rows=self._max_batch,
            limit=limit,
        )
        if not victims:
            return 0
        doomed = {id(self._running[i]) for i in victims}
        for i in victims:
            r = self._running[i]
            # charged at its first admission already: no cost when it is admitted again
            self._pending.push(r, cost=0, priority=r.req.priority, tenant=r.req.tenant, seq=r.seq)
            r.outputs.put(EngineOutput(r.req.request_id, time=now, preempted=True))
        self._running = [r for r in self._running if id(r) not in doomed]
        self._running_rows = sum(len(r.rows) for r in self._running)
        return len(victims)

    def _make_room(self, tenant: str) -> None:
        """The queue is full: displace a waiting request for an arrival of `tenant`, or refuse it.

        Raises:
            Overloaded: the arrival's tenant holds its share of the queue already.
        """
        displaced = self._pending.make_room(tenant)
        if displaced is None:
            raise Overloaded(f"The server is at capacity ({self._max_queue} requests waiting); retry later.")
        del self._requests[displaced.req.request_id]
        error = Overloaded(
            f"The server is at capacity ({self._max_queue} requests waiting) and this request gave its place to "
            "one of a tenant under its share of the queue; retry later."
        )
        displaced.outputs.put(EngineOutput(displaced.req.request_id, error=error, finished=True, time=time.monotonic()))

    def _fail_running(self, error: Exception, now: float) -> None:
        failure = EngineFailure(f"Generation failed: {error}")
        for r in self._running:
            self._requests.pop(r.req.request_id, None)
            r.outputs.put(EngineOutput(r.req.request_id, error=failure, finished=True, time=now))
        self._running = []
        self._running_rows = 0

    # ---------------------------------------------------------------- tokens

    def _next_token(self, r: _Req, row: _Row) -> SequenceStep:
        """The next token of `row` as a SequenceStep (with its finish on the last one)."""
        n = row.generated
        if n == len(row.tokens):
            self._draw(r, row)
        token = row.tokens[n]
        n += 1
        row.generated = n
        if n != row.end:
            step = SequenceStep(row.index, [token])
        else:
            step = SequenceStep(row.index, [token], None, None, row.reason, row.stop_token_id)
            row.finished = True
            r.unfinished -= 1
        if row.lp_rng is not None:
            lp, top = self._synthetic_logprob(row.lp_rng, token, r.req.top_logprobs, sampled=r.sampled)
            step.logprobs = [lp]
            step.top_logprobs = [top]
        return step

    def _draw(self, r: _Req, row: _Row) -> None:
        """Draw the next _DRAW_AHEAD tokens of `row` (fewer when its length bound comes first),
        and find where the sequence ends among them.

        Each token takes two draws from the row's generator, in this order: EOS (when
        eos_probability > 0, whatever the request's stopping options, so that they never shift
        the stream) and the token, uniform over the ordinary tokens. A stop token drawn below
        min_new_tokens is drawn again (as a model bans it there), which takes further draws.
        The sequence ends on the first EOS draw that counts (stops_on_eos, above
        min_new_tokens: the token becomes EOS), else the first stop token above
        min_new_tokens, else at its length bound (max_new_tokens or the context length)."""
        req = r.req
        rand = row.rng.random
        vocab, nvocab, eos_p = self._vocab, self._nvocab, self._eos_p
        stop_ids, min_new = req.stop_token_ids, req.min_new_tokens
        base = len(row.tokens)
        k = min(_DRAW_AHEAD, r.limit - base)
        if r.scripted is not None and base < len(r.scripted):
            row.tokens += r.scripted[base : base + k]
            if len(row.tokens) == len(r.scripted) and r.scripted[-1] == self._eos_id and not r.req.ignore_eos:
                row.reason = FinishReason.EOS
            elif len(row.tokens) == r.limit:
                row.reason = FinishReason.LENGTH
            if row.reason is not None:
                row.end = len(row.tokens)
            return
        eos_at: int | None = None  # offset in this draw of the first EOS that counts
        if stop_ids and base < min_new:  # redraws possible: one token at a time
            tokens = []
            for j in range(k):
                eos_drawn = eos_p > 0.0 and rand() < eos_p
                token = vocab[int(rand() * nvocab)]
                below_min = base + j + 1 <= min_new
                if below_min and token in stop_ids:
                    token = _redraw(rand, vocab, stop_ids)
                tokens.append(token)
                if eos_drawn and r.stops_on_eos and not below_min:
                    eos_at = j
                    break
        elif eos_p > 0.0:
            draws = [rand() for _ in range(2 * k)]
            tokens = [vocab[int(u * nvocab)] for u in draws[1::2]]
            if r.stops_on_eos:
                first = max(0, min_new - base)  # offsets whose token is above min_new_tokens
                eos_at = next((j for j in range(first, k) if draws[2 * j] < eos_p), None)
        else:
            tokens = [vocab[int(rand() * nvocab)] for _ in range(k)]
        stop_at: int | None = None
        if stop_ids:
            first = max(0, min_new - base)
            stop_at = next((j for j in range(first, len(tokens)) if tokens[j] in stop_ids), None)
        if eos_at is not None and (stop_at is None or eos_at <= stop_at) and self._eos_id is not None:
            tokens[eos_at:] = [self._eos_id]
            row.reason = FinishReason.EOS
        elif stop_at is not None:
            del tokens[stop_at + 1 :]
            row.reason = FinishReason.STOP_SEQUENCE
            row.stop_token_id = tokens[stop_at]
        elif base + k == r.limit:
            row.reason = FinishReason.LENGTH
        row.tokens += tokens
        if row.reason is not None:
            row.end = len(row.tokens)

    def _synthetic_logprob(
        self, rng: random.Random, token: int, k: int, *, sampled: bool
    ) -> tuple[float, list[tuple[int, float]]]:
        """The logprob of `token` and the top `k` alternatives of one synthetic step."""
        a = 0.4 + 0.55 * rng.random()
        log_a, log_rest = math.log(a), math.log1p(-a)
        rank = 0
        if sampled:
            while rank < _MAX_RANK and rng.random() >= a:
                rank += 1
        chosen = log_a + rank * log_rest
        top: list[tuple[int, float]] = []
        used = {token}
        vocab, nvocab = self._vocab, self._nvocab
        for i in range(k):
            if i == rank:
                top.append((token, chosen))
                continue
            alt = vocab[int(rng.random() * nvocab)]
            while alt in used:  # k < nvocab (EngineInfo.max_top_logprobs), so this ends
                alt = vocab[int(rng.random() * nvocab)]
            used.add(alt)
            top.append((alt, log_a + i * log_rest))
        return chosen, top

    def _prompt_logprobs(self, req: EngineRequest) -> list[PromptTokenInfo]:
        """Synthetic logprobs of every prompt token after the first (which has none)."""
        rng = random.Random(_key(_prompt_digest(req.prompt_ids), b"prompt"))
        k = req.prompt_logprobs or 0
        out = [PromptTokenInfo(req.prompt_ids[0], None, [])]
        for token in req.prompt_ids[1:]:
            lp, top = self._synthetic_logprob(rng, token, k, sampled=True)
            out.append(PromptTokenInfo(token, lp, top))
        return out


def _rows(req: EngineRequest, *, with_logprobs: bool) -> list[_Row]:
    """The sequences of a request, each with its generators (see the module docstring)."""
    digest = _prompt_digest(req.prompt_ids)
    if req.adapter:  # each adapter its own draws
        digest = hashlib.blake2b(digest + req.adapter.encode(), digest_size=16).digest()
    rows = []
    for k in range(req.num_sequences):
        if req.sampling.do_sample:
            key = _key(digest, ((req.sampling.seed + k) & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little"))
        else:
            key = _key(digest, b"greedy")
        lp_rng = random.Random(key ^ _LOGPROB_SALT) if with_logprobs else None
        rows.append(_Row(k, random.Random(key), lp_rng))
    return rows


def _prompt_digest(prompt_ids: list[int]) -> bytes:
    return hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=16).digest()


def _key(digest: bytes, salt: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(digest + salt, digest_size=16).digest(), "little")


def _redraw(rand: Callable[[], float], vocab: list[int], banned: frozenset[int]) -> int:
    """A token outside `banned` (a few draws, then the first allowed one in vocabulary order)."""
    for _ in range(32):
        token = vocab[int(rand() * len(vocab))]
        if token not in banned:
            return token
    return next((t for t in vocab if t not in banned), vocab[0])


def _ordinary_tokens(tokenizer: Tokenizer) -> list[int]:
    """Ids of the non-special tokens whose bytes are non-empty, complete UTF-8 text."""
    tokens = []
    for i in range(tokenizer.vocab_size):
        if tokenizer.is_special(i):
            continue
        raw = tokenizer.token_bytes(i)
        if not raw:
            continue
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        tokens.append(i)
    return tokens


def _cancelled(r: _Req, now: float) -> EngineOutput:
    """The final output of an aborted request: CANCELLED for every unfinished sequence."""
    live = [row.index for row in r.rows if not row.finished] if r.rows else range(r.req.num_sequences)
    steps = [SequenceStep(i, [], finish_reason=FinishReason.CANCELLED) for i in live]
    return EngineOutput(r.req.request_id, sequences=steps, finished=True, time=now)
