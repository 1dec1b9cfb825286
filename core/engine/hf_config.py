"""What the HF engine derives from its configuration without loading the model: its EngineInfo,
the torch thread count, the CPUs of the engine process, and the admission checks of a request.

Shared by the engine (core.engine.hf) and its proxy in the core process when the engine runs in
a process of its own (core.engine.hf_process), so both refuse exactly the same requests.
"""

from __future__ import annotations

import os
from pathlib import Path

from core.errors import InvalidArgument, Overloaded
from core.types import EngineInfo, EngineRequest

KIND = "hf"


def engine_info(
    model_path: str | Path,
    *,
    vocab_size: int,
    max_n: int,
    max_batch_size: int,
    guided_decoding: frozenset[str] = frozenset(),
) -> EngineInfo:
    """The engine's limits: context length from the checkpoint's config.json
    (max_position_embeddings, else n_positions, else 2048); n up to the batch size; the guide
    kinds it honours (core.engine.hf_guided.supports)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_path))
    context = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048
    return EngineInfo(
        engine=KIND,
        max_context_length=int(context),
        vocab_size=int(vocab_size),
        max_num_beams=1,
        max_n=min(max_n, max_batch_size),
        guided_decoding=guided_decoding,
    )


def default_threads(threads: int) -> int:
    """torch intra-op threads for `--threads` (0: one per core this process may run on, less one
    left to the serving threads: the event loop, gRPC and the pipeline; at least 1).

    Why one fewer: torch's OpenMP team waits at a barrier after every parallel kernel for all of
    its threads, so a team as wide as the machine stalls whenever the serving side (or anything
    else) holds one of the cores; on 2 cores that cut decode throughput several-fold under load
    (scripts/bench: the core and the in-process static batch both fell to a fraction of their
    speed with 2 threads while other work ran, not with 1). vLLM's CPU backend has the same knob
    (VLLM_CPU_NUM_OF_RESERVED_CPU: cores kept off its OpenMP threads for the serving processes).
    """
    if threads > 0:
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def parse_cpus(spec: str) -> str:
    """argparse type of `--engine-cpus`: "auto", "none", or a CPU list ("1", "2-5", "1,3-4");
    returned unchanged (resolved by `engine_cpus` when the engine starts).

    Raises:
        ValueError: anything else (argparse reports it as a usage error).
    """
    if spec not in ("auto", "none"):
        try:
            parse_cpu_list(spec)
        except ValueError as e:
            raise ValueError(f"expected auto, none or a CPU list: {e}") from None
    return spec


def parse_cpu_list(spec: str) -> frozenset[int]:
    """The CPUs of a list such as "1,3-4" (taskset's notation).

    Raises:
        ValueError: not such a list.
    """
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{spec!r} is not a CPU list such as 1,3-4")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"CPU range {part.strip()!r} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def engine_cpus(
    spec: str, threads: int, allowed: frozenset[int] | None = None
) -> tuple[frozenset[int], frozenset[int]] | None:
    """Where the engine process and the serving threads run (`--engine-cpus`): (engine CPUs,
    serving CPUs), or None to leave both to the scheduler.

    Args:
        spec: "auto": the last `threads` of the CPUs this process may run on go to the engine
            process and the others to the serving threads, when there are more CPUs than
            threads (else None); "none": None; a CPU list: those CPUs to the engine process and
            the others to the serving threads (all of them when the list takes every CPU).
        threads: the engine's torch threads, resolved (default_threads).
        allowed: the CPUs this process may run on (default: its affinity).

    Why: a step of the model is one torch thread per engine CPU running flat out; the serving
    threads (gRPC, the request pipeline) wake up for every token, and where they share a CPU
    with the engine they preempt its thread and evict its caches. Measured on 2 cores at 32
    streams over gRPC, one core, alternating 6 s windows (the load generator on the serving
    CPU when serving is pinned): 1,822 vs 1,587 tokens/s (median of 4 windows each) and 1,617
    vs 1,490 in a noisier series, at a lower engine CPU cost per token (555 vs 611 µs). vLLM's
    CPU backend binds its OpenMP threads to cores the same way (VLLM_CPU_OMP_THREADS_BIND,
    VLLM_CPU_NUM_OF_RESERVED_CPU).

    Raises:
        ValueError: a CPU list naming a CPU this process may not run on.
    """
    if spec == "none" or not hasattr(os, "sched_getaffinity"):
        return None
    allowed = frozenset(os.sched_getaffinity(0)) if allowed is None else allowed
    if spec == "auto":
        if len(allowed) <= threads:
            return None
        ordered = sorted(allowed)
        return frozenset(ordered[len(ordered) - threads :]), frozenset(ordered[: len(ordered) - threads])
    cpus = parse_cpu_list(spec)
    if not cpus <= allowed:
        raise ValueError(
            f"--engine-cpus {spec}: CPU {min(cpus - allowed)} is not among the CPUs this process may run on "
            f"({','.join(map(str, sorted(allowed)))})"
        )
    return cpus, (allowed - cpus) or allowed


def check_request(request: EngineRequest, max_batch_size: int, max_total_tokens: int) -> int:
    """The batch-token budget a request reserves: (prompt + max_new_tokens) x sequences.

    Raises:
        InvalidArgument: more sequences than the batch holds (field sampling.n), or a budget
            above max_total_tokens (field stopping.max_new_tokens): the request could never run.
    """
    seqs = request.num_sequences
    if seqs > max_batch_size:
        raise InvalidArgument(
            f"The request asks for {seqs} sequences, more than the batch holds ({max_batch_size}).",
            field="sampling.n",
        )
    need = (len(request.prompt_ids) + request.max_new_tokens) * seqs
    if need > max_total_tokens:
        raise InvalidArgument(
            f"The request needs {need} tokens of batch capacity (prompt + max_new_tokens per sequence), "
            f"more than this server allows ({max_total_tokens}); lower max_new_tokens or n.",
            field="stopping.max_new_tokens",
        )
    return need


def duplicate_id(request_id: str) -> InvalidArgument:
    """The error for a request whose id is still running (request ids are unique among live
    requests of an engine)."""
    return InvalidArgument(f"A request with id '{request_id}' is already running.", field="request_id")


def queue_full(max_queue_size: int) -> Overloaded:
    """The error for a request arriving while max_queue_size requests wait."""
    return Overloaded(f"The server is at capacity ({max_queue_size} requests waiting); retry later.")
