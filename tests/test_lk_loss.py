"""LK losses (issue 27, item 3): ``[train] loss = "lk"`` (−log acceptance) and ``"lk_adaptive"`` (the KL/TV blend).

The reference values here are computed from the definitions (arXiv 2602.23881): acceptance ``α = Σ min(p, q)``
over the target's whole vocabulary, ``TV = ½ Σ |p − q|``, ``−log α``; gradients against float64 autograd of
those definitions; masking against the soft-label loss the trainer has always used.
"""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.drafts.batch import Batch
from pipeline.drafts.eagle3.head_loss import linear_soft_ce
from pipeline.drafts.eagle3.lk_loss import adaptive_lambda, linear_lk
from pipeline.drafts.eagle3.loss import TTTLoss, ttt_sums
from pipeline.drafts.registry import TrainedDraft
from pipeline.run.plan.sections import TrainSection
from pipeline.stages.train.components import Optimiser
from tests.test_eagle3_model import tiny_draft
from tests.test_train_loss import batch

# Target over a 4-token vocabulary; the draft's vocabulary is its first 3 tokens.
P_FULL = torch.tensor([0.5, 0.2, 0.1, 0.2], dtype=torch.float64)
Q_DRAFT = torch.tensor([0.3, 0.6, 0.1], dtype=torch.float64)


def tv_by_definition(p_full: torch.Tensor, q_draft: torch.Tensor) -> float:
    """½ Σ |p − q| over the target's vocabulary; the draft puts no mass outside its own."""
    q_full = torch.zeros_like(p_full)
    q_full[: q_draft.numel()] = q_draft
    return 0.5 * float((p_full - q_full).abs().sum())


def one_row(objective: str, **kw: float) -> tuple[float, float]:
    """(loss, Σα) of :func:`linear_lk` on the explicit pair: logits log q, target logits log p (+ a constant)."""
    z = Q_DRAFT.log().float()[None]  # draft logits = x @ I
    t = (P_FULL.log() + 3.0).float()  # any constant: the target's log-sum-exp removes it
    loss, _guess, alpha = linear_lk(
        z,
        torch.eye(3),
        t[:3].view(1, 1, 3),
        torch.logsumexp(t, 0).view(1, 1),
        torch.tensor([0]),
        torch.tensor([0]),
        torch.ones(1),
        4,
        objective,
        **kw,
    )
    return float(loss), float(alpha)


def test_lk_losses_equal_their_definitions_on_an_explicit_pair() -> None:
    tv = tv_by_definition(P_FULL, Q_DRAFT)
    assert tv == pytest.approx(0.4)  # ½(0.2 + 0.4 + 0 + 0.2)
    loss, alpha = one_row("lk")
    assert alpha == pytest.approx(1 - tv, abs=1e-6)  # acceptance = 1 − TV = 0.6
    assert loss == pytest.approx(-math.log(1 - tv), abs=1e-6)  # −log 0.6
    # The blend: λ·CE(p̃, q) + (1 − λ)·TV, p̃ the target renormalised over the draft vocabulary.
    p_renorm = P_FULL[:3] / P_FULL[:3].sum()
    ce = float(-(p_renorm * Q_DRAFT.log()).sum())
    for scale, decay in ((1.0, 1.0), (0.7, 3.0), (1.0, 0.0), (0.0, 1.0)):
        lam = scale * math.exp(-decay * (1 - tv))  # ᾱ of one row is its α
        loss, _ = one_row("lk_adaptive", kl_scale=scale, kl_decay=decay)
        assert loss == pytest.approx(lam * ce + (1 - lam) * tv, abs=1e-6), (scale, decay)


def reference(
    objective: str, z: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, w: torch.Tensor, lam: float
):
    """float64 autograd of the definitions, row by row: the loss summed with weights ``w``."""
    q = torch.softmax(z, -1)
    p = torch.exp(t - lse[:, None])
    alpha = torch.minimum(p, q).sum(-1)
    if objective == "lk":
        per = -torch.log(alpha)
    else:
        p_renorm = torch.softmax(t, -1)
        per = lam * -(p_renorm * torch.log_softmax(z, -1)).sum(-1) + (1 - lam) * (1 - alpha)
    return (per * w).sum(), alpha


@pytest.mark.parametrize("objective", ["lk", "lk_adaptive"])
@pytest.mark.parametrize("chunk", [1, 7, 0])
def test_lk_gradients_equal_autograd_of_the_definition(objective: str, chunk: int) -> None:
    g = torch.Generator().manual_seed(3)
    n, hidden, vd, vfull = 40, 16, 24, 40
    x0 = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    w0 = torch.randn(vd, hidden, generator=g, dtype=torch.float64) * 0.5
    full = torch.randn(2, 30, vfull, generator=g, dtype=torch.float64) * 2  # the target's logits, whole vocab
    rows, cols = torch.randint(0, 2, (n,), generator=g), torch.randint(0, 30, (n,), generator=g)
    wt = (
        torch.rand(n, generator=g) < 0.8
    ).double()  # some rows weigh nothing (target token not in draft vocab)
    t, lse = full[..., :vd], torch.logsumexp(full, -1)

    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    loss, _, asum = linear_lk(x, w, t, lse, rows, cols, wt, chunk, objective, kl_scale=0.9, kl_decay=2.0)
    loss.backward()

    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    with torch.no_grad():
        alpha = reference("lk", xr @ wr.T, t[rows, cols], lse[rows, cols], wt, 0.0)[1]
    lam = 0.9 * math.exp(-2.0 * float((alpha * wt).sum() / wt.sum()))  # ᾱ held constant
    ref, _ = reference(objective, xr @ wr.T, t[rows, cols], lse[rows, cols], wt, lam)
    ref.backward()
    # The loss computes its softmaxes in fp32 (as on the GPU): fp32 rounding against float64.
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    assert float(asum) == pytest.approx(float((alpha * wt).sum()), rel=1e-5)
    assert x.grad is not None and w.grad is not None and float(w.grad.abs().sum()) > 0
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def test_the_adaptive_blend_runs_from_kl_to_tv() -> None:
    """λ = 1: the trainer's soft-label loss exactly (value and gradients); λ = 0: total variation; between:
    the straight line between them; and λ falls as acceptance rises."""
    g = torch.Generator().manual_seed(4)
    n, hidden, vd = 30, 8, 12
    x0, w0 = torch.randn(n, hidden, generator=g), torch.randn(vd, hidden, generator=g)
    full = torch.randn(1, n, vd + 5, generator=g) * 2
    t, lse = full[..., :vd], torch.logsumexp(full, -1)
    rows, cols, wt = torch.zeros(n, dtype=torch.long), torch.arange(n), torch.ones(n)

    def run(fn, *args, **kw):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = fn(x, w, *args, **kw)
        out[0].backward()
        return float(out[0].detach()), x.grad, w.grad

    kl = run(linear_soft_ce, t, rows, cols, wt, 5)
    ends = {
        s: run(linear_lk, t, lse, rows, cols, wt, 5, "lk_adaptive", kl_scale=s, kl_decay=0.0)
        for s in (1.0, 0.0, 0.25)
    }
    assert ends[1.0][0] == pytest.approx(kl[0], rel=1e-5)
    for a, b in zip(ends[1.0][1:], kl[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    q = torch.softmax(x0 @ w0.T, -1)
    tv = sum(tv_by_definition(torch.softmax(full[0, i], -1).double(), q[i].double()) for i in range(n))
    assert ends[0.0][0] == pytest.approx(tv, rel=1e-5)
    assert ends[0.25][0] == pytest.approx(0.25 * kl[0] + 0.75 * tv, rel=1e-5)
    for a, lo, hi in zip(ends[0.25][1:], ends[0.0][1:], kl[1:], strict=True):
        torch.testing.assert_close(a, 0.25 * hi + 0.75 * lo, rtol=1e-4, atol=1e-6)
    assert (
        adaptive_lambda(0.0, 1.0, 2.0)
        == 1.0
        > adaptive_lambda(0.5, 1.0, 2.0)
        > adaptive_lambda(0.9, 1.0, 2.0)
    )


def tiny_setup(seed: int = 5) -> tuple[TrainedDraft, torch.Tensor]:
    draft = tiny_draft(seed=seed)
    ids = draft.t2d.nonzero(as_tuple=True)[0]
    head_full = torch.randn(64, 32, generator=torch.Generator().manual_seed(seed)) * 0.3
    head_full[ids] *= 4  # most of the target's mass on the draft's tokens, so acceptance can grow
    head_d = head_full[ids]
    return TrainedDraft(
        draft=draft, model=draft, head_d=head_d, params=list(draft.parameters()), head_full=head_full
    ), head_d


def sums_and_grads(td: TrainedDraft, b: Batch, loss: TTTLoss) -> tuple[list[float], dict[str, torch.Tensor]]:
    td.draft.zero_grad(set_to_none=True)
    losses, _ = loss.sums(td, b)
    sum(losses).backward()
    grads = {k: p.grad.clone() for k, p in td.draft.named_parameters() if p.grad is not None}
    return [float(x) for x in losses], grads


def row_of(b: Batch, i: int) -> Batch:
    n = int(b.lengths[i])
    return Batch(
        *(t[i : i + 1, :n] for t in (b.aux, b.last_hidden, b.target_argmax, b.input_ids, b.loss_mask)),
        b.lengths[i : i + 1],
    )


@pytest.mark.parametrize("objective", ["lk", "lk_adaptive"])
def test_padding_changes_nothing_and_the_scored_positions_are_the_soft_label_losss(objective: str) -> None:
    """A padded batch gives the sum of its rows' losses and gradients taken alone (decay 0: λ comes from
    the micro-batch, so the blend is checked at λ = const); λ ≡ 1 gives the soft-label loss exactly."""
    td, _ = tiny_setup()
    b = batch(7, [13, 9, 4])
    loss = TTTLoss(
        ttt_steps=3,
        decay=0.8,
        chunk_tokens=5,
        autocast=False,
        objective=objective,
        kl_scale=0.5,
        kl_decay=0.0,
    )
    whole, gw = sums_and_grads(td, b, loss)
    parts = [sums_and_grads(td, row_of(b, i), loss) for i in range(3)]
    assert whole[0] > 0
    for j in range(3):
        assert whole[j] == pytest.approx(sum(p[0][j] for p in parts), rel=1e-5, abs=1e-6)
    for k, g in gw.items():
        torch.testing.assert_close(g, sum(p[1][k] for p in parts if k in p[1]), rtol=1e-4, atol=1e-6)
    # Nothing scored: zero loss, and still a gradient for every parameter (DDP needs one on every rank).
    b.loss_mask[:] = False
    none, gn = sums_and_grads(td, b, loss)
    assert none == [0.0, 0.0, 0.0] and {"lm_head.weight", "norm.weight", "fc.weight"} <= gn.keys()
    # λ ≡ 1: the same positions and weights as the soft-label loss the trainer always used.
    b = batch(7, [13, 9, 4])
    as_kl = TTTLoss(3, 0.8, 5, False, "lk_adaptive", kl_scale=1.0, kl_decay=0.0)
    got, _ = sums_and_grads(td, b, as_kl)
    want, _ = sums_and_grads(td, b, TTTLoss(3, 0.8, 5, False))
    assert got == pytest.approx(want, rel=1e-5)


def test_an_lk_loss_without_the_targets_whole_head_is_refused() -> None:
    draft = tiny_draft()
    with pytest.raises(ValueError, match="whole lm_head"):
        ttt_sums(draft, draft, batch(1, [6]), torch.randn(16, 32), 2, False, 4, objective="lk")


def test_a_short_cpu_training_run_with_lk_lowers_the_loss_and_raises_acceptance() -> None:
    """The trainer's parts (loss from [train] settings, AdamW with its schedule) on one fixed batch."""
    s = TrainSection(loss="lk", lr=1e-2, steps=15, warmup_steps=0, ttt_steps=2, loss_chunk_tokens=16)
    td, _ = tiny_setup(seed=8)
    b = batch(9, [12, 10])
    loss = TTTLoss.from_settings(s, autocast=False)
    assert loss.objective == "lk" and loss.needs_full_head
    optim = Optimiser.adamw(td.params, s)
    counts = torch.tensor([float(b.step_mask(j).sum()) for j in range(2)])

    def acceptance() -> float:  # mean α at step 0, from the definition
        with torch.no_grad():
            hj = td.draft(b.aux, b.input_ids, b.lengths, 1)[0]
            m = b.step_mask(0) & td.draft.t2d[shift(b.target_argmax)]
            q = torch.softmax(hj[m], -1)
            p = torch.softmax(shift(b.last_hidden)[m] @ td.head_full.T, -1)[:, td.draft.t2d]
            return float(torch.minimum(p, q).sum(-1).mean())

    first = last = 0.0
    a0 = acceptance()
    for step in range(1, s.steps + 1):
        optim.begin(step)
        losses, _ = loss.sums(td, b)
        total = loss.weighted(losses, counts)
        total.backward()
        total = total.detach()
        optim.finish()
        first, last = (float(total) if step == 1 else first), float(total)
    assert last < 0.5 * first, (first, last)
    assert acceptance() > a0 + 0.05


def shift(x: torch.Tensor) -> torch.Tensor:
    from pipeline.eagle3.draft_model import shift_left

    return shift_left(x, 1)
