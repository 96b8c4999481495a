"""Rotary position embeddings of the draft, computed as SGLang computes them for the draft's config.

SGLang serves the draft with the rotary embedding that ``get_rope`` builds from its ``config.json``
(``rope_theta`` and ``rope_scaling``: default, linear, llama3, yarn); the draft must train with the
same cos/sin or it learns positions it will never see. ``cfg`` is anything with ``head_dim``,
``rope_theta``, ``rope_scaling`` and ``max_position_embeddings`` (a ``DraftConfig``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")


class RopeError(ValueError):
    """A rope setting the draft cannot reproduce as SGLang would."""


def rope_type(cfg: Any) -> str:
    sc = cfg.rope_scaling or {}
    return str(sc.get("rope_type", sc.get("type", "default"))) if sc else "default"


def _yarn_correction_range(
    beta_fast: float, beta_slow: float, dim: int, base: float, orig_max: int, truncate: bool
) -> tuple[float, float]:
    def dim_for(rotations: float) -> float:
        return (dim * math.log(orig_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(cfg: Any) -> torch.Tensor:
    """The rotary inverse frequencies, computed as SGLang's rotary embedding for the draft config's
    ``rope_scaling`` computes them (sglang/srt/layers/rotary_embedding: base, llama3, yarn)."""
    dim = cfg.head_dim
    sc = cfg.rope_scaling or {}
    rtype = rope_type(cfg)
    if rtype not in SUPPORTED_ROPE:
        raise RopeError(
            f"rope_scaling type {rtype!r} is not supported (supported: {', '.join(SUPPORTED_ROPE)})"
        )
    if rtype == "yarn":
        # YaRNScalingRotaryEmbedding._compute_inv_freq: float32, as SGLang does it.
        factor = float(sc["factor"])
        pos = cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        extra, inter = 1.0 / pos, 1.0 / (factor * pos)
        low, high = _yarn_correction_range(
            float(sc.get("beta_fast", 32)),
            float(sc.get("beta_slow", 1)),
            dim,
            cfg.rope_theta,
            int(sc.get("original_max_position_embeddings", cfg.max_position_embeddings)),
            bool(sc.get("truncate", True)),
        )
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
        mask = (1 - ramp) * float(sc.get("extrapolation_factor", 1))
        return inter * (1 - mask) + extra * mask
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if rtype == "linear":
        inv = inv / float(sc["factor"])
    elif rtype == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(is_mid, mid, scaled)
    return inv.float()


def rope_attention_scale(cfg: Any) -> float:
    """The factor SGLang multiplies cos and sin by: YaRN's ``mscale`` (1 for every other type).

    With ``mscale`` and ``mscale_all_dim`` both given (DeepSeek/Kimi configs) it is their ratio, as in
    transformers; without them, ``0.1 ln(factor) + 1``; times ``attn_factor``.
    """
    if rope_type(cfg) != "yarn":
        return 1.0
    sc = cfg.rope_scaling or {}
    factor = float(sc["factor"])
    if sc.get("mscale") is not None and sc.get("mscale_all_dim") is not None:
        m = _yarn_mscale(factor, float(sc["mscale"])) / _yarn_mscale(factor, float(sc["mscale_all_dim"]))
    else:
        m = _yarn_mscale(factor)
    return m * float(sc.get("attn_factor", 1.0))


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """Rotate ``x`` (B, H, S, D) by ``positions`` (B, S) — the rotate-half (neox) form Llama uses;
    ``scale`` multiplies cos and sin (YaRN's attention scaling)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(x.device)[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * scale)[:, None].to(x.dtype), (emb.sin() * scale)[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin
