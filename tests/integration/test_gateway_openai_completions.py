"""`POST /v1/completions` with the official `openai` SDK against a real OpenAI gateway and the
shared in-process core (tiny HF model) on loopback: the response and chunk shapes of
openai-python's `Completion` / `CompletionChoice` / `CompletionUsage` (src/openai/types/
completion*.py), prompt lists and token-id prompts, n, streaming (one and several prompts),
include_usage, logprobs, echo, stop strings, and every error path.

BAN suppresses the special tokens (ids 0-7) so outputs run to max_tokens; greedy runs
(temperature 0) are deterministic, so streamed and non-streamed outputs are compared.
"""

from __future__ import annotations

import aiohttp
import openai
import pytest
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

MODEL = "tiny"
BAN = {str(i): -100 for i in range(8)}
PROMPT = "The garden was"


def greedy(**kwargs):
    return dict(model=MODEL, temperature=0, logit_bias=BAN, **kwargs)


def check(resp, choices: int):
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert resp.model == MODEL and isinstance(resp.created, int)
    assert [c.index for c in resp.choices] == list(range(choices))
    u = resp.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


async def test_one_prompt(aclient):
    resp = await aclient.completions.create(prompt=PROMPT, max_tokens=5, **greedy())
    check(resp, 1)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.logprobs is None and choice.text
    assert resp.usage.completion_tokens == 5
    again = await aclient.completions.create(prompt=PROMPT, max_tokens=5, **greedy())
    assert again.choices[0].text == choice.text and again.id != resp.id


async def test_default_max_tokens_is_openais_16(aclient):
    resp = await aclient.completions.create(prompt=PROMPT, **greedy())
    assert resp.usage.completion_tokens == 16


async def test_prompt_list_with_n_numbers_choices_by_prompt(aclient):
    prompts = [PROMPT, "Once upon a time"]
    resp = await aclient.completions.create(prompt=prompts, n=2, max_tokens=4, **greedy())
    check(resp, 4)
    alone = [(await aclient.completions.create(prompt=p, max_tokens=4, **greedy())).choices[0].text for p in prompts]
    assert [c.text for c in resp.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert resp.usage.completion_tokens == 16


async def test_token_id_prompts_equal_text_prompts(aclient, core):
    ids = core.servicer.pipeline.tokenizer.encode(PROMPT)
    text = await aclient.completions.create(prompt=PROMPT, max_tokens=4, **greedy())
    by_ids = await aclient.completions.create(prompt=ids, max_tokens=4, **greedy())
    batch = await aclient.completions.create(prompt=[ids, ids], max_tokens=4, **greedy())
    assert by_ids.choices[0].text == text.choices[0].text
    assert [c.text for c in batch.choices] == [text.choices[0].text] * 2
    assert by_ids.usage.prompt_tokens == len(ids)


async def test_streaming_matches_non_streaming(aclient):
    full = await aclient.completions.create(prompt=PROMPT, max_tokens=6, **greedy())
    stream = await aclient.completions.create(prompt=PROMPT, max_tokens=6, stream=True, **greedy())
    chunks = [c async for c in stream]
    assert all(c.object == "text_completion" and c.id == chunks[0].id and len(c.choices) == 1 for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)


async def test_cached_prompt_tokens_are_summed_over_the_prompts(aclient, core):
    """Prompts whose blocks the core's prefix cache holds report them in
    `usage.prompt_tokens_details.cached_tokens`, summed over the prompts (streamed too)."""
    long = "In the walled garden every path led to a fountain, and every fountain to a gate. " * 4
    ids = core.servicer.pipeline.tokenizer.encode(long)
    reused = (len(ids) - 1) // 16 * 16
    await aclient.completions.create(prompt=ids, max_tokens=2, **greedy())
    both = await aclient.completions.create(prompt=[ids, ids], max_tokens=2, **greedy())
    assert both.usage.prompt_tokens_details.cached_tokens == 2 * reused
    stream = await aclient.completions.create(
        prompt=[ids, ids[:10]], max_tokens=2, stream=True, stream_options={"include_usage": True}, **greedy()
    )
    last = [c async for c in stream][-1]
    assert last.usage.prompt_tokens_details.cached_tokens == reused


async def test_streaming_several_prompts_and_include_usage(aclient):
    prompts = [PROMPT, "Once upon a time", "Hello"]
    full = await aclient.completions.create(prompt=prompts, max_tokens=5, **greedy())
    stream = await aclient.completions.create(
        prompt=prompts, max_tokens=5, stream=True, stream_options={"include_usage": True}, **greedy()
    )
    *chunks, last = [c async for c in stream]
    texts = ["", "", ""]
    for c in chunks:
        assert c.usage is None
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in full.choices]
    assert last.choices == [] and last.usage.model_dump(exclude_none=True) == full.usage.model_dump(exclude_none=True)


async def test_streaming_wire_format(base_url):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(f"{base_url}/v1/completions", json=body) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        raw = await r.text()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


async def test_logprobs(aclient):
    resp = await aclient.completions.create(prompt=PROMPT, max_tokens=6, logprobs=2, **greedy())
    choice = resp.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    stream = await aclient.completions.create(prompt=PROMPT, max_tokens=6, logprobs=2, stream=True, **greedy())
    streamed = [t for c in [c async for c in stream] for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    zero = await aclient.completions.create(prompt=PROMPT, max_tokens=3, logprobs=0, **greedy())
    assert zero.choices[0].logprobs.top_logprobs == [{}, {}, {}]


async def test_echo_leads_the_text_with_the_prompt(aclient):
    plain = await aclient.completions.create(prompt=PROMPT, max_tokens=4, **greedy())
    echoed = await aclient.completions.create(prompt=PROMPT, max_tokens=4, echo=True, **greedy())
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    stream = await aclient.completions.create(prompt=PROMPT, max_tokens=4, echo=True, stream=True, **greedy())
    assert "".join(c.choices[0].text for c in [c async for c in stream]) == echoed.choices[0].text


async def test_echo_with_logprobs_scores_the_prompt(aclient, core, stub):
    """lm-eval's loglikelihood request (`echo`, `logprobs: 1`, `max_tokens: 1`, token ids): the
    prompt's tokens lead the logprobs, the first with null; scoring a greedy continuation gives
    the logprobs it was generated with, each its position's top (lm-eval's is_greedy)."""
    ids = core.servicer.pipeline.tokenizer.encode(PROMPT)
    request = spb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(do_sample=False),
        stopping=pb.StoppingParams(max_new_tokens=4, ignore_eos=True),
        output=pb.OutputOptions(logprobs=True, tokens=True),
    )
    generated = [t for m in [m async for m in stub.Generate(request)] for o in m.outputs for t in o.tokens]
    cont = [t.id for t in generated]
    scored = await aclient.completions.create(
        model=MODEL, prompt=[ids + cont], max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    lp = scored.choices[0].logprobs
    whole = len(ids) + len(cont)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == whole + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[len(ids) : whole] == [t.text for t in generated]
    assert lp.token_logprobs[len(ids) : whole] == pytest.approx([t.logprob for t in generated], abs=1e-3)
    for token, top in zip(lp.token_logprobs[len(ids) : whole], lp.top_logprobs[len(ids) : whole], strict=True):
        assert token == max(top.values())
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(whole + 1)]
    only = await aclient.completions.create(prompt=PROMPT, max_tokens=0, logprobs=0, echo=True, **greedy())
    assert only.choices[0].text == PROMPT and only.choices[0].finish_reason == "length"
    assert len(only.choices[0].logprobs.tokens) == len(ids) and only.usage.completion_tokens == 0
    assert only.usage.total_tokens == only.usage.prompt_tokens == len(ids)
    stream = await aclient.completions.create(
        prompt=PROMPT, max_tokens=2, logprobs=1, echo=True, stream=True, **greedy()
    )
    streamed = [t for c in [c async for c in stream] for t in c.choices[0].logprobs.tokens]
    assert streamed[: len(ids)] == only.choices[0].logprobs.tokens and len(streamed) == len(ids) + 2


async def test_vllm_prompt_logprobs(base_url, core):
    ids = core.servicer.pipeline.tokenizer.encode(PROMPT)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}
    async with aiohttp.ClientSession() as s, s.post(f"{base_url}/v1/completions", json=body) as r:
        assert r.status == 200
        choice = (await r.json())["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token_id, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(token_id) in entry and 2 <= len(entry) <= 3
        assert sorted(e["rank"] for e in entry.values() if e["rank"] is not None)[:2] == [1, 2]


async def test_stop_string_is_left_out(aclient):
    plain = await aclient.completions.create(prompt=PROMPT, max_tokens=8, **greedy())
    stop = plain.choices[0].text[3:6]
    resp = await aclient.completions.create(prompt=PROMPT, max_tokens=8, stop=[stop], **greedy())
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == plain.choices[0].text[: plain.choices[0].text.index(stop)]


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"suffix": "end"}, "suffix", "not supported"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available when 'stream'"),
        ({"max_tokens": 0}, "max_tokens", "must be in"),
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
        ({"top_p": 0}, "top_p", "top_p"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": 5}, "prompt", "Invalid value"),
        ({"max_tokens": -1}, "max_tokens", "must be in"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop", "At most 16"),  # the core's --max-stop-sequences
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed"),
        ({"frobnicate": 1}, "frobnicate", "Unrecognized"),
    ],
)
async def test_bad_requests_are_400_with_the_field_named(base_url, extra, param, message):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **extra}
    async with aiohttp.ClientSession() as s, s.post(f"{base_url}/v1/completions", json=body) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["param"] == param and message in error["message"]
    assert error["type"] == "invalid_request_error"


async def test_unknown_model_and_bad_json(aclient, base_url):
    with pytest.raises(openai.NotFoundError) as info:
        await aclient.completions.create(model="gpt-3.5-turbo-instruct", prompt=PROMPT, max_tokens=2)
    assert info.value.param == "model"
    async with aiohttp.ClientSession() as s, s.post(f"{base_url}/v1/completions", data=b"{nope") as r:
        assert r.status == 400 and "error" in await r.json()
