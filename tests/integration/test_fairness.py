"""Priority and tenant fair shares on the mock engine over real gRPC, and the tenant's way
through each gateway: the fairness header reaches the core, and a tenant over its limit gets
429 with Retry-After in the schema's own shape."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from core.tenants import DEFAULT_LABEL
from tests.integration.core_helpers import request_of, wait_for
from tests.integration.gateway_helpers import ws_url

LONG = {"max_new_tokens": 2000, "ignore_eos": True}


def retry_info(error: grpc.aio.AioRpcError) -> tuple[str, float | None]:
    """(ErrorInfo reason, RetryInfo delay in seconds) of a failed call."""
    reason, delay = "", None
    status = rpc_status.from_call(error)
    for d in status.details if status else []:
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            d.Unpack(info)
            reason = info.reason
        elif d.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            d.Unpack(retry)
            delay = retry.retry_delay.ToNanoseconds() / 1e9
    return reason, delay


class Blocker:
    """A long request that holds the batch (size 1) until `release`."""

    def __init__(self, stub: spb_grpc.GenerateServiceStub, metadata=None, **fields):
        self.call = stub.Generate(request_of("block", stopping=LONG, **fields), metadata=metadata)

    async def running(self) -> None:
        async for m in self.call:
            if m.state == pb.GENERATE_STATE_SCHEDULED:
                return

    def release(self) -> None:
        self.call.cancel()


async def scheduling_order(stub, requests: list[tuple[str, dict]]) -> list[str]:
    """Queue `requests` (name, GenerateRequest fields) in order behind a blocker, release it,
    and return the names in the order the engine scheduled them."""
    blocker = Blocker(stub)
    await blocker.running()
    order: list[str] = []

    async def run(name: str, queued: asyncio.Event, fields: dict) -> None:
        async for m in stub.Generate(request_of("x", stopping={"max_new_tokens": 1}, **fields)):
            if m.state == pb.GENERATE_STATE_QUEUED:
                queued.set()
            elif m.state == pb.GENERATE_STATE_SCHEDULED:
                order.append(name)

    tasks = []
    for name, fields in requests:
        queued = asyncio.Event()
        tasks.append(asyncio.create_task(run(name, queued, fields)))
        await queued.wait()
    blocker.release()
    await asyncio.gather(*tasks)
    return order


@pytest.fixture(scope="module")
async def priority_core(start_mock_core):
    return await start_mock_core(scheduling_policy="priority", max_batch_size=1, mock_context_length=4096)


@pytest.fixture(scope="module")
async def priority_stub(priority_core):
    async with grpc.aio.insecure_channel(priority_core.address) as channel:
        yield spb_grpc.GenerateServiceStub(channel)


async def test_a_high_priority_request_overtakes_waiting_ones(priority_stub):
    order = await scheduling_order(
        priority_stub,
        [("low1", {"priority": 5}), ("plain", {}), ("low2", {"priority": 5}), ("high", {"priority": -1})],
    )
    assert order == ["high", "plain", "low1", "low2"]


async def test_fcfs_ignores_priority(start_mock_core):
    core = await start_mock_core(max_batch_size=1, mock_context_length=4096)
    async with grpc.aio.insecure_channel(core.address) as channel:
        order = await scheduling_order(
            spb_grpc.GenerateServiceStub(channel), [("a", {"priority": 5}), ("b", {}), ("c", {"priority": -1})]
        )
    assert order == ["a", "b", "c"]


async def test_tenants_take_turns_by_tokens(priority_stub):
    order = await scheduling_order(
        priority_stub,
        [("a1", {"tenant": "a"}), ("a2", {"tenant": "a"}), ("a3", {"tenant": "a"}), ("b1", {"tenant": "b"})],
    )
    # b queued last but is served as soon as a has had its turn, not after all of a's requests
    assert order == ["a1", "b1", "a2", "a3"]


async def test_a_tenant_field_longer_than_128_characters_is_refused(priority_stub):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in priority_stub.Generate(request_of("x", tenant="t" * 129)):
            pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tenant" in e.value.details()


async def test_named_api_keys_set_the_tenant_and_its_running_limit(start_mock_core):
    core = await start_mock_core(
        api_key=("alice:key-a", "key-anon"), tenant_max_running=1, max_batch_size=4, mock_context_length=4096
    )
    alice = [("authorization", "Bearer key-a")]
    anon = [("authorization", "Bearer key-anon")]
    async with grpc.aio.insecure_channel(core.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        blocker = Blocker(stub, metadata=alice, tenant="bob")  # the key's name wins over the field
        await blocker.running()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(request_of("x", tenant="carol"), metadata=alice):
                pass
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "alice" in e.value.details()
        assert retry_info(e.value) == ("TENANT_LIMIT", 1.0)
        # an unnamed key: the request's own tenant field applies
        msgs = [m async for m in stub.Generate(request_of("x", tenant="dave"), metadata=anon)]
        assert msgs[-1].HasField("usage")
        blocker.release()
    tenants = core.servicer.pipeline.tenants
    await wait_for(lambda: tenants.counts["alice"].running == 0)
    assert tenants.counts["alice"].refusals == 1
    assert tenants.counts["dave"].generation_tokens > 0
    assert "bob" not in tenants.counts and "carol" not in tenants.counts


async def test_tokens_per_minute_refuses_with_the_time_to_refill(start_mock_core):
    core = await start_mock_core(tenant_tokens_per_minute=60, max_batch_size=4, mock_context_length=4096)
    async with grpc.aio.insecure_channel(core.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        # 60 tokens a minute is one a second: this request puts the tenant ~100 tokens in debt
        msgs = [m async for m in stub.Generate(request_of("x", stopping={"max_new_tokens": 100}, tenant="t"))]
        assert msgs[-1].usage.completion_tokens == 100
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(request_of("x", tenant="t")):
                pass
        reason, delay = retry_info(e.value)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and reason == "TENANT_LIMIT"
        assert delay is not None and delay >= 30  # ~40 tokens of debt at 1 token/s, at least
        # another tenant, and the default tenant, are not affected
        for fields in ({"tenant": "u"}, {}):
            msgs = [m async for m in stub.Generate(request_of("x", stopping={"max_new_tokens": 1}, **fields))]
            assert msgs[-1].HasField("usage")
    assert core.servicer.pipeline.tenants.counts["t"].refusals == 1
    assert DEFAULT_LABEL in core.servicer.pipeline.tenants.counts


# ------------------------------------------------------------------ gateways


@pytest.fixture(scope="module")
async def limited(start_mock_core, start_gateway):
    """A core allowing one request per tenant, tenant 't1' holding it, and a gateway of each kind."""
    core = await start_mock_core(tenant_max_running=1, max_batch_size=4, mock_context_length=4096)
    urls = {name: await start_gateway(name, core=core.address) for name in ("openai", "lmi", "triton", "ws")}
    async with grpc.aio.insecure_channel(core.address) as channel:
        blocker = Blocker(spb_grpc.GenerateServiceStub(channel), tenant="t1")
        await blocker.running()
        yield urls
        blocker.release()


def fairness(tenant: str) -> dict[str, str]:
    return {"x-gateway-inference-fairness-id": tenant}


async def test_openai_header_reaches_the_core_and_the_limit_is_429(limited):
    async with aiohttp.ClientSession() as http:
        body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with http.post(limited["openai"] + "/v1/chat/completions", json=body, headers=fairness("t1")) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "1"
            err = (await r.json())["error"]
            assert err["code"] == "tenant_limit" and "t1" in err["message"]
        async with http.post(limited["openai"] + "/v1/chat/completions", json=body, headers=fairness("t2")) as r:
            assert r.status == 200


async def test_lmi_limit_is_429_in_lmis_shape(limited):
    async with aiohttp.ClientSession() as http:
        body = {"inputs": "hi", "parameters": {"max_new_tokens": 2}}
        async with http.post(limited["lmi"] + "/invocations", json=body, headers=fairness("t1")) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "1"
            out = await r.json()
            assert out["details"]["finish_reason"] == "error" and "t1" in out["error"]
        async with http.post(limited["lmi"] + "/invocations", json=body, headers=fairness("t2")) as r:
            assert r.status == 200


async def test_triton_limit_is_429_in_tritons_shape(limited):
    async with aiohttp.ClientSession() as http:
        body = {"text_input": "hi", "parameters": {"max_tokens": 2}}
        url = limited["triton"] + "/v2/models/mock/generate"
        async with http.post(url, json=body, headers=fairness("t1")) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "1"
            assert "t1" in (await r.json())["error"]
        async with http.post(url, json=body, headers=fairness("t2")) as r:
            assert r.status == 200


async def test_websocket_upgrade_header_names_the_tenant(limited):
    async with aiohttp.ClientSession() as http:
        frame = {"prompts": [{"request_id": "p1", "prompt": "hi"}], "generation_config": {"max_new_tokens": 2}}
        async with http.ws_connect(ws_url(limited["ws"]), headers=fairness("t1")) as ws:
            await ws.send_str(json.dumps(frame))
            events = await ws.receive_json()
            assert [e["type"] for e in events] == ["ERROR"] and "t1" in json.dumps(events), events
        async with http.ws_connect(ws_url(limited["ws"]), headers=fairness("t2")) as ws:
            await ws.send_str(json.dumps(frame))
            seen: list[str] = []
            while "COMPLETE" not in seen and "ERROR" not in seen:
                seen += [e["type"] for e in await ws.receive_json()]
            assert seen[0] == "ACCEPTED" and seen[-1] == "COMPLETE", seen


# ------------------------------------------------------------------ preemption and a full queue


async def test_a_preempted_request_streams_what_it_would_have_unpreempted(start_mock_core):
    # 300 tokens at 3 ms a step: the high-priority request arrives while the low one runs
    core = await start_mock_core(
        scheduling_policy="priority", max_batch_size=1, mock_context_length=4096, mock_step_ms=3.0
    )
    stopping = {"max_new_tokens": 300, "ignore_eos": True}
    async with grpc.aio.insecure_channel(core.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        for sampling in ({}, {"do_sample": True, "seed": 5}):
            alone = [m async for m in stub.Generate(request_of("story", sampling=sampling, stopping=stopping))]
            low = stub.Generate(request_of("story", sampling=sampling, stopping=stopping))
            streamed = []
            async for m in low:
                streamed.append(m)
                if sum(len(o.tokens) for o in m.outputs) and len(streamed) > 5:
                    break
            high = [m async for m in stub.Generate(request_of("x", stopping={"max_new_tokens": 2}, priority=-1))]
            streamed += [m async for m in low]
            assert high[-1].HasField("usage")
            text = "".join(o.text for m in streamed for o in m.outputs)
            assert text == "".join(o.text for m in alone for o in m.outputs)
            ids = [t.id for m in streamed for o in m.outputs for t in o.tokens]
            assert ids == [t.id for m in alone for o in m.outputs for t in o.tokens] and len(ids) == 300
    assert core.servicer.pipeline.tenants.counts[DEFAULT_LABEL].preemptions == 2


async def test_a_request_displaced_from_a_full_queue_is_429_through_the_gateway(start_mock_core, start_gateway):
    core = await start_mock_core(max_batch_size=1, max_queue_size=2, mock_context_length=4096)
    url = await start_gateway("openai", core=core.address)
    tenants = core.servicer.pipeline.tenants
    async with grpc.aio.insecure_channel(core.address) as channel, aiohttp.ClientSession() as http:
        stub = spb_grpc.GenerateServiceStub(channel)
        blocker = Blocker(stub, tenant="a")
        await blocker.running()
        queued = stub.Generate(request_of("x", stopping={"max_new_tokens": 1}, tenant="a"))
        await wait_for(lambda: tenants.counts["a"].waiting == 1)
        body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        post = asyncio.create_task(
            http.post(url + "/v1/chat/completions", json=body, headers=fairness("a"))  # the newest of a
        )
        await wait_for(lambda: tenants.counts["a"].waiting == 2)
        with pytest.raises(grpc.aio.AioRpcError) as e:  # a holds the whole queue: its own arrival is refused
            async for _ in stub.Generate(request_of("x", tenant="a")):
                pass
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        other = stub.Generate(request_of("x", stopping={"max_new_tokens": 1}, tenant="b"))
        async with await post as r:
            assert r.status == 429 and r.headers["Retry-After"] == "1"
            err = (await r.json())["error"]
            assert err["code"] == "queue_full" and "gave its place" in err["message"]
        blocker.release()
        assert [m async for m in other][-1].HasField("usage")
        assert [m async for m in queued][-1].HasField("usage")
    assert tenants.counts["a"].refusals == 2 and tenants.counts["b"].refusals == 0
