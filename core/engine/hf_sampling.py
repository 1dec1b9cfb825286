"""Per-row logits processing and sampling for a heterogeneous batch (torch).

Every row of a batch carries its own parameters. Processing order follows transformers'
`generate`: penalties, logit bias and bans on the raw logits; then greedy rows take the
argmax; sampling rows apply temperature, top-k, top-p, min-p and typical-p and draw with their
own `torch.Generator`, so a seeded request samples the same tokens whatever else is in the batch.
Logprobs are always taken from the raw distribution (log-softmax of the unprocessed logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from core.sampling import NEUTRAL

NEG_INF = float("-inf")


@dataclass(slots=True)
class RowParams:
    """Sampling parameters of one batch row (resolved values, neutral when unused)."""

    do_sample: bool
    temperature: float = NEUTRAL.temperature
    top_k: int = NEUTRAL.top_k
    top_p: float = NEUTRAL.top_p
    min_p: float = NEUTRAL.min_p
    typical_p: float = NEUTRAL.typical_p
    repetition_penalty: float = NEUTRAL.repetition_penalty
    presence_penalty: float = NEUTRAL.presence_penalty
    frequency_penalty: float = NEUTRAL.frequency_penalty

    @property
    def needs_penalties(self) -> bool:
        """Whether any token-history penalty is active."""
        n = NEUTRAL
        return (
            self.repetition_penalty != n.repetition_penalty
            or self.presence_penalty != n.presence_penalty
            or self.frequency_penalty != n.frequency_penalty
        )


@dataclass(slots=True)
class BatchParams:
    """RowParams of a whole batch as tensors (built once per batch composition)."""

    do_sample: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B] float
    top_k: torch.Tensor  # [B] long, 0 = off
    top_p: torch.Tensor  # [B] float
    min_p: torch.Tensor  # [B] float
    typical_p: torch.Tensor  # [B] float
    repetition_penalty: torch.Tensor  # [B] float
    presence_penalty: torch.Tensor  # [B] float
    frequency_penalty: torch.Tensor  # [B] float
    any_sample: bool
    any_penalty: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_typical: bool

    @classmethod
    def from_rows(cls, rows: Sequence[RowParams], device: torch.device | str = "cpu") -> BatchParams:
        """Stack per-row parameters."""

        def t(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        n = NEUTRAL  # greedy rows take the neutral values: their filters must change nothing
        do_sample = [r.do_sample for r in rows]
        top_k = [r.top_k if r.do_sample else n.top_k for r in rows]
        top_p = [r.top_p if r.do_sample else n.top_p for r in rows]
        min_p = [r.min_p if r.do_sample else n.min_p for r in rows]
        typical = [r.typical_p if r.do_sample else n.typical_p for r in rows]
        return cls(
            do_sample=t(do_sample, torch.bool),
            temperature=t([max(r.temperature, 1e-5) if r.do_sample else n.temperature for r in rows], torch.float32),
            top_k=t(top_k, torch.long),
            top_p=t(top_p, torch.float32),
            min_p=t(min_p, torch.float32),
            typical_p=t(typical, torch.float32),
            repetition_penalty=t([r.repetition_penalty for r in rows], torch.float32),
            presence_penalty=t([r.presence_penalty for r in rows], torch.float32),
            frequency_penalty=t([r.frequency_penalty for r in rows], torch.float32),
            any_sample=any(do_sample),
            any_penalty=any(r.needs_penalties for r in rows),
            any_top_k=any(k > n.top_k for k in top_k),
            any_top_p=any(p < n.top_p for p in top_p),
            any_min_p=any(p > n.min_p for p in min_p),
            any_typical=any(p < n.typical_p for p in typical),
        )


def apply_penalties(
    logits: torch.Tensor, params: BatchParams, seen: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Repetition (transformers' rule: divide positive logits, multiply negative ones, for
    every token in prompt or output), presence and frequency penalties (OpenAI's rule, output
    tokens only). seen: [B, V] bool (prompt + output); counts: [B, V] float (output counts)."""
    rp = params.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / rp, logits * rp)
    logits = torch.where(seen, penalized, logits)
    logits = logits - params.frequency_penalty[:, None] * counts
    return logits - params.presence_penalty[:, None] * (counts > 0).to(logits.dtype)


def filter_logits(logits: torch.Tensor, params: BatchParams) -> torch.Tensor:
    """Temperature, then top-k, top-p, min-p and typical-p masks (rows with neutral values are
    unchanged). logits: [B, V] of sampling rows; returns processed logits with -inf masks."""
    logits = logits / params.temperature[:, None]
    if params.any_top_k or params.any_top_p:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if params.any_top_k:
            k = torch.where(params.top_k > 0, params.top_k, torch.full_like(params.top_k, vocab))
            ranks = torch.arange(vocab, device=logits.device)[None, :]
            remove |= ranks >= k[:, None]
        if params.any_top_p:
            probs = sorted_logits.masked_fill(remove, NEG_INF).softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs
            remove |= (before >= params.top_p[:, None]) & (params.top_p < 1.0)[:, None]
        remove[:, 0] = False
        logits = logits.scatter(1, sorted_idx, sorted_logits.masked_fill(remove, NEG_INF))
    if params.any_min_p:
        probs = logits.softmax(dim=-1)
        threshold = params.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, NEG_INF)
    if params.any_typical:
        logits = _typical(logits, params.typical_p)
    return logits


def _typical(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al.; transformers' TypicalLogitsWarper), per row."""
    log_p = logits.log_softmax(dim=-1)
    p = log_p.exp()
    entropy = -torch.nan_to_num(p * log_p).sum(dim=-1, keepdim=True)
    shifted = (-log_p - entropy).abs()
    sorted_scores, sorted_idx = shifted.sort(dim=-1)
    cum = logits.gather(-1, sorted_idx).softmax(dim=-1).cumsum(dim=-1)
    last = (cum < mass[:, None]).sum(dim=1).clamp(max=logits.shape[-1] - 1)
    cutoff = sorted_scores.gather(1, last[:, None])
    remove = shifted > cutoff
    remove &= (mass < 1.0)[:, None]
    return logits.masked_fill(remove, NEG_INF)


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Inverse-CDF sampling, one uniform draw per row from that row's generator.

    probs: [R, V] normalized; returns [R] token ids. Using one draw per token (rather than
    torch.multinomial on the whole batch) keeps each row's random stream its own.
    """
    u = torch.stack([torch.rand((), generator=g, device=probs.device) for g in generators])
    cdf = probs.cumsum(dim=-1)
    cdf[:, -1] = 1.0 + 1e-6
    idx = torch.searchsorted(cdf, u[:, None].to(cdf.dtype)).squeeze(1)
    # Never pick a zero-probability token (possible only through float rounding at the edges).
    chosen = probs.gather(1, idx[:, None]).squeeze(1)
    if bool((chosen <= 0).any()):
        idx = torch.where(chosen > 0, idx, probs.argmax(dim=-1))
    return idx
