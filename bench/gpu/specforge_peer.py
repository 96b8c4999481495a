"""SpecForge as a standing oracle and a speed peer: its EAGLE-3 draft and TTT loop next to Aerie's, same weights.

Builds SpecForge 0.2.0's ``LlamaForCausalLMEagle3`` (specforge/modeling/draft/llama3_eagle.py) inside its
training wrapper ``OnlineEagle3Model`` (specforge/algorithms/eagle3/model.py: the TTT unroll, the
soft labels of ``_compute_target_p``, the loss and accuracy), and Aerie's :class:`Eagle3Draft`
trained by ``pipeline.drafts.eagle3.loss.ttt_sums``, with identical weights and one synthetic batch
fed to both in each one's own convention. ``tests/test_specforge_oracle.py`` asserts they agree;
:func:`time_specforge_vs_aerie` times their forward+backward (``python -m bench.gpu.specforge_peer``
runs a tiny CPU config; pass ``--device cuda --shape llama8b`` on a GPU).

SpecForge is installed without its dependencies (``pip install --no-deps -r
.ci/specforge-requirements.txt``). Off CUDA two things of it cannot run, and are replaced by its
own equivalents: its ``torch.compile`` decorators (RMSNorm, RoPE, ``_compute_target_p``) run
eagerly (``torch._dynamo.config.disable``), and its Triton soft-label kernel ``LogSoftmaxLoss`` is
swapped for ``_compute_loss``, the reference implementation next to it in specforge/core/loss.py.

Conventions mapped (see docs/eagle3.md, "SpecForge as an oracle"):

- SpecForge's batch is pre-shifted (``TargetHead.preprocess``): ``input_ids`` and target logits one
  left of Aerie's; its loss mask is *not* shifted: step ``j`` of column ``t`` is scored by
  ``loss_mask[t + j]``, whereas Aerie scores it by the mask of the token it predicts, ``t + 2 + j``.
  The oracle feeds SpecForge Aerie's mask shifted two left so both score the same columns.
- SpecForge's per-step loss is a mean over all ``batch × seq`` positions (padding and prompt
  included); Aerie's is a sum that the stage divides by the scored-token count. The oracle compares
  SpecForge's loss × ``batch × seq`` with Aerie's sum.
- RoPE positions start at 0 in SpecForge and 1 in Aerie (column ``t`` holds token ``t + 1``): a
  constant offset, which rotary attention does not see.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from dataclasses import dataclass
from typing import Any

import torch

from bench.gpu.common import pinned_problem, time_ms
from pipeline.drafts.batch import Batch
from pipeline.drafts.eagle3.loss import ttt_sums
from pipeline.eagle3.draft_config import DraftConfig
from pipeline.eagle3.draft_model import Eagle3Draft, shift_left

SPECFORGE_VERSION = "0.2.0"
DECAY = 0.8  # per-step loss weight of both trainers' defaults


def specforge_available() -> str | None:
    """None when the pinned SpecForge imports here; else why not (for a skip reason)."""
    return pinned_problem(
        "specforge",
        SPECFORGE_VERSION,
        ("specforge.algorithms.eagle3.model", "specforge.modeling.draft.llama3_eagle"),
        "pip install --no-deps -r .ci/specforge-requirements.txt",
        "the oracle is pinned to",
    )


def specforge_config(cfg: DraftConfig) -> Any:
    """The ``LlamaConfig`` SpecForge's draft reads (its configs/*-eagle3.json fields)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        draft_vocab_size=cfg.draft_vocab_size,
        target_hidden_size=cfg.target_hidden_size,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        hidden_act=cfg.hidden_act,
        num_hidden_layers=1,
        pretraining_tp=1,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )


@contextlib.contextmanager
def specforge_runs_here(device: torch.device):
    """Off CUDA: SpecForge's compiled functions run eagerly and its Triton loss is its reference loss."""
    if device.type == "cuda":
        yield
        return
    with specforge_eager():
        yield


@contextlib.contextmanager
def specforge_eager():
    """SpecForge without its ``torch.compile`` and Triton paths: its compiled functions run eagerly
    (``torch._dynamo.config.disable``) and its Triton loss kernel is ``_compute_loss``, its reference."""
    import specforge.algorithms.eagle3.model as sf_model
    import specforge.core.loss as sf_loss
    import torch._dynamo

    class ReferenceLoss:  # the Triton kernel's contract: (logits, target_p, position_mask) -> mean loss
        apply = staticmethod(sf_loss._compute_loss)

    kernel = sf_model.LogSoftmaxLoss
    sf_model.LogSoftmaxLoss = ReferenceLoss
    try:
        with torch._dynamo.config.patch(disable=True):
            yield
    finally:
        sf_model.LogSoftmaxLoss = kernel


def param_map(aerie: Eagle3Draft, specforge: torch.nn.Module) -> dict[str, str]:
    """Aerie tensor name -> SpecForge's. Both follow SGLang's checkpoint names, so it is the identity;
    checked here so that a rename on either side fails loudly instead of comparing different models."""
    a, s = set(aerie.state_dict()), set(specforge.state_dict())
    s -= {k for k in s if "rotary_emb" in k}  # SpecForge's RoPE caches, non-persistent in Aerie
    if a != s:
        raise AssertionError(
            f"draft tensors differ: only Aerie {sorted(a - s)}, only SpecForge {sorted(s - a)}"
        )
    return {k: k for k in sorted(a)}


def build_pair(
    cfg: DraftConfig,
    seed: int = 0,
    device: str | torch.device = "cpu",
    attention_backend: str = "sdpa",
    ttt: int = 7,
) -> tuple[Eagle3Draft, Any]:
    """(Aerie's draft, SpecForge's ``OnlineEagle3Model`` around its draft), same random weights and vocab map."""
    aerie = random_aerie(cfg, seed)
    sf = wrap_specforge(aerie, ttt, attention_backend)
    return aerie.to(device), sf.to(device)


def random_aerie(cfg: DraftConfig, seed: int = 0) -> Eagle3Draft:
    """Aerie's draft with seeded random weights (norms not all ones) and a random draft vocabulary, on the CPU."""
    torch.manual_seed(seed)
    aerie = Eagle3Draft(cfg)
    for name, p in aerie.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.data.uniform_(0.5, 1.5)  # not all ones: a swapped norm must show
        else:
            p.data.normal_(0, cfg.hidden_size**-0.5)
    ids = torch.sort(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]).values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    aerie.set_vocab(ids - torch.arange(cfg.draft_vocab_size), t2d)
    return aerie


def wrap_specforge(aerie: Eagle3Draft, ttt: int, attention_backend: str = "sdpa") -> Any:
    """SpecForge's ``OnlineEagle3Model`` (TTT ``ttt``) around its ``LlamaForCausalLMEagle3`` holding a copy
    of ``aerie``'s weights, embedding (frozen, as SpecForge freezes it) and vocabulary map."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    if aerie.cfg.fc_norm or aerie.cfg.norm_output:
        raise ValueError("SpecForge's LlamaForCausalLMEagle3 is plain EAGLE-3: no fc_norm / norm_output")
    sf_draft = LlamaForCausalLMEagle3(specforge_config(aerie.cfg), attention_backend=attention_backend)
    names = param_map(aerie, sf_draft)
    src = aerie.state_dict()
    sf_draft.load_state_dict({names[k]: v.detach().cpu() for k, v in src.items()}, strict=False)
    sf_draft.freeze_embedding()
    return OnlineEagle3Model(sf_draft, length=ttt, attention_backend=attention_backend)


@dataclass
class PeerBatch:
    """One synthetic batch in both conventions; ``head`` is the target's full ``lm_head``."""

    aerie: Batch
    head: torch.Tensor  # (V, H)
    head_d: torch.Tensor  # (Vd, H): the rows of the draft vocabulary
    specforge: dict[str, torch.Tensor]


def make_batch(
    aerie: Eagle3Draft,
    batch: int,
    seq_len: int,
    seed: int = 0,
    device: str | torch.device = "cpu",
    lengths: list[int] | None = None,
) -> PeerBatch:
    """Random target features and head; ``lengths`` pads rows shorter than ``seq_len``."""
    cfg = aerie.cfg
    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    h = cfg.target_hidden_size
    n = torch.tensor(lengths or [seq_len] * batch)
    real = torch.arange(seq_len)[None, :] < n[:, None]
    aux = torch.randn(batch, seq_len, 3 * h, generator=g)
    last = torch.randn(batch, seq_len, h, generator=g)
    head = torch.randn(cfg.vocab_size, h, generator=g) * h**-0.5 * 4  # peaked enough to have an argmax
    logits = last @ head.T
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g) * real
    mask = real & (torch.rand(batch, seq_len, generator=g) < 0.8)
    mask[:, :2] = False  # a "prompt"
    ab = Batch(aux.to(dev), last.to(dev), logits.argmax(-1).to(dev), ids.to(dev), mask.to(dev), n.to(dev))
    head_d = head[aerie.d2t.cpu() + torch.arange(cfg.draft_vocab_size)]
    sf = {
        # TargetHead.preprocess: ids and target logits shifted one left; loss mask shifted by us (see above)
        "input_ids": shift_left(ids, 1),
        "target": shift_left(logits, 1),
        "loss_mask": shift_left(mask, 2, False).long()[..., None],
        "attention_mask": real.long(),
        "hidden_states": aux,
    }
    return PeerBatch(ab, head.to(dev), head_d.to(dev), {k: v.to(dev) for k, v in sf.items()})


def specforge_ttt(sf: Any, pb: PeerBatch) -> dict[str, Any]:
    """Run SpecForge's TTT: per-step logits (recorded), losses (as sums, see above) and correct counts."""
    seen: list[torch.Tensor] = []
    draft = sf.draft_model
    plain = draft.compute_logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        out = plain(hidden)
        seen.append(out)
        return out

    draft.compute_logits = record
    try:
        b = pb.specforge
        plosses, _, _, corrects, _, _, _ = sf(
            input_ids=b["input_ids"],
            attention_mask=b["attention_mask"],
            target=b["target"],
            loss_mask=b["loss_mask"],
            hidden_states=b["hidden_states"],
        )
    finally:
        del draft.compute_logits
    positions = b["input_ids"].numel()
    return {
        "logits": seen,
        "losses": [x * positions for x in plosses],
        "correct": [float(c) for c in corrects],
    }


def aerie_ttt(aerie: Eagle3Draft, pb: PeerBatch, steps: int, autocast: bool = False) -> dict[str, Any]:
    """Aerie's training step math: per-step logits (a separate forward) and the stage's losses/accuracy."""
    b = pb.aerie
    losses, correct = ttt_sums(aerie, aerie, b, pb.head_d, steps, autocast)
    with torch.no_grad():
        logits = aerie.ttt(b.aux, b.input_ids, b.lengths, steps)
    return {"logits": logits, "losses": losses, "correct": correct.tolist()}


def time_specforge_vs_aerie(
    device: str | torch.device,
    config: DraftConfig,
    batch: int,
    seq_len: int,
    steps: int,
    reps: int = 5,
    attention_backend: str = "sdpa",
    profile_rows: int = 0,
) -> dict[str, Any]:
    """Tokens/s of one training forward+backward of each, on one batch of ``batch × seq_len`` tokens.

    Each is trained as it trains itself: Aerie with fp32 master weights under bf16 autocast on CUDA
    (fp32 on CPU), its loss chunked; SpecForge with its draft in bf16 on CUDA (fp32 on CPU), its
    ``attention_backend`` (``sdpa``: the diagonal form; ``flex_attention``), its Triton loss on CUDA.
    Returns tokens/s of each and ``ratio`` = Aerie / SpecForge; with ``profile_rows``, also each side's
    top kernels by device time over two more steps (``torch.profiler``), under ``<name>_profile``.
    """
    dev = torch.device(device)
    aerie, sf = build_pair(config, seed=0, device=dev, attention_backend=attention_backend, ttt=steps)
    pb = make_batch(aerie, batch, seq_len, seed=1, device=dev)
    cuda = dev.type == "cuda"
    if cuda:
        sf.to(torch.bfloat16)
        pb.specforge["hidden_states"] = pb.specforge["hidden_states"].to(torch.bfloat16)
        pb.specforge["target"] = pb.specforge["target"].to(torch.bfloat16)
        pb.aerie.aux, pb.aerie.last_hidden = pb.aerie.aux.bfloat16(), pb.aerie.last_hidden.bfloat16()
    counts = [max(float(pb.aerie.step_mask(j).sum()), 1.0) for j in range(steps)]
    positions = batch * seq_len

    def aerie_step() -> None:
        aerie.zero_grad(set_to_none=True)
        losses, _ = ttt_sums(aerie, aerie, pb.aerie, pb.head_d, steps, autocast=cuda)
        sum(DECAY**j * losses[j] / counts[j] for j in range(steps)).backward()

    def sf_step() -> None:
        sf.zero_grad(set_to_none=True)
        b = pb.specforge
        plosses = sf(
            input_ids=b["input_ids"],
            attention_mask=b["attention_mask"],
            target=b["target"],
            loss_mask=b["loss_mask"],
            hidden_states=b["hidden_states"],
        )[0]
        sum(DECAY**j * plosses[j] * positions / counts[j] for j in range(steps)).backward()

    out: dict[str, Any] = {
        "device": str(dev),
        "batch": batch,
        "seq_len": seq_len,
        "ttt": steps,
        "hidden": config.hidden_size,
        "draft_vocab": config.draft_vocab_size,
        "specforge_backend": attention_backend,
    }
    with specforge_runs_here(dev):
        for name, fn in (("aerie", aerie_step), ("specforge", sf_step)):
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            ms = statistics.median(time_ms(fn, dev, warmup=2, reps=reps))
            out[f"{name}_step_ms"] = round(ms, 2)
            out[f"{name}_tokens_per_s"] = round(positions / (ms / 1e3), 1)
            if cuda:
                out[f"{name}_peak_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
            if profile_rows:
                out[f"{name}_profile"] = profile_table(fn, dev, profile_rows)
    out["ratio"] = round(out["aerie_tokens_per_s"] / out["specforge_tokens_per_s"], 3)
    return out


def profile_table(fn: Any, dev: torch.device, rows: int) -> str:
    """The top ``rows`` operators of two calls of ``fn`` by self device time (CPU time off CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(2):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def tiny_config(draft_vocab: int = 64, vocab: int = 256) -> DraftConfig:
    return DraftConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=[1, 2, 3],
        target_hidden_size=64,
        rope_theta=10000.0,
        max_position_embeddings=2048,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="tiny", help="tiny, or a bench.gpu.common SHAPES name (e.g. llama8b)")
    ap.add_argument("--draft-vocab", type=int, default=None)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backend", default="sdpa", help="SpecForge's attention backend: sdpa or flex_attention")
    args = ap.parse_args(argv)
    why = specforge_available()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    if args.shape == "tiny":
        cfg = tiny_config(args.draft_vocab or 64)
    else:
        from bench.gpu.ttt_memory import draft_config

        cfg = draft_config(args.shape, args.draft_vocab or 32000)
    r = time_specforge_vs_aerie(args.device, cfg, args.batch, args.seq, args.ttt, args.reps, args.backend)
    print(json.dumps(r))
    from bench.gpu.results import write_out

    write_out("specforge_peer.json", r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
