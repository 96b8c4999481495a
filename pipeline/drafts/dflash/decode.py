"""Drafting with the DFlash draft in the offline speculative decode (:mod:`pipeline.eagle3.spec_decode`): one block per verify step.

Each round the block is the last emitted token followed by ``k`` mask tokens, at the positions right after
the verified context; one forward pass of the draft over it (attending to every context position's projected
target features and to the whole block) gives all ``k`` drafts at once — what SGLang's DFlash worker does with
``--speculative-num-draft-tokens k+1`` (``k + 1`` is its block; the draft's trained ``block_size`` is SGLang's
default, so ``k = block_size - 1`` measures what it serves when the flag is left out). The context's per-layer keys and values are cached and grow by the verified positions of
each round, as SGLang's draft KV cache does.
"""

from __future__ import annotations

import torch

from pipeline.drafts.dflash.config import feature_columns
from pipeline.drafts.dflash.model import DFlashDraft, load_dflash
from pipeline.drafts.registry import DrafterInputs


class DFlashDrafter:
    """The :class:`~pipeline.eagle3.spec_decode.Drafter` of a DFlash draft; ``cols`` picks its target layers
    out of the captured aux features (``None``: all of them, in order)."""

    def __init__(self, draft: DFlashDraft, cols: torch.Tensor | None = None) -> None:
        self.draft = draft.eval()
        self.dev = next(draft.parameters()).device
        self.dtype = next(draft.parameters()).dtype
        self.cols = None if cols is None else cols.to(self.dev)
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ncols = 0
        self.last = 0

    def _extend(self, feats: torch.Tensor) -> None:
        """Append the context K/V of ``feats`` (n, aux) at the next ``n`` positions."""
        f = feats.to(self.dev, self.dtype)
        if self.cols is not None:
            f = f.index_select(-1, self.cols)
        n = f.shape[0]
        pos = torch.arange(self.ncols, self.ncols + n, device=self.dev)[None]
        new = self.draft.context_kv(self.draft.context(f[None]), pos)
        self.kv = (
            new
            if not self.kv
            else [
                (torch.cat([k, k2], 2), torch.cat([v, v2], 2))
                for (k, v), (k2, v2) in zip(self.kv, new, strict=True)
            ]
        )
        self.ncols += n

    @torch.no_grad()
    def start(self, tokens: list[int], feats: torch.Tensor) -> None:
        self.kv, self.ncols, self.last = [], 0, int(tokens[-1])
        self._extend(feats)

    @torch.no_grad()
    def propose(self, k: int) -> list[int]:
        bs = self.draft.cfg.block_size
        if not 1 <= k <= bs - 1:
            raise ValueError(
                f"the DFlash draft was trained on blocks of {bs} ({bs - 1} drafts); [bench] steps is {k} "
                f"(at most {bs - 1}; {bs - 1} is what SGLang serves by default, --speculative-num-draft-tokens {bs})"
            )
        ids = torch.full((1, k + 1), self.draft.cfg.mask_token_id, dtype=torch.long, device=self.dev)
        ids[0, 0] = self.last
        pos = torch.arange(self.ncols, self.ncols + k + 1, device=self.dev)[None]
        hidden = self.draft.blocks(ids, pos, self.kv)
        return [int(t) for t in self.draft.logits(hidden[0, 1 : k + 1]).argmax(-1).tolist()]

    @torch.no_grad()
    def accept(self, n: int, feats: torch.Tensor, new_tokens: list[int]) -> None:
        self._extend(feats)
        self.last = int(new_tokens[-1])


def dflash_drafter(inp: DrafterInputs) -> DFlashDrafter:
    """The saved DFlash draft at ``inp.path`` beside the target (its embedding and LM head), reading its target
    layers out of the aux features the target captures."""
    head = inp.target.head.weight.detach().float()
    draft = load_dflash(inp.path, inp.embed, head, dtype=inp.dtype).to(inp.device)
    return DFlashDrafter(
        draft, feature_columns(inp.aux_layer_ids, draft.cfg.target_layer_ids, draft.cfg.hidden_size)
    )
