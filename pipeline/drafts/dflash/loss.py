"""DFlash's training objective over the same store rows EAGLE-3 trains on: block targets per anchor.

For each row some *anchors* ``a`` are drawn (positions whose next token is an assistant token; at most
``[train] dflash_anchors`` per row, seeded by the row's content so a step's counts are known before its
forward). Anchor ``a`` makes one block: slot 0 is the row's token at ``a``, slots ``1..block_size-1`` are
mask tokens at positions ``a+1..``; the block sees the target's stored hidden states of every position
before ``a`` (its context) and all of its own slots, exactly what SGLang's draft pass sees at a verified
token. Slot ``k`` is trained to predict the row's token at ``a+k`` (cross-entropy through the target's LM
head), where that token is an assistant token inside the row. Slot ``k`` is "step" ``k-1`` of the trainer's
bookkeeping: the loss is ``sum_k decay**(k-1) * mean_k`` with ``decay = exp(-1/gamma)`` (the paper's
position weights ``exp(-(k-1)/gamma)``) and ``acc_{k-1}`` is slot ``k``'s greedy accuracy.

The simulated accept length (acceptance while training) drafts a block at each held-out anchor and counts
the leading slots equal to the target's stored greedy tokens, stopping where the row leaves the target's
greedy path (so it agrees with a real decode where the data is the target's own output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.drafts.acceptance import mean_accept_length
from pipeline.drafts.batch import Batch
from pipeline.drafts.dflash.config import DFlashConfig
from pipeline.drafts.dflash.model import DFlashDraft
from pipeline.drafts.dflash.settings import DFlashSettings
from pipeline.run.plan.sections import TrainSection


def anchors_of(b: Batch, count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors (B, N) long, keep (B, N) bool): up to ``count`` valid anchors per row, ascending.

    Valid: ``a + 1`` is inside the row and an assistant token. Drawn with a generator seeded by the row's
    tokens, so the same batch always gets the same anchors (the step counts positions before its forward).
    """
    mask = b.loss_mask.cpu()
    ids = b.input_ids.cpu()
    rows: list[torch.Tensor] = []
    for r, n in enumerate(b.lengths.cpu().tolist()):
        valid = torch.nonzero(mask[r, 1:n]).flatten()  # a with loss_mask[a + 1]
        if valid.numel() > count:
            g = torch.Generator().manual_seed(seed * 1_000_003 + int(ids[r, :n].sum()) * 31 + n)
            valid = valid[torch.randperm(valid.numel(), generator=g)[:count]].sort().values
        rows.append(valid)
    width = max(1, max(x.numel() for x in rows))
    anchors = torch.zeros(len(rows), width, dtype=torch.long)
    keep = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, x in enumerate(rows):
        anchors[r, : x.numel()], keep[r, : x.numel()] = x, True
    dev = b.input_ids.device
    return anchors.to(dev), keep.to(dev)


def block_inputs(
    b: Batch, anchors: torch.Tensor, keep: torch.Tensor, block_size: int, mask_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot ids (B, N·bs), slot positions (B, N·bs), attention mask (B, 1, N·bs, S + N·bs),
    labels (B, N, bs), label weights (B, N, bs) bool) for the blocks at ``anchors``."""
    bsz, n = anchors.shape
    s = b.input_ids.shape[1]
    dev = anchors.device
    offs = torch.arange(block_size, device=dev)
    pos = anchors[..., None] + offs  # (B, N, bs)
    ids = torch.full((bsz, n, block_size), mask_id, dtype=torch.long, device=dev)
    ids[..., 0] = torch.gather(b.input_ids, 1, anchors)
    q_anchor = anchors.repeat_interleave(block_size, 1)  # (B, Q)
    q_block = torch.arange(n, device=dev).repeat_interleave(block_size)  # (Q,)
    ctx_ok = torch.arange(s, device=dev)[None, None, :] < q_anchor[..., None]  # strictly before the anchor
    own = q_block[:, None] == q_block[None, :]  # every slot of its own block
    mask = torch.cat([ctx_ok, own[None].expand(bsz, -1, -1)], 2)[:, None]
    inside = pos < b.lengths[:, None, None]
    safe = pos.clamp(max=s - 1)
    labels = torch.gather(b.input_ids, 1, safe.flatten(1)).view_as(pos)
    assistant = torch.gather(b.loss_mask, 1, safe.flatten(1)).view_as(pos)
    weights = keep[..., None] & inside & assistant & (offs > 0)
    return ids.flatten(1), pos.flatten(1), mask, labels, weights


def draft_blocks(
    model: Any,
    cfg: DFlashConfig,
    b: Batch,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    aux_cols: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft's final hidden states (B, N, bs, H), the labels and their weights, for ``b``'s blocks;
    ``model`` is the draft or DDP around it (its ``forward`` is the call)."""
    feats = b.aux if aux_cols is None else b.aux.index_select(-1, aux_cols)
    ids, pos, mask, labels, weights = block_inputs(b, anchors, keep, cfg.block_size, cfg.mask_token_id)
    s = b.input_ids.shape[1]
    ctx_pos = torch.arange(s, device=ids.device)[None].expand(ids.shape[0], -1)
    hidden = model(feats, ctx_pos, ids, pos, mask)
    return hidden.view(*anchors.shape, cfg.block_size, -1), labels, weights


@dataclass(frozen=True)
class BlockLoss:
    """The trainer's loss part for DFlash (:class:`~pipeline.drafts.registry.DraftLoss`)."""

    block_size: int
    anchors: int
    gamma: float
    autocast: bool
    seed: int = 0
    aux_cols: torch.Tensor | None = None
    objective: str = "dflash"

    @classmethod
    def from_settings(cls, s: TrainSection, autocast: bool, aux_cols: torch.Tensor | None) -> BlockLoss:
        d = DFlashSettings.of(s)
        return cls(d.dflash_block_size, d.dflash_anchors, d.dflash_loss_gamma, autocast, s.seed, aux_cols)

    @property
    def ttt_steps(self) -> int:
        """Predicted slots per block (the trainer's per-step bookkeeping: slot ``k`` is step ``k-1``)."""
        return self.block_size - 1

    @property
    def decay(self) -> float:
        return math.exp(-1.0 / self.gamma) if self.gamma > 0 else 1.0

    @property
    def needs_full_head(self) -> bool:
        return False

    def _weights(self, b: Batch) -> torch.Tensor:
        anchors, keep = anchors_of(b, self.anchors, self.seed)
        _, _, _, _, w = block_inputs(b, anchors, keep, self.block_size, 0)
        return w

    def counts(self, batches: list[Batch], device: torch.device) -> torch.Tensor:
        """Per slot 1..bs-1: how many (anchor, slot) pairs of these batches are trained."""
        tot = torch.zeros(self.ttt_steps, dtype=torch.float64, device=device)
        for b in batches:
            tot += self._weights(b)[..., 1:].sum((0, 1)).to(device, torch.float64)
        return tot

    def sums(self, td: Any, b: Batch) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Per slot: the summed cross-entropy over trained pairs, and the count of correct greedy tokens."""
        draft: DFlashDraft = td.draft
        anchors, keep = anchors_of(b, self.anchors, self.seed)
        with torch.autocast(b.aux.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            hidden, labels, weights = draft_blocks(td.model, draft.cfg, b, anchors, keep, self.aux_cols)
        losses, correct = [], []
        for k in range(1, self.block_size):
            w = weights[:, :, k]
            h = hidden[:, :, k][w]
            with torch.autocast(b.aux.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                logits = draft.logits(h).float()
            y = labels[:, :, k][w]
            losses.append(F.cross_entropy(logits, y, reduction="sum") if y.numel() else logits.sum() * 0)
            correct.append((logits.argmax(-1) == y).sum().double().detach())
        return losses, torch.stack(correct) if correct else torch.zeros(0, dtype=torch.float64)

    def weighted(self, per_step: list[Any], denom: torch.Tensor) -> Any:
        return sum((self.decay**j) * per_step[j] / denom[j] for j in range(self.ttt_steps))

    def accept_length(
        self,
        draft: DFlashDraft,
        data: Any,
        rows: list[int],
        device: torch.device,
        dtype: torch.dtype,
        spec_steps: int,
        micro_batch: int,
    ) -> float:
        """The blocks' simulated accept length on held-out ``rows``, over this loss's anchors and columns."""
        return dflash_accept_length(
            draft,
            data,
            rows,
            device,
            dtype,
            spec_steps,
            micro_batch,
            self.autocast,
            self.anchors,
            self.aux_cols,
        )


def accept_sums(
    draft: DFlashDraft, b: Batch, spec_steps: int, anchors: int, autocast: bool, aux_cols: torch.Tensor | None
) -> tuple[float, int]:
    """(sum of simulated accept lengths, number of anchors) over one batch, ``spec_steps`` drafts per block."""
    a, keep = anchors_of(b, anchors)
    with torch.no_grad(), torch.autocast(b.aux.device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden, labels, weights = draft_blocks(draft, draft.cfg, b, a, keep, aux_cols)
        guess = draft.logits(hidden[:, :, 1 : spec_steps + 1]).float().argmax(-1)  # (B, N, steps)
    s = b.input_ids.shape[1]
    greedy_pos = (a[..., None] + torch.arange(spec_steps, device=a.device)).clamp(max=s - 1)
    greedy = torch.gather(b.target_argmax, 1, greedy_pos.flatten(1)).view_as(guess)  # target's token at a+k
    row = labels[:, :, 1 : spec_steps + 1]
    alive = keep.clone()
    accepted = torch.ones_like(keep, dtype=torch.float64)
    for k in range(spec_steps):
        alive = alive & weights[:, :, k + 1] & (guess[..., k] == greedy[..., k])
        accepted += alive
        alive = alive & (row[..., k] == greedy[..., k])  # the next slot's context is the row's token
    return float(accepted[keep].sum()), int(keep.sum())


def dflash_accept_length(
    draft: DFlashDraft,
    data: Any,
    rows: list[int],
    device: torch.device,
    dtype: torch.dtype,
    spec_steps: int,
    micro_batch: int,
    autocast: bool,
    anchors: int,
    aux_cols: torch.Tensor | None,
) -> float:
    """Mean simulated accept length of ``draft`` over the anchors of ``rows`` of ``data``."""
    return mean_accept_length(
        draft,
        data,
        rows,
        device,
        dtype,
        micro_batch,
        lambda b: accept_sums(draft, b, spec_steps, anchors, autocast, aux_cols),
    )
