"""The DFlash draft model, shaped exactly like SGLang's ``DFlashDraftModel`` checkpoint, and its save/load.

A block of ``block_size`` slots — the last verified token, then ``block_size - 1`` mask tokens (embedded
with the target's embedding) — runs through ``num_hidden_layers`` Qwen3-style decoder layers in one pass;
slot ``k`` predicts the token ``k`` places after the block's first, through the target's LM head. Every
layer's attention reads two kinds of keys: the *context* — the target's hidden states at the chosen layers
for every position before the block, concatenated, projected by ``fc`` and normed by ``hidden_norm`` (the
same projected context for every layer, K/V-projected without the layer's input norm, as SGLang's
``kv_proj_only`` does) — and the block's own slots, all of them (no causal mask inside a block). Keys get the
per-head ``k_norm`` then RoPE at their absolute positions; queries ``q_norm`` then RoPE.

Saved tensors are ``layers.*``, ``fc.weight``, ``hidden_norm.weight`` and ``norm.weight``; the embedding
and LM head are the target's (held here frozen, never saved). Config: :mod:`.config`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.drafts.dflash.config import CONFIG_FILE, WEIGHTS_FILE, DFlashConfig
from pipeline.eagle3.draft_config import DraftModelError
from pipeline.eagle3.draft_model import RMSNorm
from pipeline.eagle3.rope import apply_rope, rope_attention_scale, rope_inv_freq


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.nh * d, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * d, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * d, bias=False)
        self.o_proj = nn.Linear(self.nh * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def keys(
        self, x: torch.Tensor, pos: torch.Tensor, rope: tuple[torch.Tensor, float]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V of ``x`` (B, S, H) at ``pos`` (B, S): (B, nkv, S, d) each."""
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.nkv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.nkv, self.d).transpose(1, 2)
        return apply_rope(k, pos, rope[0], rope[1]), v

    def forward(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        ctx_kv: tuple[torch.Tensor, torch.Tensor],
        rope: tuple[torch.Tensor, float],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.nh, self.d)).transpose(1, 2)
        q = apply_rope(q, pos, rope[0], rope[1])
        kb, vb = self.keys(x, pos, rope)
        k, v = torch.cat([ctx_kv[0], kb], 2), torch.cat([ctx_kv[1], vb], 2)
        if self.nkv != self.nh:
            k, v = (t.repeat_interleave(self.nh // self.nkv, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.nh * self.d))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DFlashMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        ctx_kv: tuple[torch.Tensor, torch.Tensor],
        rope: tuple[torch.Tensor, float],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), pos, ctx_kv, rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """The draft; ``embed_tokens`` and ``lm_head`` are the target's, frozen and not saved."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        for frozen in (self.embed_tokens.weight, self.lm_head.weight):
            frozen.requires_grad_(False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.rope_scale = rope_attention_scale(cfg)

    def set_target(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        """The target's input embedding and LM head (the embedding again when tied)."""
        if embed.shape != self.embed_tokens.weight.shape or head.shape != self.lm_head.weight.shape:
            raise DraftModelError(
                f"target embedding {tuple(embed.shape)} / head {tuple(head.shape)} do not match the draft "
                f"({self.cfg.vocab_size} x {self.cfg.hidden_size})"
            )
        self.embed_tokens.weight.data.copy_(embed)
        self.lm_head.weight.data.copy_(head)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What the checkpoint holds: everything but the target's embedding and head (and RoPE's buffer)."""
        skip = ("embed_tokens.", "lm_head.", "inv_freq")
        return {k: v for k, v in self.state_dict().items() if not k.startswith(skip)}

    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(features))``: the context every layer reads (B, S, H) from (B, S, K·H)."""
        return self.hidden_norm(self.fc(feats))

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K/V of the projected context at ``pos`` (what SGLang writes to the draft KV cache)."""
        rope = (self.inv_freq, self.rope_scale)
        return [layer.self_attn.keys(ctx, pos, rope) for layer in self.layers]

    def blocks(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final-normed hidden states (B, Q, H) of block slots ``ids`` (B, Q) at ``pos`` (B, Q)."""
        x = self.embed_tokens(ids).to(ctx_kv[0][0].dtype) if ctx_kv else self.embed_tokens(ids)
        rope = (self.inv_freq, self.rope_scale)
        for layer, kv in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, pos, kv, rope, mask)
        return self.norm(x)

    def forward(
        self,
        feats: torch.Tensor,
        ctx_pos: torch.Tensor,
        ids: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Blocks ``ids`` at ``pos`` over the context ``feats`` (B, S, K·H) at ``ctx_pos``: hidden (B, Q, H)."""
        return self.blocks(ids, pos, self.context_kv(self.context(feats), ctx_pos), mask)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def save_dflash(model: DFlashDraft, path: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``config.json`` + ``model.safetensors`` as SGLang's DFlash loader expects."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().to(dtype).contiguous() for k, v in model.trainable_state().items()}
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    dname = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    (path / CONFIG_FILE).write_text(json.dumps(model.cfg.sglang_config(dname), indent=2) + "\n")


def load_dflash(
    path: Path, embed: torch.Tensor, head: torch.Tensor, dtype: torch.dtype = torch.float32
) -> DFlashDraft:
    """Load a saved DFlash draft beside the target's embedding and LM head."""
    from safetensors.torch import load_file

    path = Path(path)
    cfile = path / CONFIG_FILE
    try:
        cfg = DFlashConfig.from_sglang_config(json.loads(cfile.read_text()), str(cfile))
    except FileNotFoundError:
        raise DraftModelError(f"{cfile}: missing (not a DFlash draft directory)") from None
    model = DFlashDraft(cfg)
    model.set_target(embed, head)
    state = load_file(str(path / WEIGHTS_FILE))
    missing = set(model.trainable_state()) - set(state)
    extra = set(state) - set(model.trainable_state())
    if missing or extra:
        raise DraftModelError(f"{path / WEIGHTS_FILE}: missing {sorted(missing)}, unexpected {sorted(extra)}")
    model.load_state_dict(state, strict=False)
    return model.to(dtype)
