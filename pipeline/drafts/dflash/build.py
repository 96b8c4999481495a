"""The DFlash draft the train stage trains (``[train] draft = "dflash"``): sized from the target, its target
layers chosen among the extraction's aux layers, the target's embedding and LM head loaded beside it."""

from __future__ import annotations

import torch

from pipeline.drafts.dflash.config import DFlashConfig, feature_columns
from pipeline.drafts.dflash.model import DFlashDraft
from pipeline.drafts.dflash.settings import DFlashSettings
from pipeline.eagle3.draft_config import DraftModelError
from pipeline.run.plan.sections import TrainSection


def build_dflash(
    model_id: str, aux: list[int], s: TrainSection, trust_remote_code: bool = False
) -> tuple[DFlashDraft, torch.Tensor | None]:
    """(the draft, the columns of the stored aux features it reads; ``None``: all of them)."""
    from pipeline.eagle3.target_capture import load_target_tensors, target_config

    tcfg = target_config(model_id, trust_remote_code=trust_remote_code)
    text = getattr(tcfg, "text_config", None) or tcfg
    d = DFlashSettings.of(s)
    try:
        cfg = DFlashConfig.from_target(
            tcfg,
            layers=d.dflash_layers,
            target_layer_ids=d.target_layers(aux),
            block_size=d.dflash_block_size,
            mask_token_id=d.mask_token_id(int(text.vocab_size)),
        )
    except DraftModelError as exc:
        raise ValueError(f"[train] dflash_*: {exc}") from None
    cols = feature_columns(aux, cfg.target_layer_ids, cfg.hidden_size)
    torch.manual_seed(s.seed)
    draft = DFlashDraft(cfg)
    t = load_target_tensors(model_id, trust_remote_code=trust_remote_code)
    draft.set_target(t["embed"], t["head"])
    return draft, cols
