"""Resolution of unset sampling parameters to the generic engine defaults.

Rule sources: the LMI GenerationParameters table ("available with every rolling batch
backend": do_sample false, temperature 1.0, top_k 0, top_p 1.0, repetition_penalty 1.0) and
LMI >= 0.32's inference of do_sample from the other sampling fields. The TensorRT-LLM engine
has its own table (core.engine.trtllm.defaults); both report the values they applied.
"""

from __future__ import annotations

from core.types import ResolvedSampling, SamplingOptions

GENERIC_TEMPERATURE = 1.0
GENERIC_TOP_K = 0
GENERIC_TOP_P = 1.0


def infer_do_sample(opts: SamplingOptions, default_temperature: float = GENERIC_TEMPERATURE) -> bool:
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
    do_sample = infer_do_sample(opts)

    def pick(value, default):
        return default if value is None else value

    return ResolvedSampling(
        do_sample=do_sample,
        seed=random_seed if opts.seed is None else opts.seed,
        temperature=pick(opts.temperature, GENERIC_TEMPERATURE),
        top_k=pick(opts.top_k, GENERIC_TOP_K),
        top_p=pick(opts.top_p, GENERIC_TOP_P),
        min_p=pick(opts.min_p, 0.0),
        typical_p=pick(opts.typical_p, 1.0),
        repetition_penalty=pick(opts.repetition_penalty, 1.0),
        presence_penalty=pick(opts.presence_penalty, 0.0),
        frequency_penalty=pick(opts.frequency_penalty, 0.0),
        length_penalty=pick(opts.length_penalty, 1.0),
        early_stopping=pick(opts.early_stopping, False),
        num_beams=pick(opts.num_beams, 1),
    )
