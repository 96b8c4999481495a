"""One batch's training-time-test loss: soft-label cross-entropy per TTT step and greedy accuracy.

:func:`ttt_sums` applies the draft's final norm and ``lm_head`` itself, over the scored tokens
only, through :func:`pipeline.drafts.eagle3.head_loss.linear_soft_ce`: ``chunk_tokens`` tokens at a
time, each chunk's gradients taken in the forward pass, so the (tokens × draft vocab) logits and
target probabilities of a chunk live only while that chunk is computed, never those of all TTT steps
at once, and nothing is recomputed in backward. The target's logits over the draft vocabulary are
computed once per batch (bf16 under autocast, as the target itself would give them; fp32 otherwise)
and shared by every step and chunk, which only gather their rows. ``chunk_tokens=0`` keeps the
plain form (every step's full logits alive until backward), which the tests and
``bench/gpu/ttt_memory.py`` compare against.

``objective`` other than ``kl`` (``[train] loss``) scores the same positions with the same weights through
:func:`pipeline.drafts.eagle3.lk_loss.linear_lk` instead: the LK losses, which also need the target's
log-sum-exp over its whole vocabulary (``head_full``: its ``lm_head``), computed once per batch.
:class:`TTTLoss` is the method's objective as the trainer calls it (:class:`~pipeline.drafts.registry.DraftLoss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.drafts.batch import Batch
from pipeline.drafts.eagle3.acceptance import simulated_accept_length
from pipeline.drafts.eagle3.head_loss import linear_soft_ce
from pipeline.drafts.eagle3.lk_loss import full_lse_of, linear_lk
from pipeline.drafts.registry import TrainedDraft
from pipeline.eagle3.draft_model import Eagle3Draft, shift_left
from pipeline.run.plan.sections import TrainSection

# Tokens per loss chunk: 4096 × a 32k draft vocab × fp32 is 0.5 GiB per live (tokens × vocab) tensor.
DEFAULT_CHUNK_TOKENS = 4096


def counts_of(batches: list[Batch], steps: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(
        [sum(int(b.step_mask(j).sum()) for b in batches) for j in range(steps)],
        dtype=torch.float64,
        device=device,
    )


def ttt_sums(
    model: Any,
    draft: Eagle3Draft,
    b: Batch,
    head_d: torch.Tensor,
    steps: int,
    autocast: bool,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    objective: str = "kl",
    head_full: torch.Tensor | None = None,
    kl_scale: float = 1.0,
    kl_decay: float = 1.0,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per TTT step: the summed loss (with grad) and the number of correct greedy tokens.

    ``model`` is the draft or its DDP wrapper; ``head_d`` the target's ``lm_head`` rows of the draft
    vocabulary (the soft labels are the target's distribution renormalised over them). ``objective``:
    ``kl`` (soft-label CE), ``lk`` or ``lk_adaptive`` (:mod:`.lk_loss`; they need ``head_full``, the
    target's whole ``lm_head``, and its ``kl_scale``/``kl_decay``).
    """
    lk = objective != "kl"
    if lk and head_full is None:
        raise ValueError(f"the {objective!r} loss needs the target's whole lm_head (head_full)")
    if chunk_tokens <= 0 and not lk:
        return ttt_sums_unchunked(model, draft, b, head_d, steps, autocast)
    with torch.no_grad():
        target_logits = target_logits_of(b.last_hidden, head_d, autocast)
        lse_full = (
            full_lse_of(b.last_hidden, head_full, shift_left(b.loss_mask, 1, False), autocast, chunk_tokens)
            if head_full is not None and lk
            else None
        )
    with torch.autocast(b.aux.device.type, dtype=torch.bfloat16, enabled=autocast):
        hiddens = model(b.aux, b.input_ids, b.lengths, steps, logits=False)
    work = torch.bfloat16 if autocast else draft.lm_head.weight.dtype
    losses, correct = [], torch.zeros(steps, dtype=torch.float64, device=b.aux.device)
    for j, hj in enumerate(hiddens):
        m = b.step_mask(j)
        rows, cols = m.nonzero(as_tuple=True)  # the scored columns; the rest only cost memory
        tcols = cols + 1 + j
        am = b.target_argmax[rows, tcols]
        weight = draft.t2d[am].to(torch.float32)  # a target token outside the draft vocab teaches nothing
        with torch.autocast(b.aux.device.type, dtype=torch.bfloat16, enabled=autocast):
            x = draft.norm(hj[rows, cols])
        if lse_full is None:
            loss, guess = linear_soft_ce(
                x, draft.lm_head.weight, target_logits, rows, tcols, weight, chunk_tokens, work
            )
        else:
            loss, guess, _alpha = linear_lk(
                x,
                draft.lm_head.weight,
                target_logits,
                lse_full,
                rows,
                tcols,
                weight,
                chunk_tokens,
                objective,
                kl_scale,
                kl_decay,
                work,
            )
        correct[j] += (draft.draft_to_target(guess) == am).sum()
        losses.append(loss)
    return losses, correct


def target_logits_of(last_hidden: torch.Tensor, head_d: torch.Tensor, autocast: bool) -> torch.Tensor:
    """(B, S, draft vocab): the target's logits over the draft vocabulary, from its stored final hidden."""
    if autocast:
        with torch.autocast(last_hidden.device.type, dtype=torch.bfloat16):
            return last_hidden @ head_d.T
    return last_hidden.float() @ head_d.float().T


def ttt_sums_unchunked(
    model: Any, draft: Eagle3Draft, b: Batch, head_d: torch.Tensor, steps: int, autocast: bool
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`ttt_sums` as first written: every step's full (B, S, Vd) logits kept for backward."""
    with torch.no_grad():
        tgt = target_logits_of(b.last_hidden, head_d, False).log_softmax(-1)  # target over the draft vocab
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


@dataclass(frozen=True)
class TTTLoss:
    """Training-time test: ``sum_j decay**j * L_j`` over ``ttt_steps`` unrolled draft steps, ``L_j`` step
    ``j``'s mean objective (``[train] loss``: the soft-label cross-entropy against the target's distribution,
    or an LK loss on the acceptance rate, :mod:`.lk_loss`), computed ``chunk_tokens`` at a time."""

    ttt_steps: int
    decay: float
    chunk_tokens: int
    autocast: bool
    objective: str = "kl"
    kl_scale: float = 1.0  # lk_adaptive's λ = kl_scale·exp(−kl_decay·ᾱ)
    kl_decay: float = 1.0

    @classmethod
    def from_settings(cls, s: TrainSection, autocast: bool, aux_cols: torch.Tensor | None = None) -> TTTLoss:
        """``aux_cols`` is the method spec's argument: EAGLE-3 reads every stored aux feature."""
        return cls(
            ttt_steps=s.ttt_steps,
            decay=s.loss_decay,
            chunk_tokens=s.loss_chunk_tokens,
            autocast=autocast,
            objective=s.loss,
            kl_scale=s.lk_kl_scale,
            kl_decay=s.lk_kl_decay,
        )

    @property
    def needs_full_head(self) -> bool:
        """The LK losses need the target's whole ``lm_head`` (acceptance is over its whole vocabulary)."""
        return self.objective != "kl"

    def counts(self, batches: list[Batch], device: torch.device) -> torch.Tensor:
        """Per TTT step: the loss positions of these batches (each step's mean divides by it)."""
        return counts_of(batches, self.ttt_steps, device)

    def sums(self, td: TrainedDraft, b: Batch) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Per TTT step: the summed loss over loss positions, and the count of correct greedy tokens."""
        assert isinstance(td.draft, Eagle3Draft)
        return ttt_sums(
            td.model,
            td.draft,
            b,
            td.head_d,
            self.ttt_steps,
            self.autocast,
            self.chunk_tokens,
            objective=self.objective,
            head_full=td.head_full,
            kl_scale=self.kl_scale,
            kl_decay=self.kl_decay,
        )

    def weighted(self, per_step: list[Any], denom: torch.Tensor) -> Any:
        """The objective: each step's mean (over the *global* count of its positions), decayed."""
        return sum((self.decay**j) * per_step[j] / denom[j] for j in range(self.ttt_steps))

    def accept_length(
        self,
        draft: Eagle3Draft,
        data: Any,
        rows: list[int],
        device: torch.device,
        dtype: torch.dtype,
        spec_steps: int,
        micro_batch: int,
    ) -> float:
        """The chain's simulated accept length on held-out ``rows`` (:mod:`.acceptance`)."""
        return simulated_accept_length(
            draft, data, rows, device, dtype, spec_steps, micro_batch, self.autocast
        )
