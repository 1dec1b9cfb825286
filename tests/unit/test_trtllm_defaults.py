"""The TensorRT-LLM sampling defaults (core.engine.trtllm.defaults), as a table.

Source: the LMI seed's "Additional TensorRT-LLM Generation Parameters" table and the
executor's `SamplingConfig` rules (see the module docstring of core.engine.trtllm.defaults).
"""

from __future__ import annotations

import itertools

import pytest

from core.engine.trtllm.bindings import BindingApi
from core.engine.trtllm.defaults import resolve_trtllm_sampling
from core.engine.trtllm.mapping import sampling_kwargs
from core.types import SamplingOptions

SEED = 4242
G, S = False, True
N = None

# (client fields, expected do_sample, temperature, top_k, top_p)
TABLE = [
    # do_sample unset, nothing else set: greedy; the seed's greedy temperature is reported only.
    ({}, G, 0.8, N, N),
    # do_sample unset, inferred from one parameter
    ({"temperature": 1.0}, G, 1.0, N, N),  # the default temperature alone is not sampling
    ({"temperature": 0.7}, S, 0.7, 5, 0.85),
    ({"temperature": 0.8}, S, 0.8, 5, 0.85),  # 0.8 is a greedy report, not a default: sampling
    ({"temperature": 0.0}, G, 0.0, N, N),
    ({"top_k": 1}, G, 0.8, N, N),
    ({"top_k": 0}, G, 0.8, N, N),
    ({"top_k": 40}, S, 1.0, 40, 0.85),
    ({"top_p": 1.0}, G, 0.8, N, N),
    ({"top_p": 0.9}, S, 1.0, 5, 0.9),
    ({"min_p": 0.1}, S, 1.0, 5, 0.85),
    ({"typical_p": 0.5}, S, 1.0, 5, 0.85),
    ({"top_k": 40, "top_p": 0.5, "temperature": 0.3}, S, 0.3, 40, 0.5),
    # do_sample set true
    ({"do_sample": True}, S, 1.0, 5, 0.85),
    ({"do_sample": True, "temperature": 0.5}, S, 0.5, 5, 0.85),
    ({"do_sample": True, "top_k": 0}, S, 1.0, 0, 0.85),
    ({"do_sample": True, "top_k": 10}, S, 1.0, 10, 0.85),
    ({"do_sample": True, "top_p": 1.0}, S, 1.0, 5, 1.0),
    ({"do_sample": True, "top_p": 0.3, "top_k": 7, "temperature": 2.0}, S, 2.0, 7, 0.3),
    ({"do_sample": True, "temperature": 0.0}, G, 0.0, N, N),  # temperature 0 is greedy, always
    ({"do_sample": True, "temperature": 0.0, "top_k": 9}, G, 0.0, N, N),
    # do_sample set false: greedy whatever the filters say; they are not sent
    ({"do_sample": False}, G, 0.8, N, N),
    ({"do_sample": False, "temperature": 0.5}, G, 0.5, N, N),
    ({"do_sample": False, "top_k": 40, "top_p": 0.5}, G, 0.8, N, N),
    ({"do_sample": False, "temperature": 0.0}, G, 0.0, N, N),
]


@pytest.mark.parametrize("client, do_sample, temperature, top_k, top_p", TABLE, ids=[str(c) for c, *_ in TABLE])
def test_defaults_table(client, do_sample, temperature, top_k, top_p):
    r = resolve_trtllm_sampling(SamplingOptions(**client), random_seed=SEED)
    assert (r.do_sample, r.temperature, r.top_k, r.top_p) == (do_sample, temperature, top_k, top_p)
    assert r.seed == SEED
    assert r.typical_p is None and r.length_penalty is None and r.early_stopping is None


@pytest.mark.parametrize(
    "client, expected",
    [
        ({"seed": 7}, 7),
        ({"seed": 0}, 0),
        ({"seed": -5}, -5),
        ({}, SEED),
        ({"do_sample": True}, SEED),
    ],
)
def test_seed_is_the_clients_or_the_drawn_one(client, expected):
    assert resolve_trtllm_sampling(SamplingOptions(**client), random_seed=SEED).seed == expected


@pytest.mark.parametrize(
    "client, expected",
    [
        ({}, {"repetition_penalty": None, "presence_penalty": None, "frequency_penalty": None, "min_p": None}),
        (
            {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5},
            {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5, "min_p": None},
        ),
        ({"do_sample": True, "min_p": 0.2}, {"min_p": 0.2}),
        ({"do_sample": False, "min_p": 0.2}, {"min_p": None}),  # a filter: greedy ignores it
        ({"num_beams": 3}, {"num_beams": 3}),
        ({}, {"num_beams": 1}),
    ],
)
def test_other_fields(client, expected):
    r = resolve_trtllm_sampling(SamplingOptions(**client), random_seed=SEED)
    assert {k: getattr(r, k) for k in expected} == expected


DO_SAMPLE = [None, True, False]
TEMPERATURE = [None, 0.0, 0.6, 1.0, 1.7]
TOP_K = [None, 0, 1, 50]
TOP_P = [None, 0.4, 1.0]


@pytest.mark.parametrize("do_sample", DO_SAMPLE)
def test_every_combination_keeps_the_runtime_rules(do_sample):
    """Over every combination of do_sample set/unset and each parameter set/unset: greedy sends
    no filter and no temperature, sampling sends all three, top_p is never <= 0, temperature 0
    is never sent, client values win where set, defaults fill only unset fields."""
    api = BindingApi()
    for temperature, top_k, top_p in itertools.product(TEMPERATURE, TOP_K, TOP_P):
        opts = SamplingOptions(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
        r = resolve_trtllm_sampling(opts, random_seed=SEED)
        sent = sampling_kwargs(r, api, n=1, min_new_tokens=0)
        if temperature == 0.0 or do_sample is False:
            assert not r.do_sample
        if not r.do_sample:
            assert (r.top_k, r.top_p) == (None, None)
            assert r.temperature == (0.8 if temperature is None else temperature)
            assert not {"top_k", "top_p", "temperature"} & set(sent)
        else:
            assert r.temperature == (1.0 if temperature is None else temperature)
            assert r.top_k == (5 if top_k is None else top_k)
            assert r.top_p == (0.85 if top_p is None else top_p)
            assert sent["top_k"] == r.top_k and sent["top_p"] == r.top_p and sent["temperature"] == r.temperature
        assert sent.get("top_p", 1.0) > 0 and sent.get("temperature", 1.0) > 0
        assert sent["seed"] == SEED
