"""Build the demo model: a small Llama-architecture causal LM with a byte-level BPE tokenizer.

Nothing is downloaded. The tokenizer is trained with `tokenizers` on local text (the licence
texts under /usr/share/common-licenses and the Python standard library's top-level modules),
gets bos/eos/pad and chat special tokens and a chat template, and the model is trained on the
same text for a fixed number of steps (STEPS) from a fixed seed (SEED) on one CPU thread, so
the same corpus, torch, transformers and kind of CPU give the same weights bit for bit, however
busy the machine. The build takes about 2 minutes of CPU time.

Usage:
    python scripts/make_demo_model.py --output models/demo [--steps 400] [--seed 1234]

`--steps 0` builds the untrained model (same architecture, tokenizer and template) in a few
seconds: what the tests use. Next to the weights, trellis_demo.json records the steps, the
seed and the final training loss.

A trained model also gets two LoRA adapters in PEFT's layout under `adapters/` (ADAPTERS),
which the core serves from the start (docs/lora.md): each trains rank-8 A and B matrices on
every Linear layer of the frozen model, for ADAPTER_STEPS steps from its own seed, on a
rewriting of the same text whose greedy output is easy to tell from the base model's:
`shout` on the text in capitals, `python` on the Python sources alone. trellis_demo.json
records each adapter's steps, seed and final loss. The result loads with `AutoModelForCausalLM.from_pretrained`
/ `AutoTokenizer.from_pretrained` and is served with `trellis-core --model models/demo`.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

# The demo model that `make model` builds: tests/unit/test_demo_model.py checks a built
# models/demo against these. FINAL_LOSS is the loss of the last step with torch 2.13.0 and
# transformers 5.23.0 on x86-64 with Python 3.11's standard library and Debian's licence texts; another
# CPU may sum in another order (other SIMD widths), hence the tolerance.
STEPS = 400
SEED = 1234
FINAL_LOSS = 4.2736
FINAL_LOSS_TOLERANCE = 0.1
#: The demo adapters: name -> seed. Trained for ADAPTER_STEPS steps each (a few seconds).
ADAPTERS = {"shout": 11, "python": 12}
ADAPTER_STEPS = 60
ADAPTER_RANK = 8
ADAPTER_ALPHA = 16
ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Plain turns render as <|role|>content<|end|>. With tools, a system turn lists them and asks for
# Hermes-style calls (<tool_call>{"name": ..., "arguments": ...}</tool_call>, the format the
# OpenAI gateway parses); an assistant turn's tool_calls render the same way, and a tool result
# is a <|tool|> turn.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|system|>You may call these functions:\\n<tools>\\n' }}"
    "{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ '</tools>\\nTo call one, answer with <tool_call>\\n"
    '{\\"name\\": <name>, \\"arguments\\": <arguments>}'
    "\\n</tool_call><|end|>' }}{% endif %}"
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}"
    "{{ '<tool_call>\\n' + ({'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson)"
    " + '\\n</tool_call>' }}{% endfor %}{{ '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def corpus_files() -> list[str]:
    """Local text files the tokenizer and model learn from, in a fixed order."""
    files = sorted(glob.glob("/usr/share/common-licenses/*"))
    files += sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    return [f for f in files if os.path.isfile(f)]


def read_corpus(files: list[str], max_bytes: int) -> str:
    """Concatenate the files (decoded as UTF-8, errors replaced) up to max_bytes characters."""
    parts, size = [], 0
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return "\n".join(parts)[:max_bytes]


def build_tokenizer(text: str, vocab_size: int):
    """Train a byte-level BPE tokenizer; returns a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    chunks = text.split("\n\n")
    tok.train_from_iterator(chunks, trainer=trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        model_max_length=1024,
        padding_side="left",
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def build_model(hf_tok, hidden: int, layers: int, context: int, seed: int):
    """A Llama config sized for CPU, initialised from `seed` (the global RNG is left as it was);
    EOS is both <|eos|> and <|end|> (end of a chat turn). The output projection has weights of
    its own (not tied to the embeddings): at width 128 the embeddings alone are a small head."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    end_id = hf_tok.convert_tokens_to_ids("<|end|>")
    cfg = LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.6875),
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        bos_token_id=hf_tok.bos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        eos_token_id=[hf_tok.eos_token_id, end_id],
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = hf_tok.pad_token_id
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.bos_token_id = hf_tok.bos_token_id
    return model


def train(model, hf_tok, text: str, steps: int, seed: int, batch: int = 16, seq: int = 128) -> list[float]:
    """Next-token training for exactly `steps` AdamW steps on windows of the corpus.

    Each step takes `batch` windows of `seq` tokens at offsets drawn from a generator seeded with
    `seed`, so the data order is fixed. Training runs on one CPU thread (the caller's thread count
    is restored after): with more, the order of float sums in matmuls depends on the thread
    count, and so would the weights. Prints the step and loss every 10 steps and at the last.
    Returns the loss of every step (mean cross-entropy per token, nats).
    """
    import torch

    ids = torch.tensor(hf_tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    print(f"training {steps} steps on {ids.numel():,} tokens ({batch} x {seq} tokens a step, seed {seed})", flush=True)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model.train()
    losses: list[float] = []
    start = time.monotonic()
    try:
        for step in range(1, steps + 1):
            starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=gen)
            x = torch.stack([ids[s : s + seq] for s in starts.tolist()])
            out = model(input_ids=x, labels=x)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(out.loss.item())
            if step % 10 == 0 or step == steps:
                elapsed = time.monotonic() - start
                print(f"  step {step:4d}/{steps}  loss {losses[-1]:.3f}  {elapsed:5.1f} s", flush=True)
    finally:
        torch.set_num_threads(threads)
        model.eval()
    return losses


def adapter_text(name: str, text: str, files: list[str], max_bytes: int) -> str:
    """The training text of demo adapter `name`: the corpus in capitals (`shout`), or the
    corpus's Python sources alone (`python`)."""
    if name == "shout":
        return text.upper()
    return read_corpus([f for f in files if f.endswith(".py")], max_bytes)


def train_adapter(model, hf_tok, text: str, steps: int, seed: int, out: Path, base_name: str) -> list[float]:
    """Train a LoRA adapter on the frozen `model` and save it to `out` in PEFT's layout
    (adapter_config.json, adapter_model.safetensors with `base_model.model.<module>.lora_A.weight`
    [r, in] and `lora_B.weight` [out, r]; peft 0.x). A starts as peft's default (Kaiming-uniform)
    from `seed`, B at zero, so step 0 is the base model; each step is one AdamW step on 8
    windows of 64 tokens at offsets from `seed`, on one thread (as `train`, for the same
    reproducibility). Returns the loss of every step; the model is left unchanged."""
    import math

    import torch
    from safetensors.torch import save_file

    scale = ADAPTER_ALPHA / ADAPTER_RANK
    gen = torch.Generator().manual_seed(seed)
    pairs: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
    hooks = []
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or path.rsplit(".", 1)[-1] not in ADAPTER_TARGETS:
            continue
        bound = 1 / math.sqrt(module.in_features)
        a = torch.nn.Parameter((torch.rand((ADAPTER_RANK, module.in_features), generator=gen) * 2 - 1) * bound)
        b = torch.nn.Parameter(torch.zeros((module.out_features, ADAPTER_RANK)))
        pairs[path] = (a, b)

        def add(mod, inputs, output, a=a, b=b):
            return output + (inputs[0] @ a.T) @ b.T * scale

        hooks.append(module.register_forward_hook(add))
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.tensor(hf_tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    opt = torch.optim.AdamW([t for pair in pairs.values() for t in pair], lr=5e-3, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model.train()
    losses: list[float] = []
    try:
        for _ in range(steps):
            starts = torch.randint(0, ids.numel() - 65, (8,), generator=gen)
            x = torch.stack([ids[s : s + 64] for s in starts.tolist()])
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
        model.eval()
        for hook in hooks:
            hook.remove()
        for p in model.parameters():
            p.requires_grad_(True)
    out.mkdir(parents=True)
    tensors = {}
    for path, (a, b) in pairs.items():
        tensors[f"base_model.model.{path}.lora_A.weight"] = a.detach().contiguous()
        tensors[f"base_model.model.{path}.lora_B.weight"] = b.detach().contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": ADAPTER_RANK,
        "lora_alpha": ADAPTER_ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(ADAPTER_TARGETS),
        "base_model_name_or_path": base_name,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return losses


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (argparse exits with 2 on a bad flag)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="models/demo", help="output directory (created)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS}; 0: untrained)")
    p.add_argument("--seed", type=int, default=SEED, help=f"seed of the weights and data order (default {SEED})")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--corpus-bytes", type=int, default=5_000_000)
    p.add_argument(
        "--adapter-steps",
        type=int,
        default=None,
        help=f"training steps of each demo LoRA adapter (default {ADAPTER_STEPS} for a trained model, "
        "none for an untrained one; 0: no adapters)",
    )
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error(f"--steps must be 0 or more, got {args.steps}")
    adapter_steps = args.adapter_steps if args.adapter_steps is not None else (ADAPTER_STEPS if args.steps else 0)
    if adapter_steps < 0:
        p.error(f"--adapter-steps must be 0 or more, got {adapter_steps}")

    import torch
    import transformers

    t0 = time.monotonic()
    files = corpus_files()
    if not files:
        print("no local corpus found under /usr/share/common-licenses or the stdlib", file=sys.stderr)
        return 1
    text = read_corpus(files, args.corpus_bytes)
    print(f"[1/4] corpus: {len(files)} files, {len(text):,} characters", flush=True)
    hf_tok = build_tokenizer(text, args.vocab_size)
    print(f"[2/4] tokenizer: {len(hf_tok)} tokens ({time.monotonic() - t0:.1f} s)", flush=True)
    model = build_model(hf_tok, args.hidden_size, args.layers, args.context, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[3/4] model: {n_params:,} parameters", flush=True)
    losses = train(model, hf_tok, text, args.steps, args.seed) if args.steps else []
    out = Path(args.output)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a build that died half-way leaves one behind
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    hf_tok.save_pretrained(tmp)
    record = {
        "steps": len(losses),
        "seed": args.seed,
        "final_loss": losses[-1] if losses else None,
        "corpus_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if adapter_steps:
        record["adapters"] = {}
        for name, seed in ADAPTERS.items():
            body = adapter_text(name, text, files, args.corpus_bytes)
            t1 = time.monotonic()
            adapter_losses = train_adapter(model, hf_tok, body, adapter_steps, seed, tmp / "adapters" / name, out.name)
            record["adapters"][name] = {"steps": adapter_steps, "seed": seed, "final_loss": adapter_losses[-1]}
            print(
                f"      adapter {name}: loss {adapter_losses[0]:.3f} -> {adapter_losses[-1]:.3f} "
                f"({time.monotonic() - t1:.1f} s)",
                flush=True,
            )
    (tmp / "trellis_demo.json").write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    summary = f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "untrained"
    print(f"[4/4] saved to {out} ({summary}, {time.monotonic() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
