"""The EAGLE-3 draft model, shaped exactly like SGLang's ``LlamaForCausalLMEagle3`` checkpoint.

One decoder layer (``midlayer``) whose attention reads ``[norm(token embedding) ‖ norm(hidden)]``
(2·hidden in), ``fc`` fusing the target's low/mid/high hidden states (3·hidden → hidden), a final
``norm`` and an ``lm_head`` over the draft vocabulary; ``d2t`` (draft id → target id offset, int64)
and ``t2d`` (bool mask over the target vocabulary) are buffers. EAGLE-3.1's two switches (config
``fc_norm``, ``norm_output``) add a per-state RMSNorm before ``fc`` and feed the next draft step the
normed hidden; both as SGLang builds them. Tensor names, config fields and the
layer-id convention follow sglang/srt/models/llama_eagle3.py and SpecForge's
specforge/modeling/draft/llama3_eagle.py; see docs/eagle3.md.

Its configuration is :mod:`.draft_config`; the attention rule training-time test and drafting share is
:mod:`.draft_attention`; this module holds the layers, the model and its checkpoint (save/load).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.eagle3.draft_attention import chain_attention, chain_attention_reference
from pipeline.eagle3.draft_config import (
    ARCHITECTURE,
    CONFIG_FILE,
    MLA_DRAFT_HEAD_DIM,
    WEIGHTS_FILE,
    DraftConfig,
    DraftModelError,
    default_aux_layers,
    is_mla,
    normalise_aux_layers,
    sglang_capture_ids,
)
from pipeline.eagle3.rope import apply_rope, rope_attention_scale, rope_inv_freq

# The configuration's names stay importable from here (callers written before the split).
__all__ = [
    "ARCHITECTURE",
    "CONFIG_FILE",
    "MLA_DRAFT_HEAD_DIM",
    "WEIGHTS_FILE",
    "DraftConfig",
    "DraftModelError",
    "Eagle3Draft",
    "chain_attention",
    "chain_attention_reference",
    "default_aux_layers",
    "is_mla",
    "load_draft",
    "normalise_aux_layers",
    "save_draft",
    "sglang_capture_ids",
    "shift_left",
]


# ------------------------------------------------------------------------------ layers
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.rope_scale = rope_attention_scale(cfg)

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, s, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return (
            apply_rope(q, positions, self.inv_freq, self.rope_scale),
            apply_rope(k, positions, self.inv_freq, self.rope_scale),
            v,
        )


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise DraftModelError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """SGLang's EAGLE3 ``LlamaDecoderLayer``: residual is the hidden input, attention over both halves."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Eagle3Draft(nn.Module):
    """The draft. ``embed_tokens`` is the target's (frozen, not saved: SGLang shares the target's)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        # EAGLE-3.1 fc_norm: one RMSNorm per fused target state (low, mid, high), before fc.
        self.fc_norm = (
            nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3))
            if cfg.fc_norm
            else None
        )
        self.midlayer = DraftDecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    # -- pieces ------------------------------------------------------------------------------
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise DraftModelError(
                f"vocab mapping shapes d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not "
                f"match the draft ({self.cfg.draft_vocab_size} / {self.cfg.vocab_size})"
            )
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """SGLang's hot-token map: ``target id = draft id + d2t[draft id]``."""
        return draft_ids + self.d2t[draft_ids]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's fused low/mid/high states (…, 3·H) → the draft's hidden: ``fc``, after each state's
        own RMSNorm under EAGLE-3.1 ``fc_norm`` (SGLang's ``LlamaModel.forward``: chunk, norm, concat)."""
        if self.fc_norm is not None:
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(3, dim=-1), strict=True)], dim=-1)
        return self.fc(aux)

    def carry(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a draft step hands the next one: its pre-norm output, or under EAGLE-3.1 ``norm_output`` the
        final-normed one (SGLang's ``aux = hidden_states_to_logits if norm_output else hidden_states_to_aux``).
        The logits are ``lm_head(norm(h))`` either way."""
        return self.norm(hidden) if self.cfg.norm_output else hidden

    def layer(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        q_cols: torch.Tensor,
        k0v0: tuple[torch.Tensor, torch.Tensor] | None,
        chain: list[tuple[torch.Tensor, torch.Tensor]],
        key_valid: torch.Tensor | None,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
        causal: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One pass of the decoder layer for the columns ``q_cols``.

        ``k0v0=None`` means this *is* a step-0 pass: its keys extend the step-0 keys of the columns
        before it (``prefix``, the draft's KV cache when drafting). Otherwise ``k0v0`` are the step-0
        keys and ``chain`` this chain's keys of the steps before. ``causal``: the TTT layout (see
        :func:`chain_attention`). Returns the pre-norm hidden (what the next step consumes, as in
        SGLang; :meth:`carry` gives what it actually feeds on) and this pass's (k, v).
        """
        m = self.midlayer
        emb = self.embed_tokens(token_ids).to(hidden.dtype)
        x = torch.cat([m.input_layernorm(emb), m.hidden_norm(hidden)], dim=-1)
        q, k, v = m.self_attn.qkv(x, positions)
        if k0v0 is None:
            kk, vv = (
                (k, v) if prefix is None else (torch.cat([prefix[0], k], 2), torch.cat([prefix[1], v], 2))
            )
            attn = chain_attention(q, kk, vv, q_cols, key_valid, causal=causal)
        else:
            attn = chain_attention(q, k0v0[0], k0v0[1], q_cols, key_valid, [*chain, (k, v)], causal=causal)
        b, _, s, _ = attn.shape
        attn = attn.transpose(1, 2).reshape(b, s, -1)
        h = hidden + m.self_attn.o_proj(attn)
        h = h + m.mlp(m.post_attention_layernorm(h))
        return h, (k, v)

    def ttt(
        self, aux: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """Training-time test over ``steps``: the draft logits (B, S, Vd) of each step.

        Column ``t`` starts from the target feature ``f_t`` and token ``x_{t+1}``; step ``j`` reads
        ``x_{t+1+j}`` and its previous output, at position ``t+1+j``, and predicts ``x_{t+2+j}``.
        Columns at or after a row's last real column (``lengths - 1``) hold no meaningful output.
        """
        return [self.logits(h) for h in self.ttt_hidden(aux, input_ids, lengths, steps)]

    def ttt_hidden(
        self, aux: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """:meth:`ttt` before the final norm and ``lm_head``: the (B, S, H) hidden of each step.

        The training loss applies the head itself, a chunk of tokens at a time, so the
        (tokens × draft vocab) logits of all steps never exist at once.
        """
        b, s, _ = aux.shape
        dev = aux.device
        cols = torch.arange(s, device=dev)
        # Causal attention: keys past a row's last real column (which needs x_{t+1}) are never seen by
        # a column that is scored, so TTT needs no per-row key mask (see chain_attention).
        hidden = self.project(aux)
        k0v0: tuple[torch.Tensor, torch.Tensor] | None = None
        chain: list[tuple[torch.Tensor, torch.Tensor]] = []
        out = []
        for j in range(steps):
            tok = shift_left(input_ids, 1 + j)
            positions = (cols + 1 + j)[None, :].expand(b, s)
            h, kv = self.layer(tok, hidden, positions, cols, k0v0, chain, None, causal=True)
            if k0v0 is None:
                k0v0 = kv
            else:
                chain.append(kv)
            out.append(h)
            hidden = self.carry(h)
        return out

    def forward(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        lengths: torch.Tensor,
        steps: int,
        logits: bool = True,
    ) -> list[torch.Tensor]:
        """Training forward (what DDP wraps): :meth:`ttt`, or :meth:`ttt_hidden` with ``logits=False``."""
        if logits:
            return self.ttt(aux, input_ids, lengths, steps)
        return self.ttt_hidden(aux, input_ids, lengths, steps)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The tensors SGLang loads: everything except the (shared, frozen) embedding."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}


def shift_left(x: torch.Tensor, n: int, fill: int | float = 0) -> torch.Tensor:
    """``out[:, t] = x[:, t+n]``; positions past the end get ``fill``."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


# ------------------------------------------------------------------------------ checkpoint
def save_draft(model: Eagle3Draft, path: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``config.json`` + ``model.safetensors`` as SGLang's EAGLE3 loader expects (no embed)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, v in model.trainable_state().items():
        v = v.detach().cpu()
        tensors[k] = v.to(dtype).contiguous() if v.is_floating_point() else v.contiguous()
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    dname = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    (path / CONFIG_FILE).write_text(json.dumps(model.cfg.sglang_config(dname), indent=2) + "\n")


def load_draft(
    path: Path, embed: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> Eagle3Draft:
    """Load a saved draft; ``embed`` is the target's embedding matrix (SGLang's ``set_embed``)."""
    from safetensors.torch import load_file

    path = Path(path)
    cfile = path / CONFIG_FILE
    try:
        cfg = DraftConfig.from_sglang_config(json.loads(cfile.read_text()), str(cfile))
    except FileNotFoundError:
        raise DraftModelError(f"{cfile}: missing (not a draft checkpoint)") from None
    model = Eagle3Draft(cfg)
    wfile = path / WEIGHTS_FILE
    if not wfile.is_file():
        raise DraftModelError(f"{wfile}: missing")
    state = load_file(str(wfile))
    expected = set(model.trainable_state())
    missing, unknown = expected - set(state), set(state) - expected - {"embed_tokens.weight"}
    if missing or unknown:
        raise DraftModelError(f"{wfile}: missing tensors {sorted(missing)}, unexpected {sorted(unknown)}")
    model.load_state_dict(state, strict=False)
    if embed is not None:
        model.embed_tokens.weight.data.copy_(embed)
    elif "embed_tokens.weight" not in state:
        raise DraftModelError(f"{wfile}: no embed_tokens in the checkpoint; pass the target's embedding")
    return model.to(dtype)
