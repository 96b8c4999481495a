"""Greedy speculative decoding of the target with a drafter: the offline acceptance measurement.

Each *verify step* the drafter proposes ``k`` tokens; the target runs once over the last emitted
token and the proposals (with its KV cache), its greedy choices ``y_0..y_k`` accept the longest
matching prefix ``n`` of the proposals, and ``n + 1`` tokens are emitted (the accepted ones plus the
target's own next token). The accept length is ``n + 1`` averaged over verify steps (what SGLang's
``accept len`` reports, at most ``k + 1``); the accept rate is ``sum(n) / (k · steps)``. The output is
exactly the target's greedy output, whatever the drafter proposes.

Drafters: :class:`Eagle3Drafter` (the trained draft, chain drafting as SGLang does with
``--speculative-eagle-topk 1``, reusing the draft's step-0 keys across rounds) and
:class:`OracleDrafter` (proposes the target's own greedy continuation: the accept length must be
exactly ``k + 1``; used to prove the measurement). Under tensor parallelism :class:`RankZeroDrafter`
broadcasts rank 0's proposals so every rank verifies the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pipeline.eagle3.draft_model import Eagle3Draft
from pipeline.eagle3.target_capture import Target


class Drafter(Protocol):
    def start(self, tokens: list[int], feats: torch.Tensor) -> None:
        """``tokens`` = prompt + first generated token; ``feats`` (P, 3H) the prompt's target features."""

    def propose(self, k: int) -> list[int]: ...

    def accept(self, n: int, feats: torch.Tensor, new_tokens: list[int]) -> None:
        """``n`` proposals accepted; ``feats`` (n+1, 3H) for the newly verified positions; the tokens
        appended to the sequence (accepted proposals, then the target's own token)."""


@dataclass
class SpecResult:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # n per verify step
    k: int = 0

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def accept_len(self) -> float:
        return (sum(self.accepted) / len(self.accepted) + 1.0) if self.accepted else 0.0

    @property
    def accept_rate(self) -> float:
        return sum(self.accepted) / (self.k * len(self.accepted)) if self.accepted else 0.0


def _new_cache() -> Any:  # a transformers DynamicCache (imported lazily)
    from transformers import DynamicCache

    return DynamicCache()


@torch.no_grad()
def greedy_generate(target: Target, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    """Plain greedy decoding with the KV cache (the reference the speculative output must equal)."""
    dev = target.device
    cache = _new_cache()
    cap = target.capture(torch.tensor([prompt], device=dev), cache=cache)
    out = []
    nxt = int(target.logits(cap.last_hidden[0, -1]).argmax())
    while True:
        out.append(nxt)
        if nxt in eos or len(out) >= max_new:
            return out
        cap = target.capture(torch.tensor([[nxt]], device=dev), cache=cache)
        nxt = int(target.logits(cap.last_hidden[0, -1]).argmax())


@torch.no_grad()
def speculative_generate(
    target: Target, drafter: Drafter, prompt: list[int], k: int, max_new: int, eos: set[int]
) -> SpecResult:
    dev = target.device
    cache = _new_cache()
    cap = target.capture(torch.tensor([prompt], device=dev), cache=cache)
    first = int(target.logits(cap.last_hidden[0, -1]).argmax())
    res = SpecResult(tokens=[first], k=k)
    if first in eos or max_new <= 1:
        return res
    drafter.start(list(prompt) + [first], cap.aux[0])
    while True:
        props = [int(t) for t in drafter.propose(k)]
        if len(props) != k:
            raise ValueError(f"drafter proposed {len(props)} tokens, expected {k}")
        seen = cache.get_seq_length()
        inp = torch.tensor([[res.tokens[-1], *props]], device=dev)
        cap = target.capture(inp, cache=cache)
        y = target.logits(cap.last_hidden[0]).argmax(-1).tolist()
        n = 0
        while n < k and props[n] == y[n]:
            n += 1
        new = props[:n] + [y[n]]
        drop = cache.get_seq_length() - (seen + n + 1)
        if drop > 0:  # a negative crop removes that many tokens, in transformers 4.x and 5.x alike
            cache.crop(-drop)
        res.accepted.append(n)
        for t in new:
            res.tokens.append(t)
            if t in eos or len(res.tokens) >= max_new:
                return res
        drafter.accept(n, cap.aux[0, : n + 1], new)


class Eagle3Drafter:
    """Chain drafting with the EAGLE-3 draft; step-0 keys are cached, later steps are per round."""

    def __init__(self, draft: Eagle3Draft) -> None:
        self.draft = draft.eval()
        self.dev = next(draft.parameters()).device
        self.dtype = next(draft.parameters()).dtype
        self.k0: torch.Tensor | None = None  # step-0 keys and values of every column so far
        self.v0: torch.Tensor | None = None
        self.ncols = 0

    def _step0(self, feats: torch.Tensor, next_tokens: list[int]) -> None:
        """Append step-0 columns: column ``c`` pairs feature ``f_c`` with token ``x_{c+1}``."""
        d = self.draft
        c0, n = self.ncols, feats.shape[0]
        cols = torch.arange(c0, c0 + n, device=self.dev)
        hidden = d.project(feats.to(self.dev, self.dtype)[None])
        prefix = None if self.k0 is None else (self.k0, self.v0)
        h, (k, v) = d.layer(
            torch.tensor([next_tokens], device=self.dev),
            hidden,
            (cols + 1)[None],
            cols,
            None,
            [],
            None,
            prefix=prefix,
        )
        self.k0 = k if self.k0 is None else torch.cat([self.k0, k], 2)
        self.v0 = v if self.v0 is None else torch.cat([self.v0, v], 2)
        self.last_hidden = h[:, -1:]
        self.ncols = c0 + n

    @torch.no_grad()
    def start(self, tokens: list[int], feats: torch.Tensor) -> None:
        self.tokens = list(tokens)
        self.k0 = self.v0 = None
        self.ncols = 0
        self._step0(feats, self.tokens[1 : feats.shape[0] + 1])

    @torch.no_grad()
    def propose(self, k: int) -> list[int]:
        d = self.draft
        t = self.ncols - 1  # the chain's column
        hidden = self.last_hidden
        tok = d.draft_to_target(d.logits(hidden)[0, -1].argmax()).item()
        out = [int(tok)]
        chain: list[tuple[torch.Tensor, torch.Tensor]] = []
        qcol = torch.tensor([t], device=self.dev)
        for j in range(1, k):
            pos = torch.tensor([[t + 1 + j]], device=self.dev)
            hidden, kv = d.layer(
                torch.tensor([[out[-1]]], device=self.dev),
                d.carry(hidden),
                pos,
                qcol,
                (self.k0, self.v0),
                chain,
                None,
            )
            chain.append(kv)
            out.append(int(d.draft_to_target(d.logits(hidden)[0, -1].argmax())))
        return out

    @torch.no_grad()
    def accept(self, n: int, feats: torch.Tensor, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        self._step0(feats, new_tokens)


class RankZeroDrafter:
    """Tensor-parallel decoding: rank 0 drafts, and every rank verifies rank 0's tokens.

    Each rank runs the same decode over its shard of the target; were each to draft on its own, a draft
    that computed a near-tie differently on one rank would send different tokens into the target's
    collectives (a hang or garbage). Here only rank 0 holds a drafter (``inner``; ``None`` on the others)
    and its proposals are broadcast, so every rank verifies exactly the same tokens by construction.
    """

    def __init__(self, inner: Drafter | None, rank: int, device: torch.device) -> None:
        if (inner is None) != (rank != 0):
            raise ValueError("rank 0, and only rank 0, drafts")
        self.inner, self.rank, self.device = inner, rank, device

    def start(self, tokens: list[int], feats: torch.Tensor) -> None:
        if self.inner is not None:
            self.inner.start(tokens, feats)

    def propose(self, k: int) -> list[int]:
        import torch.distributed as dist

        if self.inner is not None:
            props = [int(t) for t in self.inner.propose(k)]
            if len(props) != k:  # before the broadcast: a size the other ranks do not expect would hang them
                raise ValueError(f"drafter proposed {len(props)} tokens, expected {k}")
            t = torch.tensor(props, dtype=torch.int64, device=self.device)
        else:
            t = torch.empty(k, dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return [int(x) for x in t.tolist()]

    def accept(self, n: int, feats: torch.Tensor, new_tokens: list[int]) -> None:
        if self.inner is not None:
            self.inner.accept(n, feats, new_tokens)


class OracleDrafter:
    """Proposes what the target itself would say next (greedy, no cache): the perfect draft."""

    def __init__(self, target: Target) -> None:
        self.target = target

    def start(self, tokens: list[int], feats: torch.Tensor) -> None:
        self.tokens = list(tokens)

    @torch.no_grad()
    def propose(self, k: int) -> list[int]:
        seq = list(self.tokens)
        out = []
        for _ in range(k):
            cap = self.target.capture(torch.tensor([seq], device=self.target.device))
            t = int(self.target.logits(cap.last_hidden[0, -1]).argmax())
            out.append(t)
            seq.append(t)
        return out

    def accept(self, n: int, feats: torch.Tensor, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
