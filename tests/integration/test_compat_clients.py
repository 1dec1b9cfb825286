"""The clients people already run, unmodified, against real gateways on the shared in-process core
(tiny HF model) on loopback, no network: lm-eval's `local-completions` (a local multiple-choice
task scored with echo + logprobs, and a generate_until task with 6 stop strings), litellm,
langchain-openai (`with_structured_output`, `bind_tools`) and huggingface_hub's
`AsyncInferenceClient` (chat with TGI's `response_format` through the LMI gateway's TGI
routes, which need `--accept-any-model` for the client's placeholder model name; streamed
`text_generation` from DJL's `/invocations`, where its User-Agent gets TGI's SSE). The
`text-generation` client and `InferenceClient.text_generation` are covered in
test_gateway_lmi_tgi.py.

Synchronous clients (lm-eval) run in a thread: the gateway and core share the test's loop.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Literal

import huggingface_hub
import litellm
import pytest_asyncio
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

MODEL = "tiny"
BAN = {str(i): -100 for i in range(8)}  # the tiny model's special tokens: outputs run to max_tokens


@pytest_asyncio.fixture(scope="module")
async def openai_url(start_gateway) -> str:
    return await start_gateway("openai")


# ------------------------------------------------------------------------------------ lm-eval

MC = [
    {"question": "The garden was", "choices": [" green", " blue", " loud"], "answer": 0},
    {"question": "Once upon a", "choices": [" time", " table"], "answer": 0},
    {"question": "The cat sat on the", "choices": [" mat", " moon", " idea"], "answer": 0},
]
GEN = [{"question": "Write one word:", "answer": "word"}, {"question": "Count: one, two,", "answer": "three"}]
STOPS = ["\n", ".", "?", "!", ";", ":"]


def write_tasks(root: Path) -> Path:
    """Two lm-eval task configs reading local JSON lines (lm-eval's YAML task format)."""
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN))
    (root / "trellis_mc.yaml").write_text(
        "task: trellis_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    (root / "trellis_gen.yaml").write_text(
        "task: trellis_gen\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_target: "{{answer}}"\n'
        f"generation_kwargs:\n  until: {json.dumps(STOPS)}\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return root


async def test_lm_eval_local_completions(openai_url, tiny_model_dir, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = TaskManager(include_path=str(write_tasks(tmp_path)))
    model_args = (
        f"model={MODEL},base_url={openai_url}/v1/completions,tokenizer={tiny_model_dir},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,max_length=512"
    )
    results = await asyncio.to_thread(
        lm_eval.simple_evaluate,
        model="local-completions",
        model_args=model_args,
        tasks=["trellis_mc", "trellis_gen"],
        task_manager=tasks,
        batch_size=1,
        log_samples=True,
    )
    assert results is not None
    mc = results["results"]["trellis_mc"]
    assert 0.0 <= mc["acc,none"] <= 1.0
    scored = [r for s in results["samples"]["trellis_mc"] for r in s["filtered_resps"]]
    assert len(scored) == sum(len(d["choices"]) for d in MC)
    assert all(logprob < 0 for logprob, _ in scored)  # each choice scored by the prompt's logprobs
    gen = results["samples"]["trellis_gen"]
    assert len(gen) == len(GEN) and "exact_match,none" in results["results"]["trellis_gen"]
    for sample in gen:
        (text,) = sample["resps"][0]
        assert not any(stop in text for stop in STOPS)


# ------------------------------------------------------------------------------------ litellm


async def test_litellm(openai_url):
    resp = await litellm.acompletion(
        model=f"openai/{MODEL}",
        api_base=f"{openai_url}/v1",
        api_key="unused",
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=4,
        temperature=0,
        top_k=5,  # a vLLM extra, passed through
    )
    assert resp.choices[0].message.content is not None and resp.usage.completion_tokens <= 4
    stream = await litellm.acompletion(
        model=f"openai/{MODEL}",
        api_base=f"{openai_url}/v1",
        api_key="unused",
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=4,
        stream=True,
    )
    chunks = [c async for c in stream]
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    text = await litellm.atext_completion(
        model=f"openai/{MODEL}", api_base=f"{openai_url}/v1", api_key="unused", prompt="Once", max_tokens=3
    )
    assert text.choices[0].text is not None


# ------------------------------------------------------------------------------ langchain-openai


class Verdict(BaseModel):
    """Whether it is fine."""

    ok: bool
    mood: Literal["good", "bad"]


@tool
def get_weather(city: Literal["Oslo", "Rome"]) -> str:
    """The weather in a city."""
    return "sunny"


def chat_model(url: str) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key="unused", max_tokens=48, temperature=0, max_retries=0)


async def test_langchain_structured_output_and_tools(openai_url):
    for method in ("json_schema", "function_calling"):
        verdict = await chat_model(openai_url).with_structured_output(Verdict, method=method).ainvoke("Is it fine?")
        assert isinstance(verdict, Verdict), method
    bound = chat_model(openai_url).bind_tools([get_weather], tool_choice="get_weather")
    msg = await bound.ainvoke("Weather in Oslo?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    assert set(msg.tool_calls[0]["args"]) <= {"city"}  # undeclared properties are not generated


# ------------------------------------------------------------------------------ huggingface_hub

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


async def test_inference_client_chat_with_tgi_response_format(start_gateway, monkeypatch):
    # huggingface_hub refuses every request in offline mode, loopback ones too.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    base = await start_gateway("lmi", accept_any_model=True)
    client = huggingface_hub.AsyncInferenceClient(base_url=base, timeout=60)
    out = await client.chat_completion(
        messages=[{"role": "user", "content": "Is it fine?"}],
        response_format={"type": "json", "value": SCHEMA},
        max_tokens=16,
    )
    assert set(json.loads(out.choices[0].message.content)) == {"ok"}
    chunks = [
        c
        async for c in await client.chat_completion(
            messages=[{"role": "user", "content": "Say hi"}], max_tokens=4, stream=True
        )
    ]
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")


async def test_inference_client_streams_from_invocations(start_gateway, monkeypatch):
    # The client reads only SSE `data:` lines: DJL's default JSON lines would be an empty stream.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for options in ({}, {"output_formatter": "jsonlines"}):
        base = await start_gateway("lmi", **options)
        client = huggingface_hub.AsyncInferenceClient(model=f"{base}/invocations", timeout=60)
        text = await client.text_generation("Once upon a", max_new_tokens=4)
        parts = [t async for t in await client.text_generation("Once upon a", max_new_tokens=4, stream=True)]
        assert parts and "".join(parts) == text, options
        events = [
            e async for e in await client.text_generation("Once upon a", max_new_tokens=4, stream=True, details=True)
        ]
        assert events[-1].generated_text == text and events[-1].details.generated_tokens == 4, options
