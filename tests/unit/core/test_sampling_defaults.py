"""Generic default resolution and do_sample inference (LMI GenerationParameters table)."""

from __future__ import annotations

import pytest

from core.sampling import infer_do_sample, resolve_generic
from core.types import SamplingOptions as S


@pytest.mark.parametrize(
    "opts, expected",
    [
        (S(), False),
        (S(do_sample=True), True),
        (S(do_sample=False, top_k=50), False),
        (S(temperature=1.0), False),  # the default temperature alone does not mean sampling
        (S(temperature=0.7), True),
        (S(temperature=0.0, do_sample=True), False),  # temperature 0 is greedy whatever do_sample says
        (S(top_k=1), False),
        (S(top_k=2), True),
        (S(top_p=1.0), False),
        (S(top_p=0.9), True),
        (S(min_p=0.1), True),
        (S(typical_p=0.9), True),
        (S(repetition_penalty=1.2), False),
    ],
)
def test_do_sample_inference(opts, expected):
    assert infer_do_sample(opts) is expected


def test_unset_fields_take_the_generic_defaults():
    r = resolve_generic(S(), random_seed=7)
    assert (r.do_sample, r.temperature, r.top_k, r.top_p, r.repetition_penalty) == (False, 1.0, 0, 1.0, 1.0)
    assert (r.min_p, r.typical_p, r.presence_penalty, r.frequency_penalty) == (0.0, 1.0, 0.0, 0.0)
    assert (r.num_beams, r.length_penalty, r.early_stopping) == (1, 1.0, False)
    assert r.seed == 7


def test_set_fields_win_and_the_client_seed_is_used():
    r = resolve_generic(S(do_sample=True, temperature=0.5, top_k=40, top_p=0.9, seed=123), random_seed=7)
    assert (r.do_sample, r.temperature, r.top_k, r.top_p, r.seed) == (True, 0.5, 40, 0.9, 123)
