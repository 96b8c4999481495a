"""The EAGLE-3 draft model, shaped exactly like SGLang's ``LlamaForCausalLMEagle3`` checkpoint.

One decoder layer (``midlayer``) whose attention reads ``[norm(token embedding) ‖ norm(hidden)]``
(2·hidden in), ``fc`` fusing the target's low/mid/high hidden states (3·hidden → hidden), a final
``norm`` and an ``lm_head`` over the draft vocabulary; ``d2t`` (draft id → target id offset, int64)
and ``t2d`` (bool mask over the target vocabulary) are buffers. Tensor names, config fields and the
layer-id convention follow sglang/srt/models/llama_eagle3.py and SpecForge's
specforge/modeling/draft/llama3_eagle.py; see docs/eagle3.md.

Training-time test (TTT) and drafting share one attention rule, :func:`chain_attention`: a query of
step ``j`` at column ``t`` sees the step-0 keys of every column ``<= t`` (real target features)
plus the keys its own chain produced at steps ``1..j`` (same column). That is what SGLang's draft
KV cache holds during ``--speculative-eagle-topk 1`` decoding, and the mask SpecForge's flex-attention
path builds (``generate_eagle3_mask``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.eagle3.rope import apply_rope, rope_attention_scale, rope_inv_freq
from pipeline.serving import sglang_capture

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# SpecForge's Kimi-K2 / K2.5 draft configs (configs/kimi-k2*-eagle3.json): an MLA target's draft is a
# plain Llama layer with 128-wide heads, as many heads as the target (MHA), the target's dense MLP width.
MLA_DRAFT_HEAD_DIM = 128


class DraftModelError(ValueError):
    """A draft checkpoint or config that cannot be used; names the file and field."""


def default_aux_layers(num_layers: int) -> list[int]:
    """SpecForge's HF-backend default ``[1, L//2-1, L-4]``: the 0-based layers whose *output* is fused.

    SGLang captures the input of layer ``id+1`` (``set_eagle3_layers_to_capture`` adds 1), which is
    the output of layer ``id``; with no ids in the draft config it uses ``[2, L//2, L-3]`` as
    inputs, i.e. these same outputs.
    """
    if num_layers < 5:
        raise DraftModelError(
            f"target has {num_layers} layers; EAGLE-3 needs at least 5 to pick low/mid/high"
        )
    return [1, num_layers // 2 - 1, num_layers - 4]


def normalise_aux_layers(ids: list[int], num_layers: int, where: str = "extract.aux_layers") -> list[int]:
    """The aux layers as SGLang captures them: ascending, each once, in range, three of them.

    SGLang concatenates the captured states in layer order whatever order the draft config lists,
    so a draft trained on ``[26, 1, 14]`` in that order would be fed scrambled features when served.
    """
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DraftModelError(f"{where}: expected a list of layer ids, got {ids!r}")
    for i in ids:
        if not 0 <= i < num_layers:
            raise DraftModelError(
                f"{where}: layer {i} out of range (the target has {num_layers} layers, 0..{num_layers - 1})"
            )
    out = sorted(set(ids))
    if len(out) != 3:
        raise DraftModelError(f"{where}: EAGLE-3 fuses 3 distinct layers (low, mid, high), got {ids!r}")
    return out


def sglang_capture_ids(aux_layer_ids: list[int], architecture: str | None = None) -> list[int]:
    """The layers whose *input* SGLang hooks to feed the outputs of ``aux_layer_ids`` (``id + 1``); raises
    :class:`DraftModelError` where SGLang cannot be told to (see :mod:`pipeline.serving.sglang_capture`)."""
    try:
        ids = sglang_capture.config_layer_ids(aux_layer_ids, architecture)
    except sglang_capture.CaptureError as exc:
        raise DraftModelError(str(exc)) from None
    return sglang_capture.layers_to_capture(ids, architecture)


def is_mla(cfg: Any) -> bool:
    """A DeepSeek-V2/V3-class target (multi-head latent attention: Kimi-K2/K2.5, DeepSeek-V3/R1)."""
    return (
        getattr(cfg, "kv_lora_rank", None) is not None and getattr(cfg, "qk_rope_head_dim", None) is not None
    )


def _target_rope(cfg: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a transformers config of either the 4.x or the 5.x layout."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        rtype = params.get("rope_type", "default")
        scaling = None if rtype == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
        return float(params["rope_theta"]), scaling
    theta = float(getattr(cfg, "rope_theta", 10000.0))
    scaling = getattr(cfg, "rope_scaling", None)
    return theta, (dict(scaling) if scaling else None)


@dataclass
class DraftConfig:
    """What the draft needs; serialised as an SGLang-loadable ``config.json``."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    aux_layer_ids: list[int]
    target_hidden_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # The target's model class as SGLang picks it: its rule for which layers the config's ids capture.
    target_architecture: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_target(cls, cfg: Any, draft_vocab_size: int, aux_layer_ids: list[int]) -> DraftConfig:
        """A draft sized like the target's decoder layer (SpecForge's convention)."""
        arch = sglang_capture.architecture_of(cfg)  # the wrapper's class (Kimi-K2.5), not its text model's
        cfg = getattr(cfg, "text_config", None) or cfg
        arch = arch or sglang_capture.architecture_of(cfg)
        theta, scaling = _target_rope(cfg)
        heads = int(cfg.num_attention_heads)
        if is_mla(cfg):
            # MLA's per-head dims (qk_rope 64 + nope 128, v 128) and its latent KV do not fit a Llama
            # layer: the draft takes SpecForge's Kimi-K2/K2.5 layout (see MLA_DRAFT_HEAD_DIM).
            head_dim, kv_heads = MLA_DRAFT_HEAD_DIM, heads
        else:
            head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
            kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        return cls(
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(cfg.vocab_size),
            draft_vocab_size=int(draft_vocab_size),
            aux_layer_ids=normalise_aux_layers([int(i) for i in aux_layer_ids], int(cfg.num_hidden_layers)),
            target_hidden_size=int(cfg.hidden_size),
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)),
            hidden_act=str(getattr(cfg, "hidden_act", "silu")),
            bos_token_id=getattr(cfg, "bos_token_id", None),
            eos_token_id=getattr(cfg, "eos_token_id", None),
            pad_token_id=getattr(cfg, "pad_token_id", None),
            target_architecture=arch,
        )

    def sglang_config(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """The ``config.json`` SGLang's EAGLE3 loader reads (fields as in SpecForge's draft configs)."""
        out = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            # A tied draft would make SGLang use embed_tokens (full vocab) as the lm_head.
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": dtype,
            "eagle_config": {
                # The ids that make SGLang feed the outputs of aux_layer_ids, by the target's rule.
                "eagle_aux_hidden_state_layer_ids": self.sglang_layer_ids(),
                "use_aux_hidden_state": True,
                # What SGLang hooks for those ids and the target class whose rule that is (Aerie reads the
                # class back to recover aux_layer_ids); the layers are for the operator, not read back.
                "sglang_layers_to_capture": sglang_capture_ids(self.aux_layer_ids, self.target_architecture),
                "target_architecture": self.target_architecture,
            },
        }
        out.update(self.extra)
        return out

    def sglang_layer_ids(self) -> list[int]:
        """``eagle_aux_hidden_state_layer_ids`` for this target (raises where SGLang cannot capture them)."""
        try:
            return sglang_capture.config_layer_ids(self.aux_layer_ids, self.target_architecture)
        except sglang_capture.CaptureError as exc:
            raise DraftModelError(str(exc)) from None

    @classmethod
    def from_sglang_config(cls, d: dict[str, Any], where: str = CONFIG_FILE) -> DraftConfig:
        if ARCHITECTURE not in (d.get("architectures") or []):
            raise DraftModelError(
                f"{where}: architectures is {d.get('architectures')!r}, expected [{ARCHITECTURE!r}]"
            )
        if int(d.get("num_hidden_layers", 1)) != 1:
            raise DraftModelError(
                f"{where}: num_hidden_layers is {d.get('num_hidden_layers')}; only 1 is supported"
            )
        try:
            ids = d["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        except (KeyError, TypeError):
            raise DraftModelError(
                f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids is missing"
            ) from None
        arch = d["eagle_config"].get(
            "target_architecture"
        )  # absent in drafts of other trainers: plus-one rule
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise DraftModelError(
                f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids must be a list of ids"
            )
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "vocab_size",
            "draft_vocab_size",
        ):
            if not isinstance(d.get(key), int):
                raise DraftModelError(f"{where}: {key} must be an integer, got {d.get(key)!r}")
        heads = d["num_attention_heads"]
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            vocab_size=d["vocab_size"],
            draft_vocab_size=d["draft_vocab_size"],
            aux_layer_ids=sglang_capture.fed_outputs([int(i) for i in ids], arch),
            target_hidden_size=int(d.get("target_hidden_size") or d["hidden_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rope_scaling=d.get("rope_scaling"),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            hidden_act=d.get("hidden_act", "silu"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            target_architecture=arch,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


# Extra head dimensions that carry the "sink" key of :func:`chain_attention` (8 keeps head dims a
# multiple of 8, which the fused CUDA kernels want).
_SINK_DIMS = 8


def chain_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    q_cols: torch.Tensor,
    key_valid: torch.Tensor | None = None,
    chain: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention of EAGLE-3 drafting/TTT, computing only the scores it needs.

    ``q`` (B, H, Sq, D) are queries for columns ``q_cols`` (Sq,); ``k0``/``v0`` (B, Hkv, Skv, D) the
    step-0 keys of columns ``0..Skv-1``, visible to a query when their column is ``<=`` its column
    and ``key_valid`` (B, Skv) allows it. ``chain`` holds the keys/values (B, Hkv, Sq, D) that the
    same columns produced at later steps; each query sees only its own column's entries there.

    ``causal=True`` is the TTT layout: ``q_cols`` is ``0..Sq-1`` over the same columns as ``k0``,
    and ``key_valid`` is ignored (in TTT it only hides keys at or after a row's last real column,
    which no query that is scored can see under the causal rule anyway).

    SpecForge's diagonal form (``LlamaAttention`` with ``cache_hidden``): the later steps add one
    score per query, ``q·k_i`` of its own column, to the causal step-0 scores. Instead of the full
    ``(Sq, (1+j)·Skv)`` mask (:func:`chain_attention_reference`), the ``j`` diagonal scores are
    folded into one *sink* key placed first: its score is ``logsumexp_i(q·k_i)`` (carried in
    :data:`_SINK_DIMS` extra head dims, split hi/lo so bf16 keeps it exact) and its value a one-hot
    extra dim, so one fused causal SDPA over ``1 + Skv`` keys returns the step-0 part already
    weighted by the joint softmax plus the diagonal group's total weight ``w``; the output is that
    part + ``w · softmax_i(q·k_i) · v_i``. Exact, differentiable, and no ``(Sq, Skv)`` score matrix is
    materialised where SDPA has a fused kernel.
    """
    chain = chain or []
    b, nh, sq, d = q.shape
    skv = k0.shape[2]
    if causal and sq != skv:
        raise ValueError(f"causal chain attention needs as many queries as step-0 keys ({sq} vs {skv})")
    if k0.shape[1] != nh:  # grouped-query attention
        rep = nh // k0.shape[1]
        k0, v0 = k0.repeat_interleave(rep, dim=1), v0.repeat_interleave(rep, dim=1)
        chain = [(k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)) for k, v in chain]
    mask = None
    if not causal:
        mask = (torch.arange(skv, device=q.device)[None, :] <= q_cols.to(q.device)[:, None])[None, None]
        if key_valid is not None:
            mask = mask & key_valid.to(q.device)[:, None, None, :]
    if not chain:
        if causal:
            return F.scaled_dot_product_attention(q, k0, v0, is_causal=True)
        return F.scaled_dot_product_attention(q, k0, v0, attn_mask=mask)
    scale = d**-0.5
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax statistics in fp32 at least
    diag = torch.stack([(q * k).sum(-1) for k, _ in chain], dim=-1).to(acc) * scale  # (B, H, Sq, J)
    lse = torch.logsumexp(diag, dim=-1)
    w = torch.softmax(diag, dim=-1).to(v0.dtype)
    mix = sum(w[..., i, None] * v for i, (_, v) in enumerate(chain))  # no stacked copy of the values
    dt = q.dtype
    sink_score = lse / scale  # q_aug · sink_key * scale == lse
    # Split on a bf16 boundary whatever q's dtype: SDPA under autocast runs fp32 inputs in bf16, and
    # a bf16 hi plus the small remainder keeps the score to ~2^-16 there (exact in fp32/fp64).
    hi = sink_score.to(torch.bfloat16).to(acc)
    lo = (sink_score - hi).to(dt)
    hi = hi.to(dt)
    pad_q = torch.zeros(b, nh, sq, _SINK_DIMS - 2, dtype=dt, device=q.device)
    q_aug = torch.cat([q, hi[..., None], lo[..., None], pad_q], dim=-1)
    pad_k = torch.zeros(b, nh, skv, _SINK_DIMS, dtype=k0.dtype, device=q.device)
    sink_k = torch.zeros(b, nh, 1, d + _SINK_DIMS, dtype=k0.dtype, device=q.device)
    sink_k[..., d : d + 2] = 1
    sink_v = torch.zeros(b, nh, 1, d + _SINK_DIMS, dtype=v0.dtype, device=q.device)
    sink_v[..., d] = 1
    keys = torch.cat([sink_k, torch.cat([k0, pad_k], dim=-1)], dim=2)
    vals = torch.cat([sink_v, torch.cat([v0, pad_k.to(v0.dtype)], dim=-1)], dim=2)
    if causal:
        from torch.nn.attention.bias import causal_lower_right

        attn_mask: Any = causal_lower_right(sq, skv + 1)  # query t: the sink and step-0 columns 0..t
    else:
        assert mask is not None  # built above whenever the attention is not causal
        sink_ok = torch.ones(*mask.shape[:-1], 1, dtype=torch.bool, device=q.device)
        attn_mask = torch.cat([sink_ok, mask], dim=-1)
    out = F.scaled_dot_product_attention(q_aug, keys, vals, attn_mask=attn_mask, scale=scale)
    return out[..., :d] + out[..., d : d + 1] * mix


def chain_attention_reference(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    q_cols: torch.Tensor,
    key_valid: torch.Tensor | None = None,
    chain: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """The same attention written plainly: every key concatenated, one ``(Sq, (1+j)·Skv)`` boolean mask.

    What Aerie ran before :func:`chain_attention` learnt the sink form; kept as the reference the
    tests and ``bench/ttt_memory.py`` compare against (it scores ``(1+j)×`` the keys a query needs).
    """
    chain = chain or []
    b, _, sq, _ = q.shape
    skv = k0.shape[2]
    allowed = torch.arange(skv, device=q.device)[None, :] <= q_cols.to(q.device)[:, None]  # (Sq, Skv)
    parts_k, parts_v = [k0], [v0]
    masks = [allowed]
    eye = torch.eye(sq, dtype=torch.bool, device=q.device)
    for k, v in chain:
        parts_k.append(k)
        parts_v.append(v)
        masks.append(eye)
    keys = torch.cat(parts_k, dim=2) if len(parts_k) > 1 else k0
    vals = torch.cat(parts_v, dim=2) if len(parts_v) > 1 else v0
    mask = torch.cat(masks, dim=-1)[None, None]  # (1, 1, Sq, K)
    if key_valid is not None:
        extra = torch.ones(b, len(chain) * sq, dtype=torch.bool, device=q.device)
        kv = torch.cat([key_valid.to(q.device), extra], dim=-1)  # (B, K)
        mask = mask & kv[:, None, None, :]
    if keys.shape[1] != q.shape[1]:  # grouped-query attention
        rep = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(rep, dim=1)
        vals = vals.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)


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
        SGLang) and this pass's (k, v).
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
        hidden = self.fc(aux)
        k0v0: tuple[torch.Tensor, torch.Tensor] | None = None
        chain: list[tuple[torch.Tensor, torch.Tensor]] = []
        out = []
        for j in range(steps):
            tok = shift_left(input_ids, 1 + j)
            positions = (cols + 1 + j)[None, :].expand(b, s)
            hidden, kv = self.layer(tok, hidden, positions, cols, k0v0, chain, None, causal=True)
            if k0v0 is None:
                k0v0 = kv
            else:
                chain.append(kv)
            out.append(hidden)
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
