"""vLLM's speculators as a second speed peer: its EAGLE-3 draft's training step beside Aerie's and SpecForge's.

``time_speculators(device, config, batch, seq_len, steps)`` builds speculators 0.9.0's ``Eagle3DraftModel``
(speculators/models/eagle3/core.py) with the weights of the same random Aerie draft that
``bench/gpu/specforge_peer.py`` gives SpecForge, and times one training forward+backward on the same
``batch × seq_len`` tokens at TTT depth ``steps``, trained as speculators' own trainer trains it
(speculators/train/trainer.py): fp32 weights under bf16 autocast on CUDA, its ``forward`` ``torch.compile``d
(it decorates it whenever CUDA is there), ``simple_flex_attention`` with its document/causal/diagonal block mask,
its fused Triton KL loss (``kl_div``, the EAGLE-3 default) on CUDA; off CUDA its eager loss in fp32, its forward
eager and its ``sdpa`` attention (dense float mask; PyTorch's FlexAttention has no backward on CPU). ``main`` times all three on one batch and prints ``ratio`` = Aerie / the faster peer (goal ≥ 1.3×).

```
python -m bench.gpu.speculators_peer                                 # CPU smoke: tiny config, 2 x 128, TTT 7
python -m bench.gpu.speculators_peer --device cuda --shape llama8b --batch 4 --seq 2048 --ttt 7 --reps 6 \
    --site .gpu-stage/spx/site
```

Conventions (timing only: no oracle equality is claimed, unlike SpecForge's, see docs/eagle3.md):

- speculators packs a batch into one row: ``hidden_states`` ``[1, batch·seq, 3H]``, ``document_ids`` naming each
  token's row (its mask keeps attention inside a row), positions restarting per row — ``batch × seq`` tokens
  either way.
- Its soft labels come from ``verifier_lm_head(verifier_norm(last hidden))`` over the draft vocabulary: the
  verifier head here is Aerie's ``head_d`` (the target head's draft-vocabulary rows), its norm weight ones.
- Its draft ``lm_head`` is frozen (copied from the verifier's head and never trained, ``model.py``
  ``_init_vocab``); Aerie and SpecForge train theirs, so speculators skips the ``lm_head`` weight gradient
  (one ``tokens × H × Vd`` product of the step's backward per TTT step). ``--train-lm-head`` times it with the
  head trained, the work the other two do.

Not installed here by default: ``bash bench/gpu/stage_speculators.sh`` puts it (and what it imports that the GPU
image lacks, and SpecForge) in ``.gpu-stage/spx/site``, for Python 3.12 (the GPU image's); ``--site`` puts a staged
folder first on ``sys.path``. The CPU smoke needs ``pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0``
here (its other imports are in the venv already).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.gpu.common import pinned_problem, time_ms
from bench.gpu.specforge_peer import DECAY, PeerBatch, make_batch, random_aerie, tiny_config
from pipeline.eagle3.draft_config import DraftConfig
from pipeline.eagle3.draft_model import Eagle3Draft

SPECULATORS_VERSION = "0.9.0"
SITE = Path(__file__).resolve().parents[2] / ".gpu-stage" / "spx" / "site"


def speculators_available() -> str | None:
    """None when the pinned speculators imports here; else why not."""
    return pinned_problem(
        "speculators",
        SPECULATORS_VERSION,
        ("speculators.models.eagle3",),
        "bash bench/gpu/stage_speculators.sh, then --site",
        "this harness is written against",
    )


def speculators_config(cfg: DraftConfig, ttt: int, attn_impl: str) -> Any:
    """The ``Eagle3SpeculatorConfig`` of a one-layer Llama EAGLE-3 draft of ``cfg``'s shape."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    from bench.gpu.specforge_peer import specforge_config

    layer = specforge_config(cfg)  # the same LlamaConfig fields SpecForge's draft reads
    layer._attn_implementation = attn_impl
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=cfg.draft_vocab_size,
        norm_before_residual=False,  # SGLang's layer, and Aerie's: the residual is the un-normed hidden input
        eagle_aux_hidden_state_layer_ids=list(cfg.aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )


def speculators_draft(
    aerie: Eagle3Draft, head_d: torch.Tensor, ttt: int, attn_impl: str, train_lm_head: bool = False
) -> Any:
    """speculators' ``Eagle3DraftModel`` holding a copy of ``aerie``'s weights and vocabulary map, ``head_d`` as its
    verifier head; its ``lm_head`` frozen as speculators freezes it unless ``train_lm_head``."""
    from speculators.models.eagle3 import Eagle3DraftModel

    if aerie.cfg.fc_norm or aerie.cfg.norm_output:
        raise ValueError("the peer compares plain EAGLE-3 drafts: no fc_norm / norm_output")
    model = Eagle3DraftModel(speculators_config(aerie.cfg, ttt, attn_impl))
    src = {k.replace("midlayer.", "layers.0.", 1): v.detach().cpu() for k, v in aerie.state_dict().items()}
    src["verifier_lm_head.weight"] = head_d.detach().float().cpu()
    src["verifier_norm.weight"] = torch.ones(aerie.cfg.hidden_size)
    theirs = {k for k in model.state_dict() if "rotary_emb" not in k}
    if set(src) != theirs:
        raise AssertionError(
            f"draft tensors differ: only Aerie {sorted(set(src) - theirs)}, only speculators {sorted(theirs - set(src))}"
        )
    model.load_state_dict(src, strict=False)
    model.lm_head.weight.requires_grad_(train_lm_head)
    return model


def packed_batch(pb: PeerBatch, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The peer batch as speculators' collate packs it: one row of ``batch·seq`` tokens with document ids."""
    b = pb.aerie
    n, s = b.input_ids.shape
    dev = b.input_ids.device
    real = torch.arange(s, device=dev)[None, :] < b.lengths[:, None]
    docs = torch.where(real, torch.arange(n, device=dev)[:, None], -1)
    return {
        "hidden_states": b.aux.reshape(1, n * s, -1).to(dtype),
        "input_ids": b.input_ids.reshape(1, n * s),
        "document_ids": docs.reshape(1, n * s),
        "loss_mask": b.loss_mask.reshape(1, n * s).bool(),
        "position_ids": torch.arange(s, device=dev).repeat(n)[None, :],
        "verifier_last_hidden_states": b.last_hidden.reshape(1, n * s, -1).to(dtype),
    }


def time_speculators(
    device: str | torch.device,
    config: DraftConfig,
    batch: int,
    seq_len: int,
    steps: int,
    reps: int = 5,
    attn_impl: str = "simple_flex_attention",
    train_lm_head: bool = False,
) -> dict[str, Any]:
    """Tokens/s (and peak GiB on CUDA) of one speculators training forward+backward, as its trainer runs it."""
    from speculators.losses import resolve_loss_config

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    aerie = random_aerie(config, seed=0)
    pb = make_batch(aerie, batch, seq_len, seed=1, device=dev)
    model = speculators_draft(aerie, pb.head_d, steps, attn_impl, train_lm_head).to(dev)
    del aerie
    packed = packed_batch(pb, torch.bfloat16 if cuda else torch.float32)
    loss_config = resolve_loss_config("kl_div", "fused" if cuda else "eager")
    model.train()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            _, loss, _ = model(**packed, ttt_steps=steps, ttt_step_loss_decay=DECAY, loss_config=loss_config)
        loss.backward()

    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    t = time.perf_counter()
    step()  # the first call compiles on CUDA: timed apart
    if cuda:
        torch.cuda.synchronize(dev)
    first_s = time.perf_counter() - t
    ms = statistics.median(time_ms(step, dev, warmup=1, reps=reps))
    out: dict[str, Any] = {
        "speculators_attn": attn_impl,
        "speculators_lm_head_trained": train_lm_head,
        "speculators_first_step_s": round(first_s, 1),
        "speculators_step_ms": round(ms, 2),
        "speculators_tokens_per_s": round(batch * seq_len / (ms / 1e3), 1),
    }
    if cuda:
        out["speculators_peak_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
    return out


def time_three(
    device: str,
    cfg: DraftConfig,
    batch: int,
    seq_len: int,
    ttt: int,
    reps: int,
    attn_impls: list[str],
    train_lm_head: bool = False,
) -> dict[str, Any]:
    """Aerie and SpecForge (``time_specforge_vs_aerie``), then speculators with the first of ``attn_impls`` that runs
    (each failure is kept under ``speculators_error_<impl>``); ``ratio_best_peer`` = Aerie / the faster peer."""
    from bench.gpu.specforge_peer import time_specforge_vs_aerie

    r = time_specforge_vs_aerie(device, cfg, batch, seq_len, ttt, reps)
    r["ratio_specforge"] = r.pop("ratio")
    print(json.dumps(r), flush=True)  # kept if speculators' step then fails or the call runs out of time
    for impl in attn_impls:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        try:
            r.update(time_speculators(device, cfg, batch, seq_len, ttt, reps, impl, train_lm_head))
            break
        except Exception as exc:  # noqa: BLE001 - recorded; the next implementation is tried
            r[f"speculators_error_{impl}"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            print(
                f"speculators with {impl} failed: {r[f'speculators_error_{impl}']}",
                file=sys.stderr,
                flush=True,
            )
    if "speculators_tokens_per_s" in r:
        r["ratio_speculators"] = round(r["aerie_tokens_per_s"] / r["speculators_tokens_per_s"], 3)
        best = max(r["specforge_tokens_per_s"], r["speculators_tokens_per_s"])
        r["ratio_best_peer"] = round(r["aerie_tokens_per_s"] / best, 3)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="tiny", help="tiny, or a bench.gpu.common SHAPES name (e.g. llama8b)")
    ap.add_argument("--draft-vocab", type=int, default=None)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--attn",
        default=None,
        help="speculators' draft_attn_impl, comma-separated fallbacks (default: simple_flex_attention,sdpa on CUDA, "
        "sdpa off it)",
    )
    ap.add_argument(
        "--train-lm-head", action="store_true", help="train speculators' lm_head too (it freezes it)"
    )
    ap.add_argument(
        "--site", default=None, help=f"a staged py3.12 site folder, first on sys.path (the GPU's: {SITE})"
    )
    args = ap.parse_args(argv)
    if args.site:
        sys.path.insert(0, args.site)
    from bench.gpu.specforge_peer import specforge_available

    why = speculators_available() or specforge_available()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    if args.device == "cpu":
        torch.set_num_threads(1)  # a loaded machine swings multi-threaded CPU timings 2x
    if args.shape == "tiny":
        cfg = tiny_config(args.draft_vocab or 64)
    else:
        from bench.gpu.ttt_memory import draft_config

        cfg = draft_config(args.shape, args.draft_vocab or 32000)
    if args.attn:
        attn = args.attn.split(",")
    else:  # FlexAttention has no backward on CPU; on CUDA sdpa (speculators' dense mask) only if flex fails
        attn = ["simple_flex_attention", "sdpa"] if args.device.startswith("cuda") else ["sdpa"]
    r = time_three(args.device, cfg, args.batch, args.seq, args.ttt, args.reps, attn, args.train_lm_head)
    r["shape"] = args.shape
    print(json.dumps(r))
    from bench.gpu.results import write_out

    write_out(f"speculators_peer_{args.shape}.json", r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
