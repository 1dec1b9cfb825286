"""The neutral value of each sampling parameter, and the resolution of unset sampling
parameters to the generic engine defaults.

Rule sources: the LMI GenerationParameters table ("available with every rolling batch
backend": do_sample false, temperature 1.0, top_k 0, top_p 1.0, repetition_penalty 1.0), which
are the neutral values, and LMI >= 0.32's inference of do_sample from the other sampling
fields. The TensorRT-LLM engine has its own table (core.engine.trtllm.defaults); both report
the values they applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from core.types import ResolvedSampling, SamplingOptions

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class NeutralSampling:
    """The value at which each sampling parameter changes nothing: the generic engine defaults,
    the values an engine that lacks a feature accepts (validation), and the values of batch rows
    that do not use a filter (the HF engine)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool = False
    num_beams: int = 1


NEUTRAL = NeutralSampling()


def infer_do_sample(opts: SamplingOptions, default_temperature: float = NEUTRAL.temperature) -> bool:
    """Whether a request samples.

    An explicit do_sample wins, except that temperature 0 always means greedy. Otherwise
    sampling is inferred (LMI >= 0.32) from a temperature > 0 other than the engine's
    default, top_k > 1, top_p < 1, min_p > 0 or typical_p < 1.
    """
    if opts.temperature is not None and opts.temperature == 0:
        return False
    if opts.do_sample is not None:
        return opts.do_sample
    return (
        (opts.temperature is not None and opts.temperature > 0 and opts.temperature != default_temperature)
        or (opts.top_k is not None and opts.top_k > 1)
        or (opts.top_p is not None and opts.top_p < 1)
        or (opts.min_p is not None and opts.min_p > 0)
        or (opts.typical_p is not None and opts.typical_p < 1)
    )


def resolve_generic(opts: SamplingOptions, *, random_seed: int) -> ResolvedSampling:
    """Apply the generic defaults to every unset field.

    Args:
        opts: the client's sampling fields.
        random_seed: the seed to use when the client gave none (drawn by the caller, so this
            function stays pure).

    Greedy requests report the filter values they would have used but decode by argmax;
    penalties and logit bias apply to both greedy and sampling.
    """
    n = NEUTRAL
    return ResolvedSampling(
        do_sample=infer_do_sample(opts),
        seed=random_seed if opts.seed is None else opts.seed,
        temperature=_pick(opts.temperature, n.temperature),
        top_k=_pick(opts.top_k, n.top_k),
        top_p=_pick(opts.top_p, n.top_p),
        min_p=_pick(opts.min_p, n.min_p),
        typical_p=_pick(opts.typical_p, n.typical_p),
        repetition_penalty=_pick(opts.repetition_penalty, n.repetition_penalty),
        presence_penalty=_pick(opts.presence_penalty, n.presence_penalty),
        frequency_penalty=_pick(opts.frequency_penalty, n.frequency_penalty),
        length_penalty=_pick(opts.length_penalty, n.length_penalty),
        early_stopping=_pick(opts.early_stopping, n.early_stopping),
        num_beams=_pick(opts.num_beams, n.num_beams),
    )


def _pick(value: T | None, default: T) -> T:
    return default if value is None else value
