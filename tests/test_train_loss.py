"""The TTT loss, chunked over tokens (issue 15): same losses, accuracy and gradients as the plain form,
and what it keeps for backward no longer grows with (steps × tokens × draft vocab)."""

from __future__ import annotations

import pytest
import torch

from pipeline.drafts.batch import Batch
from pipeline.drafts.eagle3.loss import ttt_sums, ttt_sums_unchunked
from pipeline.eagle3.draft_model import Eagle3Draft
from tests.test_eagle3_model import tiny_config, tiny_draft
from tests.tolerance import SEED, assert_close


def batch(seed: int, lengths: list[int], vocab: int = 64, hidden: int = 32) -> Batch:
    g = torch.Generator().manual_seed(seed)
    b, s = len(lengths), max(lengths)
    n = torch.tensor(lengths)
    real = torch.arange(s)[None, :] < n[:, None]
    mask = real & (torch.rand(b, s, generator=g) < 0.7)  # prompt tokens and padding are not scored
    return Batch(
        aux=torch.randn(b, s, 3 * hidden, generator=g),
        last_hidden=torch.randn(b, s, hidden, generator=g),
        target_argmax=torch.randint(0, vocab, (b, s), generator=g),
        input_ids=torch.randint(0, vocab, (b, s), generator=g),
        loss_mask=mask,
        lengths=n,
    )


def grads_of(draft, losses) -> dict[str, torch.Tensor]:
    draft.zero_grad(set_to_none=True)
    sum((0.8**j) * x for j, x in enumerate(losses)).backward()
    return {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk", [1, 5, 4096])
def test_chunked_loss_accuracy_and_gradients_equal_the_unchunked(chunk: int) -> None:
    draft = tiny_draft(seed=5 + SEED)
    head_d = torch.randn(16, 32)
    b = batch(1 + SEED, [13, 9, 4])  # the 4-token row has nothing to score after step 1
    ref_losses, ref_correct = ttt_sums_unchunked(draft, draft, b, head_d, 7, autocast=False)
    ref_grads = grads_of(draft, ref_losses)
    losses, correct = ttt_sums(draft, draft, b, head_d, 7, autocast=False, chunk_tokens=chunk)
    grads = grads_of(draft, losses)
    assert torch.equal(correct, ref_correct)
    for a, r in zip(losses, ref_losses, strict=True):
        assert a.item() == pytest.approx(r.item(), rel=1e-5, abs=1e-6)
    assert ref_grads.keys() == grads.keys() and "lm_head.weight" in grads and "fc.weight" in grads
    for k in ref_grads:
        # The same fp32 products summed in chunks of another size: order noise; the 1e-6 floor is for the
        # gradients near zero (a wrong chunk boundary moves a gradient by its own size).
        assert_close(grads[k], ref_grads[k], rel=1e-4, floor=1e-6, what=k)


def test_a_micro_batch_with_nothing_to_score_still_gives_every_parameter_a_gradient() -> None:
    """DDP needs a gradient for every parameter on every rank, even one whose rows are all prompt."""
    draft = tiny_draft(seed=6)
    b = batch(2, [6, 6])
    b.loss_mask[:] = False
    losses, correct = ttt_sums(draft, draft, b, torch.randn(16, 32), 3, autocast=False, chunk_tokens=4)
    grads = grads_of(draft, losses)
    assert float(sum(x.detach() for x in losses)) == 0.0 and int(correct.sum()) == 0
    assert {"lm_head.weight", "norm.weight", "fc.weight"} <= grads.keys()


def saved_bytes(loss_fn, draft, b: Batch, head_d: torch.Tensor, **kw) -> int:
    """Bytes autograd keeps for backward while ``loss_fn`` runs 7 TTT steps, by storage, beyond the
    weights and the batch (held anyway). A count of saved tensors, not an allocator peak."""
    alive = [*draft.parameters(), *draft.buffers(), head_d, *vars(b).values()]
    held = {t.untyped_storage().data_ptr() for t in alive}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in held:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = loss_fn(draft, draft, b, head_d, 7, autocast=False, **kw)
    del out
    return sum(seen.values())


def test_what_the_chunked_loss_keeps_for_backward_does_not_grow_with_tokens_times_vocab() -> None:
    """Plain: every step keeps (tokens × vocab) fp32 tensors until backward. Chunked: none of the steps'
    survive a chunk. What is kept and grows with the vocabulary is the target's logits (one tokens × vocab
    tensor, shared by all steps) and each step's ``lm_head`` gradient (hidden × vocab, taken in the
    forward pass); with more tokens only the target's logits and (tokens × hidden) tensors grow."""
    kept = {}
    hidden = 32
    for vocab in (1024, 4096):
        for seq in (64, 128):
            torch.manual_seed(7)
            draft = Eagle3Draft(tiny_config(vocab_size=vocab, draft_vocab_size=vocab))
            draft.set_vocab(torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool))
            b = batch(3, [seq, seq], vocab=vocab)
            head_d = torch.randn(vocab, hidden)
            kept[vocab, seq, "plain"] = saved_bytes(ttt_sums_unchunked, draft, b, head_d)
            kept[vocab, seq, "chunked"] = saved_bytes(ttt_sums, draft, b, head_d, chunk_tokens=16)
    dv = 4096 - 1024
    logits = 2 * 64 * dv * 4  # one step's extra fp32 (tokens × vocab) bytes, 64-token rows
    assert (
        kept[4096, 64, "plain"] - kept[1024, 64, "plain"] >= 7 * 2 * logits
    )  # log-softmax and targets, 7 steps
    grown = kept[4096, 64, "chunked"] - kept[1024, 64, "chunked"]
    assert grown <= logits + 7 * hidden * dv * 4, kept  # target logits once + one lm_head gradient per step

    # The (tokens × vocab) term: what 64 more tokens per row add at the large vocabulary beyond what they
    # add at the small one. Plain: 7 steps × 2 tensors; chunked: the target's logits only.
    def cross(kind: str) -> int:
        return (kept[4096, 128, kind] - kept[4096, 64, kind]) - (kept[1024, 128, kind] - kept[1024, 64, kind])

    assert cross("plain") >= 7 * 2 * logits
    assert cross("chunked") <= logits * 9 / 8, kept


@pytest.mark.gpu  # the compiled loss runs on CUDA only
def test_on_a_gpu_the_compiled_soft_label_loss_equals_the_eager_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the train stage runs on a GPU (``torch.compile``'d elementwise part, bf16 products) against the
    same function run eagerly, and both against float64: loss, greedy ids and both gradients."""
    from pipeline.drafts.eagle3.head_loss import linear_soft_ce

    g = torch.Generator(device="cuda").manual_seed(0)
    n, hidden, vocab = 3000, 256, 5000
    x0 = torch.randn(n, hidden, device="cuda", generator=g)
    w0 = torch.randn(vocab, hidden, device="cuda", generator=g) * hidden**-0.5 * 3
    tl = (torch.randn(2, 2048, vocab, device="cuda", generator=g) * 3).bfloat16()
    rows = torch.randint(0, 2, (n,), device="cuda", generator=g)
    cols = torch.randint(0, 2048, (n,), device="cuda", generator=g)
    wt = (torch.rand(n, device="cuda", generator=g) < 0.9).float()

    def run(eager: bool) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
        monkeypatch.setenv("AERIE_EAGER_LOSS", "1" if eager else "0")
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss, guess = linear_soft_ce(x, w, tl, rows, cols, wt, 1024, torch.bfloat16)
        loss.backward()
        return loss.item(), guess, x.grad, w.grad

    eager, compiled = run(True), run(False)
    x, w = x0.double().requires_grad_(), w0.double().requires_grad_()
    z = x @ w.T
    p = tl[rows, cols].double().softmax(-1)
    ref = (-(p * z.log_softmax(-1)).sum(-1) * wt.double()).sum()
    ref.backward()
    z16 = (x0.bfloat16() @ w0.bfloat16().T).float()  # the products the loss takes its greedy ids from
    for loss, guess, gx, gw in (eager, compiled):
        assert loss == pytest.approx(
            ref.item(), rel=2e-3, abs=1e-3
        )  # bf16 products; a floor for a loss near 0
        assert torch.equal(guess, z16.argmax(-1))
        assert (guess == z.argmax(-1)).float().mean() > 0.95  # bf16 products flip some of 5000-way near-ties
        for got, want in (
            (gx, x.grad),
            (gw, w.grad),
        ):  # bf16 products: about 2^-8 relative, as autocast gives
            assert ((got.double() - want).norm() / want.norm()).item() < 1e-2
    assert compiled[0] == pytest.approx(
        eager[0], rel=1e-4, abs=1e-5
    )  # the same bf16 products, fused in another order
    assert torch.equal(compiled[1], eager[1])
