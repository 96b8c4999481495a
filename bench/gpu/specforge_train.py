"""SpecForge 0.2.0 trains an EAGLE-3 draft on the store Aerie's extract stage wrote; Aerie's bench stage benches it.

``python -m bench.gpu.specforge_train --run RUN_DIR --out DRAFT_DIR --steps N --batch B --lr LR --seed S
[--ttt T] [--device cuda|cpu] [--micro-batch M] [--mask aerie|specforge] [--backend sdpa|flex_attention]``
(or ``--store EXTRACT_OUT --vocab VOCAB_OUT [--plan PLAN]`` instead of ``--run``).

``RUN_DIR``: an Aerie run directory (``plan.toml``, ``stages/*/out``) or a folder of stage out dirs beside a
``plan.toml`` (the ``bench/gpu/*.py`` work dirs) where extract (offline) and vocab have run, read as the train
stage reads them (:mod:`pipeline.eagle3.trainer_inputs`). As Aerie's train stage: the seeded initial draft, the
draft vocabulary, each step's rows and micro-batches (``BatchSchedule``, ``rank_chunks``; its ``Feeder`` on a
GPU). SpecForge's own: ``TargetHead``, ``Eagle3TrainStrategy.forward_loss`` around ``OnlineEagle3Model`` (TTT
unroll, soft labels, loss), the accumulation of its ``TrainerCore`` and its ``BF16Optimizer``. ``--mask aerie``
(default) scores the same tokens as Aerie; ``--mask specforge`` keeps SpecForge's mask convention. What
differs from each trainer: docs/eagle3.md, "SpecForge as an oracle".

``DRAFT_DIR`` becomes the draft folder the train stage exports (``config.json`` ``LlamaForCausalLMEagle3``,
``model.safetensors`` with the same tensor names and d2t/t2d, written by Aerie's ``save_draft`` from SpecForge's
last-step weights), which SGLang loads as ``--speculative-draft-model-path``, plus ``manifest.json`` (kind
``draft``, path ``.``) so the bench stage takes it as ``--input`` as it takes a train stage's out dir, and
``specforge_train.json`` (the logged steps; also ``$OUT/specforge_train.json`` when ``OUT`` is set). On CUDA
SpecForge runs in bf16 with its ``torch.compile`` and Triton paths; if a step fails there it is redone
eagerly (printed). On the CPU it runs eagerly in fp32. SpecForge is found installed, or in ``.gpu-stage/sf``
(what ``bench/gpu/specforge_accept.py --stage`` copies there to carry it to the GPU machine).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.gpu.runner import ROOT

if (ROOT / ".gpu-stage" / "sf").is_dir():  # SpecForge carried to a machine where it is not installed
    sys.path.insert(1, str(ROOT / ".gpu-stage" / "sf"))

from bench.gpu.results import write_out
from bench.gpu.specforge_peer import (
    SPECFORGE_VERSION,
    param_map,
    specforge_available,
    specforge_eager,
    wrap_specforge,
)
from pipeline.drafts.batch import Batch
from pipeline.eagle3 import draft_vocab
from pipeline.eagle3 import hidden_store as hs
from pipeline.eagle3.draft_model import Eagle3Draft, save_draft, shift_left
from pipeline.eagle3.trainer_inputs import build_draft, find_inputs
from pipeline.manifests.base import ManifestError
from pipeline.manifests.hidden_store import HiddenStatesManifest
from pipeline.run.plan import dag as plan_mod
from pipeline.run.plan.sections import TrainSection
from pipeline.run.rundir.layout import write_json
from pipeline.stages.train.batches import OfflineData
from pipeline.stages.train.feeder import Feeder, Inline
from pipeline.stages.train.settings import BatchSchedule
from pipeline.stages.train.steps import rank_chunks

RESULTS = "specforge_train.json"


class SetupError(RuntimeError):
    """The run dir cannot be trained on: what is missing, naming the file."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclasses.dataclass
class RunInputs:
    plan_path: Path | None
    model_id: str
    trust_remote_code: bool
    settings: TrainSection
    manifest: HiddenStatesManifest
    ext_dir: Path
    vocab: draft_vocab.VocabMap


def load_run(
    run: Path | None = None,
    store: Path | None = None,
    vocab: Path | None = None,
    plan: Path | None = None,
    **overrides: Any,
) -> RunInputs:
    """The plan's ``[train]`` (with ``overrides``), the offline store and the vocabulary: of the run dir ``run``
    (its ``plan.toml``; the stage out dirs ``stages/*/out``, or the folders beside the plan), or of the out dirs
    ``store`` and ``vocab`` with ``plan`` (default: the ``plan.toml`` beside the store, if any; else the
    ``[train]`` defaults and the store's target)."""
    if run is not None:
        plan_path: Path | None = run / "plan.toml"
        stages = run / "stages"
        dirs = (
            sorted(p / "out" for p in stages.iterdir() if (p / "out").is_dir()) if stages.is_dir() else [run]
        )
        where = stages / "*" / "out" / "manifest.json" if stages.is_dir() else run / "*" / "manifest.json"
        if not plan_path.is_file():  # type: ignore[union-attr]
            raise SetupError(f"{plan_path}: missing (not an Aerie run directory)")
    elif store is not None and vocab is not None:
        plan_path = plan or (store.parent / "plan.toml" if (store.parent / "plan.toml").is_file() else None)
        dirs, stages = [store, vocab], None
        where = Path("{" + f"{store},{vocab}" + "}") / "manifest.json"
        for d in dirs:
            if not (d / "manifest.json").is_file():
                raise SetupError(f"{d / 'manifest.json'}: missing (not a stage's out dir)")
    else:
        raise SetupError("give --run RUN_DIR, or --store EXTRACT_OUT and --vocab VOCAB_OUT")
    try:
        man, ext_dir, vocab_dir = find_inputs(dirs)
    except ManifestError as exc:  # a damaged manifest: its file and field
        raise SetupError(str(exc)) from None
    except ValueError as exc:
        what = "extraction (the hidden-state store)" if "extraction" in str(exc) else "draft vocabulary"
        stage = "extract" if "extraction" in str(exc) else "vocab"
        raise SetupError(f"{where}: no {what} found: run the {stage} stage first") from None
    if man.mode != "offline":
        raise SetupError(
            f"{ext_dir / 'manifest.json'}: the extraction is {man.mode!r}, not offline: there is no "
            'hidden-state store to train on (set [extract] mode = "offline")'
        )
    try:
        vm = draft_vocab.load(vocab_dir)
    except draft_vocab.VocabError as exc:
        raise SetupError(str(exc)) from None
    if plan_path is not None:
        p = plan_mod.load(plan_path, run_dir=run if stages is not None and stages.is_dir() else None)
        train, model_id, trc = (
            p.settings.train,
            str(p.target.model or man.target or ""),
            p.target.trust_remote_code,
        )
    else:
        train, model_id, trc = TrainSection(), str(man.target or ""), False
    if not model_id:
        raise SetupError(f"{ext_dir / 'manifest.json'}: names no target model, and there is no plan")
    s = dataclasses.replace(train, **overrides)
    return RunInputs(plan_path, model_id, trc, s, man, ext_dir, vm)


def specforge_tensors(b: Batch, mask: str = "aerie") -> dict[str, torch.Tensor]:
    """An Aerie store batch as SpecForge's offline ``TrainBatch`` tensors (before its ``TargetHead.preprocess``,
    which shifts ``input_ids`` and the target hidden state one left)."""
    n = b.input_ids.shape[1]
    real = torch.arange(n, device=b.lengths.device)[None, :] < b.lengths[:, None]
    loss_mask = shift_left(b.loss_mask, 2, False) if mask == "aerie" else b.loss_mask
    return {
        "input_ids": b.input_ids,
        "attention_mask": real.long(),
        "loss_mask": loss_mask.long(),
        "hidden_state": b.aux,
        "target": b.last_hidden,
    }


def target_head(head_full: torch.Tensor) -> Any:
    """SpecForge's ``TargetHead`` holding the target's ``lm_head`` (its ``from_pretrained`` wants an
    ``*.index.json`` checkpoint; the weight here is the one Aerie's loader read, tied embeddings included)."""
    from specforge.modeling.target.target_head import TargetHead

    class StoreTargetHead(TargetHead):
        def __init__(self, weight: torch.Tensor) -> None:
            torch.nn.Module.__init__(self)
            self.vocab_size, self.hidden_size = weight.shape
            self.fc = torch.nn.Linear(self.hidden_size, self.vocab_size, bias=False)
            self.fc.weight.data.copy_(weight)
            self.freeze_weights()

    return StoreTargetHead(head_full).eval()


@dataclasses.dataclass
class SpecForgeTrainer:
    """SpecForge's strategy, model and optimiser, and Aerie's data order."""

    strategy: Any
    model: Any  # OnlineEagle3Model
    optimizer: Any  # BF16Optimizer
    data: OfflineData
    schedule: BatchSchedule
    micro_batch: int
    device: torch.device
    dtype: torch.dtype
    mask: str
    eager: bool

    def chunks(self, step: int) -> list[list[int]]:
        """Step ``step``'s rows in micro-batches, as the train stage cuts them (one rank)."""
        return rank_chunks(self.schedule.rows(step), 0, 1, self.data.length, self.micro_batch)

    def feeder(self, steps: range, prefetch: int) -> Any:
        """The train stage's batch assembly: a feeder thread ahead of the GPU, inline on the CPU."""
        if self.device.type == "cuda" and prefetch:
            return Feeder(self.data, steps, self.chunks, self.device, self.dtype, prefetch)
        return Inline(self.data, self.chunks, self.device, self.dtype)

    def step(self, step: int, batches: list[Batch]) -> dict[str, Any]:
        """One optimiser step over ``batches`` (step ``step``'s micro-batches); its metrics stay on the device
        (no host sync) until :func:`summary` reads them."""
        from specforge.runtime.contracts import TrainBatch

        chunks = self.chunks(step)
        lr = self.optimizer.get_learning_rate()
        loss: Any = 0.0
        correct: Any = 0.0
        denom: Any = 0.0
        for c, b in zip(chunks, batches, strict=True):
            tb = TrainBatch(
                sample_ids=[self.data.row_id(i) for i in c],
                strategy="eagle3",
                tensors=specforge_tensors(b, self.mask),
                metadata={"target_repr": "hidden_state"},
            )
            out = self.strategy.forward_loss(tb)
            (out.loss / len(chunks)).backward()  # TrainerCore: loss / accumulation_steps
            loss = loss + out.loss.detach() / len(chunks)
            correct = correct + torch.stack([x.float() for x in out.metrics["acc_corrects"]])
            denom = denom + torch.stack([x.float() for x in out.metrics["acc_denoms"]])
        grad_norm = self.optimizer.step()
        out_ = dict(step=step, loss=loss, correct=correct, denom=denom, lr=lr, grad_norm=grad_norm)
        return out_ | {"tokens": sum(self.data.length(i) for c in chunks for i in c)}

    def step_or_eager(
        self, step: int, batches: list[Batch], stack: contextlib.ExitStack, res: dict[str, Any]
    ) -> dict[str, Any]:
        """:meth:`step`; where SpecForge's compiled or Triton path fails, the step again eagerly (and every
        step after it, ``specforge_eager`` entered on ``stack``), with a printed note kept in ``res``."""
        try:
            return self.step(step, batches)
        except (torch.cuda.OutOfMemoryError, SetupError):
            raise
        except Exception as exc:  # noqa: BLE001 - its torch.compile / Triton paths on this machine
            if self.eager:
                raise
            why = (
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
            )
            log(f"note: SpecForge's torch.compile/Triton path failed at step {step} ({why}); eager from here")
            res["eager_fallback"] = f"step {step}: {why}"
            for p in self.model.parameters():
                p.grad = None
            self.eager = True
            stack.enter_context(specforge_eager())
            return self.step(step, batches)


def summary(r: dict[str, Any]) -> dict[str, Any]:
    """A step's metrics as numbers: loss, per-TTT-step accuracy (greedy hits / scored tokens), lr, grad norm."""
    acc = (r["correct"] / r["denom"].clamp(min=1.0)).tolist()
    out = dict(step=r["step"], loss=float(r["loss"]), acc=acc, lr=r["lr"], grad_norm=float(r["grad_norm"]))
    return out | {"tokens": r["tokens"]}


def build(
    inp: RunInputs, device: torch.device, backend: str, mask: str
) -> tuple[SpecForgeTrainer, Eagle3Draft]:
    """The trainer, and Aerie's freshly initialised draft (its config, embedding and vocab map for the export)."""
    from specforge.optimizer import BF16Optimizer
    from specforge.training.strategies.base import Eagle3TrainStrategy

    s = inp.settings
    draft, _head_d, head_full = build_draft(
        inp.model_id, list(inp.manifest.aux_layer_ids), inp.vocab, s, inp.trust_remote_code
    )
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # SpecForge trains its draft in bf16
    model = wrap_specforge(draft, s.ttt_steps, backend).to(device, dtype)
    strategy = Eagle3TrainStrategy(model, target_head=target_head(head_full).to(device, dtype))
    optimizer = BF16Optimizer(model, lr=s.lr, total_steps=s.steps)  # its defaults for everything else
    data = OfflineData(hs.HiddenStore(inp.ext_dir))
    n = len(data)
    if n < s.batch_size:
        raise SetupError(
            f"{inp.ext_dir / 'manifest.json'}: only {n} training rows but --batch is {s.batch_size}"
        )
    lengths = [data.length(i) for i in range(n)] if s.length_grouping else None
    schedule = BatchSchedule(n, s.batch_size, s.seed, lengths, s.length_grouping)
    model.train()
    trainer = SpecForgeTrainer(
        strategy, model, optimizer, data, schedule, s.micro_batch, device, dtype, mask, eager=not cuda
    )
    return trainer, draft


def export(trainer: SpecForgeTrainer, draft: Eagle3Draft, inp: RunInputs, out: Path, steps: int) -> Path:
    """SpecForge's trained weights into Aerie's draft, written by the train stage's ``save_draft`` into ``out``
    (the folder SGLang loads: ``config.json``, ``model.safetensors``), with a ``manifest.json`` (kind ``draft``,
    path ``.``) so the bench stage takes ``out`` as its input as it takes a train stage's out dir."""
    sf_draft = trainer.model.draft_model
    names = param_map(draft, sf_draft)
    state = sf_draft.state_dict()
    draft.load_state_dict({k: state[names[k]].detach().float().cpu() for k in names}, strict=True)
    out.mkdir(parents=True, exist_ok=True)
    save_draft(draft.cpu(), out)
    man, s = inp.manifest, inp.settings
    doc: dict[str, Any] = {
        "kind": "draft",
        "path": ".",
        "step": steps,
        "last_step": steps,
        "stopped_early": None,
    }
    doc.update(chosen_by="last step", accept_length=None, eval_spec_steps=None, target=inp.model_id)
    doc.update(aux_layer_ids=list(man.aux_layer_ids), draft_vocab_size=inp.vocab.size, ttt_steps=s.ttt_steps)
    doc.update(loss="specforge", trainer=f"specforge {SPECFORGE_VERSION}", fc_norm=False, norm_output=False)
    doc.update(mode="offline", token_sources=list(man.sources or ()), holdout=man.holdout)
    doc.update(max_length=man.max_length, world_size=1)
    write_json(out / "manifest.json", doc)  # the train stage's manifest keys, for the bench stage
    return out


def load_inputs(args: argparse.Namespace) -> tuple[Any, int]:
    """The run's (or store's) inputs with the command line's ``[train]`` overrides; the micro-batch it uses."""
    overrides: dict[str, Any] = {
        "steps": args.steps,
        "batch_size": args.batch,
        "lr": args.lr,
        "seed": args.seed,
        "draft_fc_norm": False,
        "draft_norm_output": False,
    }
    if args.ttt:
        overrides["ttt_steps"] = args.ttt
    inp = load_run(
        Path(args.run) if args.run else None,
        Path(args.store) if args.store else None,
        Path(args.vocab) if args.vocab else None,
        Path(args.plan) if args.plan else None,
        **overrides,
    )
    s = inp.settings
    micro = min(args.micro_batch or s.micro_batch, s.batch_size)
    inp.settings = s = dataclasses.replace(s, micro_batch=micro)
    return inp, micro


def run_steps(
    trainer: Any, s: Any, every: int, res: dict[str, Any], save: Callable[[], None]
) -> tuple[float | None, int]:
    """SpecForge's steps, a summary logged every ``every`` (and saved); (the first logged loss, tokens trained)."""
    first_loss: float | None = None
    tokens = 0
    with contextlib.ExitStack() as stack:
        if trainer.eager:
            stack.enter_context(specforge_eager())
        feeder = trainer.feeder(range(1, s.steps + 1), s.prefetch)
        stack.callback(feeder.close)
        for step in range(1, s.steps + 1):
            t_step = time.monotonic()
            batches = feeder.next(step)
            r = trainer.step_or_eager(step, batches, stack, res)
            tokens += r["tokens"]
            if step % every == 0 or step in (1, s.steps):
                r = summary(r)
                first_loss = r["loss"] if first_loss is None else first_loss
                r["tokens_per_s"] = round(r["tokens"] / max(time.monotonic() - t_step, 1e-9), 1)
                res["log"].append(r)
                accs = "/".join(f"{a:.3f}" for a in r["acc"])
                log(
                    f"step {step}/{s.steps} loss {r['loss']:.4f} acc {accs} lr {r['lr']:.2e} "
                    f"grad-norm {r['grad_norm']:.3f} {r['tokens_per_s']:,.0f} tok/s"
                )
                save()
    return first_loss, tokens


def train(args: argparse.Namespace) -> dict[str, Any]:
    inp, micro = load_inputs(args)
    s = inp.settings
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "bench": "specforge_train",
        "specforge": SPECFORGE_VERSION,
        "store": str(inp.ext_dir),
    }
    res.update(target=inp.model_id, device=str(device), steps=s.steps, batch=s.batch_size, micro_batch=micro)
    res.update(lr=s.lr, seed=s.seed, ttt=s.ttt_steps, mask=args.mask, backend=args.backend, log=[])

    def save() -> None:
        (out / RESULTS).write_text(json.dumps(res, indent=1) + "\n")
        write_out(RESULTS, res)

    t0 = time.monotonic()
    trainer, draft = build(inp, device, args.backend, args.mask)
    res["build_s"] = round(time.monotonic() - t0, 2)
    log(
        f"SpecForge {SPECFORGE_VERSION} training on {len(trainer.data):,} stored rows ({inp.ext_dir}) on {device}: "
        f"{s.steps} steps x {s.batch_size} (micro-batch {micro}), lr {s.lr}, TTT {s.ttt_steps}, seed {s.seed}, "
        f"draft vocab {inp.vocab.size}"
    )
    every = args.log_every or max(1, s.steps // 20)
    t_train = time.monotonic()
    first_loss, tokens = run_steps(trainer, s, every, res, save)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        res["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    res["train_s"] = round(time.monotonic() - t_train, 2)
    res["train_tok_s"] = round(tokens / max(res["train_s"], 1e-9), 1)
    res["eager"] = trainer.eager
    res["first_loss"], res["last_loss"] = first_loss, res["log"][-1]["loss"]
    path = export(trainer, draft, inp, out, s.steps)
    res["draft"] = str(path)
    save()
    log(
        f"draft written to {path} (loss {first_loss:.4f} -> {res['last_loss']:.4f}, {res['train_s']:.0f} s, "
        f"{res['train_tok_s']:,.0f} tok/s); bench it: python -m pipeline.stages.bench --plan {inp.plan_path or 'PLAN'} "
        f"--input {out} --out BENCH_DIR"
    )
    return res


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--run", help="Aerie run dir where extract (offline) and vocab have run")
    ap.add_argument("--store", help="instead of --run: the extract stage's out dir (the hidden-state store)")
    ap.add_argument("--vocab", help="with --store: the vocab stage's out dir")
    ap.add_argument("--plan", help="with --store: the plan (default: plan.toml beside the store, if any)")
    ap.add_argument(
        "--out", required=True, help="the draft folder: config.json, model.safetensors, manifest.json"
    )
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True, help="sequences per optimiser step")
    ap.add_argument("--lr", type=float, required=True, help="peak learning rate")
    ap.add_argument("--seed", type=int, required=True, help="the data order's and the draft init's seed")
    ap.add_argument("--ttt", type=int, default=0, help="TTT steps (default: the plan's [train] ttt_steps)")
    ap.add_argument("--device", default="", help="cuda or cpu (default: cuda if there is one)")
    ap.add_argument("--micro-batch", type=int, default=0, help="rows per forward (default: the plan's)")
    ap.add_argument("--mask", choices=("aerie", "specforge"), default="aerie", help="which tokens are scored")
    ap.add_argument(
        "--backend", choices=("sdpa", "flex_attention"), default="sdpa", help="SpecForge's attention"
    )
    ap.add_argument(
        "--log-every", type=int, default=0, help="steps between progress lines (default: steps/20)"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = specforge_available()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        train(args)
    except (SetupError, plan_mod.PlanError, hs.StoreError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
