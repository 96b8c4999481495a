"""The attention rule training-time test and drafting share (:func:`chain_attention`, with a plain reference).

A query of step ``j`` at column ``t`` sees the step-0 keys of every column ``<= t`` (real target features)
plus the keys its own chain produced at steps ``1..j`` (same column): what SGLang's draft KV cache holds during
``--speculative-eagle-topk 1`` decoding, and the mask SpecForge's flex-attention path builds
(``generate_eagle3_mask``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

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
    tests and ``bench/gpu/ttt_memory.py`` compare against (it scores ``(1+j)×`` the keys a query needs).
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
