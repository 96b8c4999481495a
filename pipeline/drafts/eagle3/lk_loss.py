"""LK losses (arXiv 2602.23881): objectives on the draft's acceptance rate itself, chunked like the soft-label loss.

For a scored position, ``q = softmax(z)`` is the draft's distribution over its vocabulary and ``p`` the
target's probabilities of those same tokens, *not* renormalised (``exp(t - logsumexp over the target's
whole vocabulary)``): a draft that can only propose draft-vocabulary tokens is accepted with probability

    α = Σ_v min(p_v, q_v) = 1 − TV(p, q)        (TV: total variation over the target's vocabulary)

The objectives, per position (``kl`` is :mod:`.head_loss`'s soft-label cross-entropy, unchanged):

* ``lk``:          ``−log α``, whose gradient is TV's scaled by ``1/α``: strong where acceptance is low.
* ``lk_adaptive``: ``λ·CE(p̃, q) + (1 − λ)·(1 − α)`` with ``λ = scale·exp(−decay·ᾱ)`` and ``ᾱ`` the mean
  acceptance of the micro-batch's scored positions at this TTT step, held constant in the gradient
  (stop-gradient): KL dominates while acceptance is low, TV takes over as it rises. ``p̃`` is ``p``
  renormalised over the draft vocabulary, as for ``kl``; cross-entropy differs from KL by the target's
  entropy, a constant, so the gradient is KL's.

These are the definitions SpecForge 0.2.0 implements (``specforge/core/lk_loss.py``: ``alpha`` and
``lambda``, ``kl_scale``/``kl_decay``); the code here is Aerie's own. The gradient w.r.t. the logits is
taken in the forward pass, chunk by chunk, as :mod:`.head_loss` does: with ``m_v = [q_v < p_v]``,
``∂α/∂z = q ⊙ (m − Σ_v m_v q_v)``. ``lk_adaptive`` reads the chunks twice (once for ``ᾱ``, once for the
gradient), one ``lm_head`` product more than ``lk``. Both run eagerly (not compiled) on every device.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.drafts.eagle3.head_loss import _mm_fp32

OBJECTIVES = ("kl", "lk", "lk_adaptive")
# −log α is taken of max(α, ALPHA_FLOOR); below it the position gives no gradient (α = 0 has none).
ALPHA_FLOOR = 1e-6


def acceptance_rows(
    z: torch.Tensor, table: torch.Tensor, lse: torch.Tensor, idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows of draft logits ``z`` (n, Vd): (q, p, p̃, α), in fp32; ``table[idx]`` the target's logits
    over the draft vocabulary and ``lse[idx]`` their log-sum-exp over the target's *whole* vocabulary."""
    q = torch.softmax(z.float(), dim=-1)
    t = table[idx].float()
    p = torch.exp(t - lse[idx].float()[:, None])
    return q, p, torch.softmax(t, dim=-1), torch.minimum(p, q).sum(-1)


def lk_rows(
    z: torch.Tensor,
    table: torch.Tensor,
    lse: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    objective: str,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Σ w·loss, its gradient w.r.t. ``z`` in ``z``'s dtype, argmax of ``z``, Σ w·α) for one chunk of rows;
    ``lam`` is λ for ``lk_adaptive`` (ignored by ``lk``)."""
    q, p, p_renorm, alpha = acceptance_rows(z, table, lse, idx)
    m = (q < p).float()
    g_alpha = q * (m - (m * q).sum(-1, keepdim=True))  # ∂α/∂z
    if objective == "lk":
        a = alpha.clamp_min(ALPHA_FLOOR)
        loss = -torch.log(a)
        grad = -g_alpha * ((alpha > ALPHA_FLOOR).float() / a)[:, None]
    elif objective == "lk_adaptive":
        zf = z.float()
        ce = torch.logsumexp(zf, dim=-1) - (p_renorm * zf).sum(-1)
        loss = lam * ce + (1.0 - lam) * (1.0 - alpha)
        grad = lam * (q - p_renorm) - (1.0 - lam) * g_alpha
    else:
        raise ValueError(f"unknown LK objective {objective!r} (expected one of {OBJECTIVES[1:]})")
    return (loss * w).sum(), (grad * w[:, None]).to(z.dtype), z.float().argmax(-1), (alpha * w).sum()


def adaptive_lambda(mean_alpha: float, scale: float, decay: float) -> float:
    """The KL weight of ``lk_adaptive``: ``scale·exp(−decay·ᾱ)``."""
    return float(scale * torch.exp(torch.tensor(-decay * mean_alpha, dtype=torch.float64)))


class _LinearLK(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        target_logits: torch.Tensor,
        lse_full: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
        w: torch.Tensor,
        chunk: int,
        work: torch.dtype,
        objective: str,
        lam_params: tuple[float, float],
        grads: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        need_x, need_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        with torch.autocast(x.device.type, enabled=False):
            wl, xl = weight.to(work), x.to(work)
            table = target_logits.reshape(-1, target_logits.shape[-1])
            lse = lse_full.reshape(-1)
            flat = rows * target_logits.shape[1] + cols
            n = xl.shape[0]
            lam = 0.0
            if objective == "lk_adaptive":
                # ᾱ first (no gradient), so the one gradient pass below knows λ.
                asum = torch.zeros((), dtype=torch.float64, device=x.device)
                for a in range(0, n, chunk):
                    sl = slice(a, a + chunk)
                    alpha = acceptance_rows(xl[sl] @ wl.T, table, lse, flat[sl])[3]
                    asum += (alpha * w[sl]).sum()
                wsum = float(w.sum())
                lam = adaptive_lambda(float(asum) / wsum if wsum > 0 else 0.0, *lam_params)
            loss = torch.zeros((), dtype=torch.float32, device=x.device)
            alpha_sum = torch.zeros((), dtype=torch.float32, device=x.device)
            guess = torch.empty(n, dtype=torch.long, device=x.device)
            gx = torch.empty_like(xl) if need_x else None
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
            for a in range(0, n, chunk):
                sl = slice(a, a + chunk)
                xc = xl[sl]
                loss_c, gz, guess[sl], alpha_c = lk_rows(
                    xc @ wl.T, table, lse, flat[sl], w[sl], objective, lam
                )
                loss += loss_c
                alpha_sum += alpha_c
                if gx is not None:
                    gx[sl] = gz @ wl
                if gw is not None:
                    gw += _mm_fp32(gz.T, xc)
        ctx.save_for_backward(gx, None if gw is None else gw.to(work))
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.mark_non_differentiable(guess, alpha_sum)
        return loss, guess, alpha_sum

    @staticmethod
    def backward(
        ctx: Any, g: torch.Tensor, _guess: torch.Tensor, _alpha: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        gx, gw = ctx.saved_tensors
        xd, wd = ctx.dtypes
        dx = None if gx is None else (gx.float() * g).to(xd)
        dw = None if gw is None else (gw.float() * g).to(wd)
        return dx, dw, None, None, None, None, None, None, None, None, None, None


def linear_lk(
    x: torch.Tensor,
    weight: torch.Tensor,
    target_logits: torch.Tensor,
    lse_full: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    w: torch.Tensor,
    chunk_tokens: int,
    objective: str,
    kl_scale: float = 1.0,
    kl_decay: float = 1.0,
    work: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Σ over the rows of ``x`` of ``w``·LK loss, the draft ids of ``argmax x Wᵀ``, Σ ``w``·α).

    As :func:`~pipeline.drafts.eagle3.head_loss.linear_soft_ce`, plus ``lse_full`` (B, S): the
    log-sum-exp of the target's logits over its whole vocabulary at each position. ``chunk_tokens`` ≤ 0:
    one chunk. Differentiable in ``x`` and ``weight``.
    """
    if objective not in OBJECTIVES[1:]:
        raise ValueError(f"unknown LK objective {objective!r} (expected one of {OBJECTIVES[1:]})")
    chunk = int(chunk_tokens) if chunk_tokens > 0 else max(int(x.shape[0]), 1)
    return _LinearLK.apply(
        x,
        weight,
        target_logits,
        lse_full,
        rows,
        cols,
        w,
        chunk,
        work or weight.dtype,
        objective,
        (float(kl_scale), float(kl_decay)),
        torch.is_grad_enabled(),
    )


def full_lse_of(
    last_hidden: torch.Tensor, head: torch.Tensor, needed: torch.Tensor, autocast: bool, chunk_tokens: int
) -> torch.Tensor:
    """(B, S) fp32: log-sum-exp of the target's logits over its whole vocabulary (``head``: its ``lm_head``)
    at the ``needed`` positions (bool, B × S), ``chunk_tokens`` at a time; ``+inf`` elsewhere, so a
    position read by mistake has target probability 0. Products in bf16 under autocast, as the target's
    draft-vocabulary logits are taken."""
    b, s, h = last_hidden.shape
    out = torch.full((b * s,), float("inf"), dtype=torch.float32, device=last_hidden.device)
    where = needed.reshape(-1).nonzero(as_tuple=True)[0]
    flat = last_hidden.reshape(-1, h)
    step = chunk_tokens if chunk_tokens > 0 else max(int(where.numel()), 1)
    work = torch.bfloat16 if autocast else torch.float32
    hw = head.to(work)
    for a in range(0, int(where.numel()), step):
        ix = where[a : a + step]
        out[ix] = torch.logsumexp((flat[ix].to(work) @ hw.T).float(), dim=-1)
    return out.view(b, s)
