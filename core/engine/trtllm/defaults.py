"""TensorRT-LLM's sampling defaults, resolved in one pure function shared by both TensorRT-LLM
engines (`--engine trtllm` over the executor, `--engine trtllm-llm` over the LLM API).

Rule sources:
  * the LMI seed, "Additional TensorRT-LLM Generation Parameters": greedy is the default
    decoding; a greedy request reports temperature 0.8 (which greedy ignores) and leaves top_k
    and top_p unset; a sampling request fills top_k 5, top_p 0.85 and temperature 1.0 where the
    client left them unset (each engine reports its own sampling defaults, docs/tensorrt-llm.md);
  * the executor's `SamplingConfig` (`cpp/tensorrt_llm/executor/samplingConfig.cpp`): the
    runtime has no do_sample. Greedy is top_k and top_p both unset (an all-default
    SamplingConfig is greedy); top_p 0 fails its validation ("topP > 0.f"); temperature 0
    corrupted other requests of the batch, so it is mapped to greedy and never sent;
  * an unseeded request uses the runtime's default seed 0, so identical unseeded requests
    would sample alike; the caller draws a random per-request seed, and the seed used is reported.

`ResolvedSampling` fields left None are not sent to the runtime (its own defaults apply: no
penalties, min_p 0). do_sample, when unset, is inferred as everywhere else in the core
(`core.sampling.infer_do_sample`, LMI >= 0.32), with 1.0 as the engine's default temperature
(the sampling default and the runtime's own): a client temperature of 0.8 alone means sampling.
"""

from __future__ import annotations

from dataclasses import replace

from core.sampling import infer_do_sample
from core.types import ResolvedSampling, SamplingOptions

GREEDY_TEMPERATURE = 0.8
"""Temperature a greedy request reports (the seed's table); greedy decoding ignores it."""

SAMPLING_TOP_K = 5
SAMPLING_TOP_P = 0.85
SAMPLING_TEMPERATURE = 1.0
DEFAULT_TEMPERATURE = SAMPLING_TEMPERATURE
"""The temperature do_sample inference compares against (see the module docstring)."""


def resolve_trtllm_sampling(opts: SamplingOptions, *, random_seed: int) -> ResolvedSampling:
    """Apply TensorRT-LLM's defaults to a request's sampling fields.

    Args:
        opts: the client's sampling fields (None = unset).
        random_seed: the seed to use when the client gave none, drawn by the caller so that
            this function stays pure; always reported and always sent.

    Returns:
        Greedy (do_sample false, inferred false, or temperature 0): top_k, top_p and min_p None
        (not sent: an all-default SamplingConfig decodes greedily), temperature the client's
        value or 0.8 (reported only; never sent). Sampling: top_k 5, top_p 0.85 and temperature
        1.0 where unset, the client's values otherwise, min_p as given. In both modes the
        penalties are the client's (None = not sent: they change logits, so greedy honours
        them too), typical_p, length_penalty and early_stopping are None (no typical sampling,
        no beam search on this engine; core validation refuses non-neutral values) and
        num_beams is the client's value or 1.
    """
    do_sample = infer_do_sample(opts, DEFAULT_TEMPERATURE)
    seed = random_seed if opts.seed is None else opts.seed
    if not do_sample:
        temperature = GREEDY_TEMPERATURE if opts.temperature is None else opts.temperature
        return replace(_penalties(opts, seed), do_sample=False, temperature=temperature)
    return replace(
        _penalties(opts, seed),
        do_sample=True,
        temperature=SAMPLING_TEMPERATURE if opts.temperature is None else opts.temperature,
        top_k=SAMPLING_TOP_K if opts.top_k is None else opts.top_k,
        top_p=SAMPLING_TOP_P if opts.top_p is None else opts.top_p,
        min_p=opts.min_p,
    )


def _penalties(opts: SamplingOptions, seed: int) -> ResolvedSampling:
    """The fields both modes share: seed, penalties and beam count."""
    return ResolvedSampling(
        do_sample=False,
        seed=seed,
        repetition_penalty=opts.repetition_penalty,
        presence_penalty=opts.presence_penalty,
        frequency_penalty=opts.frequency_penalty,
        num_beams=opts.num_beams or 1,
    )
