"""The draft's ``lm_head`` and its soft-label cross-entropy as one autograd function, gradients taken in the forward pass.

Per chunk of scored tokens: the logits ``z = x Wᵀ`` (in the working dtype), then in fp32 the
log-sum-exp, the target's softmax ``p`` over the draft vocabulary, the loss ``Σ w·(lse − p·z)``
(``= −Σ w·p·log_softmax(z)``, since ``p`` sums to one) and at once its gradient
``∂/∂z = w·(softmax(z) − p)``, from which the chunk's ``∂/∂x`` and its share of ``∂/∂W`` are taken.
Nothing of (tokens × vocab) outlives its chunk; what backward gets is ``∂x`` (tokens × hidden) and
``∂W`` (vocab × hidden, in the working dtype), which it scales by the incoming gradient. Against
running the chunk under activation checkpointing, this does one ``lm_head`` product fewer per TTT
step (no recomputed forward) and a handful of elementwise passes over the logits instead of a dozen.
This is the idea of Liger-Kernel's fused linear cross-entropy, written here for soft labels.

On CUDA the fp32 elementwise part is compiled by ``torch.compile`` into fused kernels (set
``AERIE_EAGER_LOSS=1`` to run it eagerly); elsewhere it runs eagerly. Both are the same function.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

RowsFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]


def soft_ce_rows(
    z: torch.Tensor, table: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows of draft logits ``z``, their target logits ``table[idx]`` (same vocabulary; gathered here,
    so that compiled, the gather is part of the fused kernels) and row weights ``w``:
    (Σ w·CE(softmax target, z) in fp32, its gradient w.r.t. ``z`` in ``z``'s dtype, argmax of ``z``)."""
    zf = z.float()
    lse = torch.logsumexp(zf, dim=-1)
    p = torch.softmax(table[idx].float(), dim=-1)
    ce = lse - (p * zf).sum(-1)
    grad = (torch.exp(zf - lse[:, None]) - p) * w[:, None]
    return (ce * w).sum(), grad.to(z.dtype), zf.argmax(-1)


_compiled: RowsFn | None = None  # built on first CUDA use; soft_ce_rows itself once compiling has failed


def rows_fn_for(device: torch.device) -> RowsFn:
    """:func:`soft_ce_rows`, compiled on CUDA unless ``AERIE_EAGER_LOSS=1``."""
    global _compiled
    if device.type != "cuda" or os.environ.get("AERIE_EAGER_LOSS") == "1":
        return soft_ce_rows
    if _compiled is None:
        _compiled = torch.compile(soft_ce_rows, dynamic=True)
    return _compiled


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` accumulated and returned in fp32 (bf16 inputs on CUDA: without an fp32 copy of either)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            pass
    return (a @ b).float()


class _LinearSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        target_logits: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
        w: torch.Tensor,
        chunk: int,
        work: torch.dtype,
        rows_fn: RowsFn,
        grads: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # needs_input_grad stays True under no_grad; ``grads`` is the caller's grad mode
        need_x, need_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        with torch.autocast(x.device.type, enabled=False):
            wl, xl = weight.to(work), x.to(work)
            table = target_logits.reshape(-1, target_logits.shape[-1])
            flat = rows * target_logits.shape[1] + cols
            n = xl.shape[0]
            loss = torch.zeros((), dtype=torch.float32, device=x.device)
            guess = torch.empty(n, dtype=torch.long, device=x.device)
            gx = torch.empty_like(xl) if need_x else None
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
            for a in range(0, n, chunk):
                sl = slice(a, a + chunk)
                xc = xl[sl]
                loss_c, gz, guess[sl] = rows_fn(xc @ wl.T, table, flat[sl], w[sl])
                loss += loss_c
                if gx is not None:
                    gx[sl] = gz @ wl
                if gw is not None:
                    gw += _mm_fp32(gz.T, xc)
        ctx.save_for_backward(gx, None if gw is None else gw.to(work))
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.mark_non_differentiable(guess)
        return loss, guess

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _guess: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gx, gw = ctx.saved_tensors
        xd, wd = ctx.dtypes
        dx = None if gx is None else (gx.float() * g).to(xd)
        dw = None if gw is None else (gw.float() * g).to(wd)
        return dx, dw, None, None, None, None, None, None, None, None


def linear_soft_ce(
    x: torch.Tensor,
    weight: torch.Tensor,
    target_logits: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    w: torch.Tensor,
    chunk_tokens: int,
    work: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ over the ``n`` rows of ``x`` of ``w``·CE, the draft ids of ``argmax x Wᵀ``).

    ``x``: (n, hidden), the normed draft hidden states; ``weight``: the ``lm_head`` (draft vocab ×
    hidden); row ``i``'s soft labels are ``softmax(target_logits[rows[i], cols[i]])``; ``w``: (n,) fp32
    row weights (0 scores nothing). ``work``: the dtype of the products (bf16 under autocast; default
    ``weight``'s). Differentiable in ``x`` and ``weight``.
    """
    global _compiled
    work = work or weight.dtype
    fn = rows_fn_for(x.device)
    chunk = max(int(chunk_tokens), 1)
    grads = torch.is_grad_enabled()
    if fn is not soft_ce_rows:
        try:
            return _LinearSoftCE.apply(x, weight, target_logits, rows, cols, w, chunk, work, fn, grads)
        except torch.cuda.OutOfMemoryError:
            raise  # the stage's OOM handling must see it; eager would not fit either
        except Exception as exc:  # noqa: BLE001 - a compiler failure must not stop training; it costs speed
            warnings.warn(
                f"compiled soft-label loss failed ({type(exc).__name__}: {exc}); running it eagerly",
                stacklevel=2,
            )
            _compiled = soft_ce_rows
    return _LinearSoftCE.apply(x, weight, target_logits, rows, cols, w, chunk, work, soft_ce_rows, grads)
