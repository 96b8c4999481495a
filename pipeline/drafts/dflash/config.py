"""The DFlash draft's configuration, serialised as the ``config.json`` SGLang's DFlash loader reads.

DFlash (block diffusion drafting, arXiv 2602.06036) drafts a whole block in one forward pass. What the
pinned SGLang (0.5.14: ``sglang/srt/models/dflash.py`` and ``speculative/dflash_utils.py``) reads:
``architectures = ["DFlashDraftModel"]``; the draft's layer shape (``hidden_size`` etc.: the target's,
since the draft borrows the target's embedding and LM head); ``block_size`` (top level; also the default
``--speculative-num-draft-tokens``); ``dflash_config.target_layer_ids`` — the 0-based target layers whose
*outputs* are concatenated as context features (SGLang hooks the input of ``id + 1``, the same rule as
Aerie's aux layers, so the ids are the extraction's aux layer ids) — and ``dflash_config.mask_token_id``,
the id whose embedding fills the block's not-yet-known slots (it must be inside the target's vocabulary:
without it SGLang adds a ``<|MASK|>`` token to the tokenizer, which a target with no spare rows rejects).
``model_type`` is ``qwen3`` as in SpecForge's and z-lab's DFlash checkpoints (per-head q/k RMSNorm).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from pipeline.eagle3.draft_config import DraftModelError, _target_rope, parse_layer_shape

ARCHITECTURE = "DFlashDraftModel"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def check_target_layers(ids: list[int], num_layers: int, where: str) -> list[int]:
    """Layer ids as SGLang concatenates them: distinct, ascending, in range (it captures in layer order)."""
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DraftModelError(f"{where}: expected a non-empty list of layer ids, got {ids!r}")
    for i in ids:
        if not 0 <= i < num_layers:
            raise DraftModelError(
                f"{where}: layer {i} out of range (the target has {num_layers} layers, 0..{num_layers - 1})"
            )
    if list(ids) != sorted(set(ids)):
        raise DraftModelError(
            f"{where}: {ids!r} must be distinct and ascending (SGLang concatenates them in layer order)"
        )
    return list(ids)


@dataclass
class DFlashConfig:
    """What the DFlash draft needs (every shape but the layer count is the target's)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_hidden_layers: int  # draft layers
    num_target_layers: int
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"

    @classmethod
    def from_target(
        cls, cfg: Any, *, layers: int, target_layer_ids: list[int], block_size: int, mask_token_id: int
    ) -> DFlashConfig:
        cfg = getattr(cfg, "text_config", None) or cfg
        heads = int(cfg.num_attention_heads)
        n = int(cfg.num_hidden_layers)
        theta, scaling = _target_rope(cfg)
        vocab = int(cfg.vocab_size)
        if not 0 <= mask_token_id < vocab:
            raise DraftModelError(
                f"mask token id {mask_token_id} is outside the target's vocabulary (0..{vocab - 1})"
            )
        if str(getattr(cfg, "hidden_act", "silu")) != "silu":
            raise DraftModelError(f"SGLang's DFlash MLP is SiLU only; the target uses {cfg.hidden_act!r}")
        return cls(
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            vocab_size=vocab,
            num_hidden_layers=int(layers),
            num_target_layers=n,
            target_layer_ids=check_target_layers(list(target_layer_ids), n, "dflash target layers"),
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)),
        )

    def sglang_config(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """``config.json`` for SGLang's ``DFlashDraftModel`` (keys as ``parse_dflash_draft_config`` reads them)."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "torch_dtype": dtype,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
                "block_size": self.block_size,
            },
        }

    @classmethod
    def from_sglang_config(cls, d: dict[str, Any], where: str = CONFIG_FILE) -> DFlashConfig:
        shape = parse_layer_shape(d, ARCHITECTURE, ("num_hidden_layers",), where)
        dc = d.get("dflash_config") or {}
        if not isinstance(dc.get("target_layer_ids"), list) or not isinstance(dc.get("mask_token_id"), int):
            raise DraftModelError(f"{where}: dflash_config needs target_layer_ids (a list) and mask_token_id")
        return cls(
            **shape,
            num_target_layers=int(d.get("num_target_layers") or max(dc["target_layer_ids"]) + 1),
            target_layer_ids=[int(i) for i in dc["target_layer_ids"]],
            block_size=int(dc.get("block_size", d.get("block_size", 16))),
            mask_token_id=int(dc["mask_token_id"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def feature_columns(
    aux_layer_ids: list[int], target_layer_ids: list[int], hidden: int
) -> torch.Tensor | None:
    """Columns of the stored aux features (aux layers concatenated) that hold the draft's target layers;
    ``None`` when they are all of them in order."""
    if list(aux_layer_ids) == list(target_layer_ids):
        return None
    missing = [i for i in target_layer_ids if i not in aux_layer_ids]
    if missing:
        raise ValueError(
            f"train.dflash_target_layers: layers {missing} were not captured by the extraction "
            f"(it stored {aux_layer_ids}); set extract.aux_layers to include them and extract again"
        )
    return torch.cat(
        [torch.arange(h * hidden, (h + 1) * hidden) for h in map(aux_layer_ids.index, target_layer_ids)]
    )
