"""What the HF engine derives from its configuration without loading the model: its EngineInfo,
the torch thread count, and the admission checks of a request.

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
