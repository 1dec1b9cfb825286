"""vLLM's extra parameters sent the way clients moving from vLLM send them (the openai SDK's
`extra_body`) to a real OpenAI gateway on the shared in-process core (tiny HF model): min_tokens,
continuous usage stats, guides, template options, chat echo, prompt_logprobs, and the refusals."""

from __future__ import annotations

import aiohttp
import openai
import pytest

MODEL = "tiny"
USER = [{"role": "user", "content": "Tell me a story."}]


async def test_min_tokens_holds_off_eos(aclient):
    resp = await aclient.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=6, temperature=0, extra_body={"min_tokens": 6, "top_k": -1}
    )
    assert resp.usage.completion_tokens == 6


async def test_continuous_usage_stats_on_every_chunk(aclient):
    options = {"include_usage": True, "continuous_usage_stats": True}
    stream = await aclient.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=5, temperature=0, stream=True, stream_options=options
    )
    chunks = [c async for c in stream]
    *deltas, last = chunks
    assert deltas and all(c.usage is not None for c in deltas)
    counts = [c.usage.completion_tokens for c in deltas]
    assert counts == sorted(counts) and all(c.usage.prompt_tokens == last.usage.prompt_tokens for c in deltas)
    assert counts[-1] == last.usage.completion_tokens and last.choices == []
    stream = await aclient.completions.create(
        model=MODEL, prompt="Once", max_tokens=4, temperature=0, stream=True, stream_options=options
    )
    *deltas, last = [c async for c in stream]
    assert all(c.usage is not None for c in deltas) and deltas[-1].usage.completion_tokens == 4


async def test_guides(aclient):
    choice = await aclient.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=8, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert choice.choices[0].message.content in ("yes", "no")
    regex = await aclient.completions.create(
        model=MODEL, prompt="Once", max_tokens=8, extra_body={"structured_outputs": {"regex": "[ab]{3}"}}
    )
    assert len(regex.choices[0].text) == 3 and set(regex.choices[0].text) <= {"a", "b"}


async def test_continue_final_message_with_echo(aclient):
    messages = [*USER, {"role": "assistant", "content": "Once upon"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    resp = await aclient.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, extra_body=extra
    )
    assert resp.choices[0].message.content.startswith("Once upon")
    opened = await aclient.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert resp.usage.prompt_tokens < opened.usage.prompt_tokens  # no <|end|><|assistant|>


async def test_chat_template_kwargs(aclient):
    resp = await aclient.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert resp.choices[0].finish_reason
    with pytest.raises(openai.BadRequestError) as info:
        await aclient.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=1, extra_body={"chat_template_kwargs": {"tools": []}}
        )
    assert info.value.param == "chat_template_kwargs"


async def test_chat_prompt_logprobs(base_url):
    body = {"model": MODEL, "messages": USER, "max_tokens": 1, "prompt_logprobs": 1}
    async with aiohttp.ClientSession() as s, s.post(f"{base_url}/v1/chat/completions", json=body) as r:
        assert r.status == 200
        resp = await r.json()
    entries = resp["prompt_logprobs"]
    assert len(entries) == resp["usage"]["prompt_tokens"] and entries[0] is None
    assert all(any(e["rank"] == 1 for e in entry.values()) for entry in entries[1:])


@pytest.mark.parametrize(
    "path, extra, param, message",
    [
        ("chat/completions", {"use_beam_search": True}, "use_beam_search", "not supported"),
        ("chat/completions", {"min_p": 2}, "min_p", "min_p"),
        ("chat/completions", {"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
        ("completions", {"guided_grammar": "not a grammar ::="}, "guided_grammar", "grammar"),
        ("completions", {"add_special_tokens": False}, "add_special_tokens", "not supported"),
    ],
)
async def test_refusals_name_the_field(base_url, path, extra, param, message):
    body = {"model": MODEL, "max_tokens": 2, **extra}
    body.update({"messages": USER} if path.startswith("chat") else {"prompt": "x"})
    async with aiohttp.ClientSession() as s, s.post(f"{base_url}/v1/{path}", json=body) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["param"] == param and message in error["message"]
