"""One batch's training-time-test loss: soft-label cross-entropy per TTT step and greedy accuracy.

:func:`ttt_sums` applies the draft's final norm and ``lm_head`` itself, over the scored tokens
only and ``chunk_tokens`` of them at a time, each chunk under non-reentrant activation
checkpointing: the (tokens × draft vocab) fp32 logits, log-softmax and target probabilities of a
chunk live only while that chunk is computed (forward) or recomputed (backward), never those of
all TTT steps at once. The target's logits over the draft vocabulary are computed once per batch
(bf16 under autocast, as the target itself would give them; fp32 otherwise) and shared by every
step and chunk, which only gather their rows: a recomputed chunk repeats the softmax, not the
(tokens × hidden × draft vocab) product (done per chunk in fp32 it cost more than the draft). ``chunk_tokens=0`` keeps the plain form (every step's full logits alive
until backward), which the tests and ``bench/ttt_memory.py`` compare against.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pipeline.eagle3.draft_model import Eagle3Draft, shift_left
from pipeline.stages.train.batches import Batch

# Tokens per loss chunk: 4096 × a 32k draft vocab × fp32 is 0.5 GiB per live (tokens × vocab) tensor.
DEFAULT_CHUNK_TOKENS = 4096


def counts_of(batches: list[Batch], steps: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([sum(int(b.step_mask(j).sum()) for b in batches) for j in range(steps)],
                        dtype=torch.float64, device=device)


def ttt_sums(model: Any, draft: Eagle3Draft, b: Batch, head_d: torch.Tensor, steps: int,
             autocast: bool, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per TTT step: the summed soft-label CE (with grad) and the number of correct greedy tokens.

    ``model`` is the draft or its DDP wrapper; ``head_d`` the target's ``lm_head`` rows of the draft
    vocabulary (the soft labels are the target's distribution renormalised over them).
    """
    if chunk_tokens <= 0:
        return ttt_sums_unchunked(model, draft, b, head_d, steps, autocast)
    with torch.no_grad():
        target_logits = target_logits_of(b.last_hidden, head_d, autocast)
    with torch.autocast(b.aux.device.type, dtype=torch.bfloat16, enabled=autocast):
        hiddens = model(b.aux, b.input_ids, b.lengths, steps, logits=False)
    losses, correct = [], torch.zeros(steps, dtype=torch.float64, device=b.aux.device)
    for j, hj in enumerate(hiddens):
        m = b.step_mask(j)
        rows, cols = m.nonzero(as_tuple=True)  # the scored columns; the rest only cost memory
        h = hj[rows, cols]
        tcols = cols + 1 + j
        am = b.target_argmax[rows, tcols]
        weight = draft.t2d[am].to(torch.float32)  # a target token outside the draft vocab teaches nothing
        loss = h.new_zeros((), dtype=torch.float32)
        n = h.shape[0]
        for a in range(0, max(n, 1), chunk_tokens):
            sl = slice(a, a + chunk_tokens)
            part = (h[sl], target_logits, rows[sl], tcols[sl], weight[sl])
            fn = _ChunkLoss(draft, autocast)
            if torch.is_grad_enabled() and h.requires_grad and n:
                loss_c, guess = checkpoint(fn, *part, use_reentrant=False)
            else:
                loss_c, guess = fn(*part)
            loss = loss + loss_c
            correct[j] += (guess == am[sl]).sum()
        losses.append(loss)
    return losses, correct


def target_logits_of(last_hidden: torch.Tensor, head_d: torch.Tensor, autocast: bool) -> torch.Tensor:
    """(B, S, draft vocab): the target's logits over the draft vocabulary, from its stored final hidden."""
    if autocast:
        with torch.autocast(last_hidden.device.type, dtype=torch.bfloat16):
            return last_hidden @ head_d.T
    return last_hidden.float() @ head_d.float().T


class _ChunkLoss:
    """One chunk's summed soft-label CE (fp32) and its greedy guesses (target ids, no grad)."""

    def __init__(self, draft: Eagle3Draft, autocast: bool) -> None:
        self.draft = draft
        self.autocast = autocast

    def __call__(self, h: torch.Tensor, target_logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                 weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.draft
        with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = d.logits(h)
        logits = logits.float()
        with torch.no_grad():
            p = target_logits[rows, cols].float().softmax(-1)  # the target over the draft vocab
            guess = d.draft_to_target(logits.argmax(-1))
        ce = -(p * F.log_softmax(logits, dim=-1)).sum(-1)
        return (ce * weight).sum(), guess


def ttt_sums_unchunked(model: Any, draft: Eagle3Draft, b: Batch, head_d: torch.Tensor, steps: int,
                       autocast: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`ttt_sums` as first written: every step's full (B, S, Vd) logits kept for backward."""
    with torch.no_grad():
        tgt = (b.last_hidden.float() @ head_d.float().T).log_softmax(-1)  # target over the draft vocab
    with torch.autocast(b.aux.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(b.aux, b.input_ids, b.lengths, steps)
    losses, correct = [], torch.zeros(steps, dtype=torch.float64, device=b.aux.device)
    for j, lj in enumerate(logits):
        lj = lj.float()
        m = b.step_mask(j)
        am = shift_left(b.target_argmax, 1 + j)
        p = shift_left(tgt, 1 + j).exp()
        in_vocab = draft.t2d[am]
        ce = -(p * F.log_softmax(lj, dim=-1)).sum(-1)
        losses.append((ce * (m & in_vocab)).sum())
        with torch.no_grad():
            guess = draft.draft_to_target(lj.argmax(-1))
            correct[j] += ((guess == am) & m).sum()
    return losses, correct
