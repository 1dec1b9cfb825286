"""What automatic prefix caching buys when prompts share a long prefix (the HF engine).

Starts two cores on the demo model, one with the prefix cache (`--prefix-cache`, the default)
and one without (`--no-prefix-cache`), and drives them in turn, alternating rounds, with
scripts/bench/loadgen.py's closed loop over gRPC: 8 streams, each request a prompt of a common
768-token prefix (a system prompt, a shared document) followed by 32 tokens of its own, and 32
new tokens (EOS ignored). Token ids are drawn at random (seeded) from the ordinary vocabulary,
so every request's own part is new to the cache. Reports, per side, the median over rounds of
TTFT p50 and output tokens/s, the ratios, and the cache's reuse (usage.cached_tokens).

Usage: python scripts/bench/prefix.py --model models/demo [--rounds 3] [--requests 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import GrpcClient, Result, Sample, Timeline, run_load
from procs import ROOT, Proc, free_port

#: Ordinary token ids of the demo tokenizer (0-7 are special).
FIRST_ID, VOCAB = 8, 4096


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


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; prints one line per round and a JSON object of figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=48, help="measured requests per round and side")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=768)
    p.add_argument("--own-tokens", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    model = str(Path(args.model).resolve())
    prefix = [random.Random(0).randrange(FIRST_ID, VOCAB) for _ in range(args.prefix_tokens)]
    runs: dict[str, list[Result]] = {"cache": [], "no_cache": []}
    reuse: dict[str, list[float]] = {"cache": [], "no_cache": []}
    cores = dict(
        [
            ("cache", start_core("core-prefix-cache", model)),
            ("no_cache", start_core("core-no-prefix-cache", model, "--no-prefix-cache")),
        ]
    )
    try:
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
    finally:
        for proc, _ in cores.values():
            proc.stop()
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
    figures["setup"] = {k: v for k, v in vars(args).items() if k != "json"}
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
