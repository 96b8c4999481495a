"""Training stage: the EAGLE-3 draft with training-time test, checkpoints, resume, and torchrun DDP.

``python -m pipeline.train --plan PLAN [--input DIR ...] [--out DIR]``

Inputs (found by manifest kind): the extraction (``hidden_states``; offline shards, or in online
mode the tokenized sources the target is run over on the fly) and the draft vocabulary (``vocab``).
Each step takes ``[train] batch_size`` sequences (the global batch), unrolls TTT over ``ttt_steps``
and minimises ``sum_j loss_decay**j * CE_j``, the soft-label cross-entropy between the draft and the
target's distribution over the draft vocabulary, on the positions whose predicted token is an
assistant token (``loss_mask``). ``acc_j`` is the share of those positions where the draft's greedy
token (mapped through d2t) equals the target's greedy token.

fp32 on the CPU, bf16 autocast (fp32 master weights) on a GPU. Every ``checkpoint_every`` steps a
checkpoint ``checkpoints/step_NNNNNNNN/`` (SGLang-loadable ``config.json`` + ``model.safetensors``,
plus ``training_state.pt``) appears atomically; a retry resumes from the newest one and the loss
curve continues from that step. The finished draft is ``draft/`` (pass it to SGLang as
``--speculative-draft-model-path``).

Several processes: ``[train] nproc = N`` makes the stage re-run itself under ``torchrun`` (gloo on the
CPU, NCCL on GPUs); plain DDP, every rank holds the whole draft; the global batch is split by rank
(``idx[rank::world]``) and the loss is normalised by the *global* count of loss positions, so N
processes compute exactly the update one process computes on the same global batch.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pipeline import draft_vocab
from pipeline import hidden_store as hs
from pipeline.eagle3_model import DraftConfig, Eagle3Draft, save_draft, shift_left
from pipeline.rundir import write_json
from pipeline.runtime import StageContext, add_common_args, fail
from pipeline.shards import find_manifests

CKPT_DIR = "checkpoints"
STATE_FILE = "training_state.pt"
FINAL_DIR = "draft"


@dataclass
class TrainSettings:
    steps: int = 200
    batch_size: int = 8  # global batch, in sequences
    micro_batch: int = 8  # per rank, per forward
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = -1  # -1: 1.5 % of steps (SpecForge's warmup ratio)
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    ttt_steps: int = 7
    loss_decay: float = 0.8
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 1
    seed: int = 0
    nproc: int = 1
    device: str = ""
    init_lm_head: str = "target"  # "target": rows of the target's LM head; "random"
    max_length: int = 0  # 0: [target] max_length

    @classmethod
    def from_section(cls, sec: dict[str, Any], where: str) -> TrainSettings:
        known = {f.name: f for f in fields(cls)}
        vals: dict[str, Any] = {}
        for k, v in sec.items():
            if k == "mode":
                continue
            if k not in known:
                raise ValueError(f"{where}: train.{k}: unknown key (known: mode, {', '.join(sorted(known))})")
            want = type(getattr(cls(), k))
            if want is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, want) or isinstance(v, bool):
                raise ValueError(f"{where}: train.{k}: expected {want.__name__}, got {v!r}")
            vals[k] = v
        s = cls(**vals)
        for k in ("steps", "batch_size", "micro_batch", "ttt_steps", "checkpoint_every", "log_every", "nproc"):
            if getattr(s, k) < 1:
                raise ValueError(f"{where}: train.{k}: must be at least 1")
        if s.batch_size % s.nproc:
            raise ValueError(f"{where}: train.batch_size ({s.batch_size}) must be a multiple of train.nproc ({s.nproc})")
        if s.init_lm_head not in ("target", "random"):
            raise ValueError(f"{where}: train.init_lm_head: 'target' or 'random', got {s.init_lm_head!r}")
        return s

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps >= 0 else max(1, round(0.015 * self.steps))


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step (1-based)."""
    if step <= s.warmup:
        return s.lr * step / max(1, s.warmup)
    frac = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def global_indices(step: int, n: int, batch_size: int, seed: int) -> list[int]:
    """The samples of (1-based) ``step``: a fresh seeded permutation per epoch, last partial batch dropped."""
    per_epoch = n // batch_size
    epoch, b = divmod(step - 1, per_epoch)
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    perm = torch.randperm(n, generator=g)
    return perm[b * batch_size:(b + 1) * batch_size].tolist()


# ------------------------------------------------------------------------------ distributed
class Dist:
    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def init(self, device: torch.device) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def any(self, flag: bool, device: torch.device) -> bool:
        return bool(self.sum(torch.tensor([1.0 if flag else 0.0], device=device)).item() > 0)

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def die_with_parent() -> None:
    """torchrun starts workers in their own sessions; tie each to its agent so a SIGKILL of the
    stage's process group can never leave a worker training on (Linux ``PR_SET_PDEATHSIG``)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:
        os._exit(1)


def reexec_under_torchrun(nproc: int, argv: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "pipeline.train", *argv]
    os.execv(sys.executable, cmd)


# ------------------------------------------------------------------------------ data
@dataclass
class Batch:
    aux: torch.Tensor  # (B, S, 3H)
    last_hidden: torch.Tensor  # (B, S, H)
    target_argmax: torch.Tensor  # (B, S) long
    input_ids: torch.Tensor  # (B, S) long
    loss_mask: torch.Tensor  # (B, S) bool
    lengths: torch.Tensor  # (B,)

    def step_mask(self, j: int) -> torch.Tensor:
        """Columns whose step-``j`` prediction (token ``t+2+j``) is an assistant token."""
        return shift_left(self.loss_mask, 2 + j, False)


def pad_stack(seqs: list[torch.Tensor], length: int, fill: float = 0) -> torch.Tensor:
    out = torch.full((len(seqs), length, *seqs[0].shape[1:]), fill, dtype=seqs[0].dtype)
    for i, s in enumerate(seqs):
        out[i, : s.shape[0]] = s
    return out


class OfflineData:
    def __init__(self, store: hs.HiddenStore) -> None:
        self.store = store

    def __len__(self) -> int:
        return len(self.store)

    def length(self, i: int) -> int:
        return self.store.length(i)

    def batch(self, idx: list[int], device: torch.device, dtype: torch.dtype) -> Batch:
        samples = [self.store[i] for i in idx]
        n = max(s.input_ids.shape[0] for s in samples)
        return Batch(
            pad_stack([s.aux for s in samples], n).to(device, dtype),
            pad_stack([s.last_hidden for s in samples], n).to(device, dtype),
            pad_stack([s.target_argmax for s in samples], n).to(device, torch.long),
            pad_stack([s.input_ids for s in samples], n).to(device, torch.long),
            pad_stack([s.loss_mask for s in samples], n).to(device, torch.bool),
            torch.tensor([s.input_ids.shape[0] for s in samples], device=device),
        )


class OnlineData:
    """Runs the target over tokenized rows for every batch: nothing is stored."""

    def __init__(self, rows: list[Any], target: Any) -> None:
        self.rows = rows
        self.target = target

    def __len__(self) -> int:
        return len(self.rows)

    def length(self, i: int) -> int:
        return self.rows[i].num_tokens

    def batch(self, idx: list[int], device: torch.device, dtype: torch.dtype) -> Batch:
        rows = [self.rows[i] for i in idx]
        n = max(r.num_tokens for r in rows)
        ids = pad_stack([torch.from_numpy(r.input_ids.astype("int64")) for r in rows], n).to(device)
        lengths = torch.tensor([r.num_tokens for r in rows], device=device)
        attn = (torch.arange(n, device=device)[None, :] < lengths[:, None]).long()
        cap = self.target.capture(ids, attention_mask=attn)
        am = self.target.argmax(cap.last_hidden)
        mask = pad_stack([torch.from_numpy(r.loss_mask) for r in rows], n).to(device, torch.bool)
        return Batch(cap.aux.to(dtype), cap.last_hidden.to(dtype), am, ids, mask, lengths)


# ------------------------------------------------------------------------------ loss
def counts_of(batches: list[Batch], steps: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([sum(int(b.step_mask(j).sum()) for b in batches) for j in range(steps)],
                        dtype=torch.float64, device=device)


def ttt_sums(model: Any, draft: Eagle3Draft, b: Batch, head_d: torch.Tensor, steps: int,
             autocast: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per TTT step: the summed soft-label CE (with grad) and the number of correct greedy tokens."""
    with torch.no_grad():
        tgt = (b.last_hidden.float() @ head_d.float().T).log_softmax(-1)  # target over the draft vocab
    with torch.autocast(b.aux.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(b.aux, b.input_ids, b.lengths, steps)
    losses, correct = [], torch.zeros(steps, dtype=torch.float64, device=b.aux.device)
    for j, lj in enumerate(logits):
        lj = lj.float()
        m = b.step_mask(j)
        am = shift_left(b.target_argmax, 1 + j)
        p = shift_left(tgt, 1 + j).exp()
        in_vocab = draft.t2d[am]
        ce = -(p * F.log_softmax(lj, dim=-1)).sum(-1)
        losses.append((ce * (m & in_vocab)).sum())
        with torch.no_grad():
            guess = draft.draft_to_target(lj.argmax(-1))
            correct[j] = ((guess == am) & m).sum()
    return losses, correct


# ------------------------------------------------------------------------------ checkpoints
def checkpoints(out: Path) -> list[tuple[int, Path]]:
    d = out / CKPT_DIR
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        if p.name.startswith("step_") and (p / STATE_FILE).is_file():
            try:
                found.append((int(p.name[5:]), p))
            except ValueError:
                continue
    return sorted(found)


def save_checkpoint(out: Path, step: int, draft: Eagle3Draft, opt: torch.optim.Optimizer, settings: TrainSettings,
                    extra: dict[str, Any]) -> Path:
    final = out / CKPT_DIR / f"step_{step:08d}"
    tmp = out / CKPT_DIR / f".step_{step:08d}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    save_draft(draft, tmp)
    state = {"step": step, "model": {k: v.detach().cpu() for k, v in draft.trainable_state().items()},
             "optimizer": opt.state_dict(), "settings": asdict(settings), **extra}
    torch.save(state, tmp / STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in checkpoints(out)[: -settings.keep_checkpoints]:
        if old.resolve().is_relative_to(out.resolve()):
            shutil.rmtree(old)
    return final


# ------------------------------------------------------------------------------ setup
def find_inputs(dirs: list[Path]) -> tuple[dict, Path, Path]:
    """(extraction manifest, its dir, vocab dir) among the input dirs, by manifest kind."""
    ext = vocab = None
    for d in dirs:
        for mpath, man in find_manifests(d):
            if man.get("kind") == hs.KIND:
                ext = (man, mpath.parent)
            elif man.get("kind") == draft_vocab.MANIFEST_KIND:
                vocab = mpath.parent
    if ext is None:
        raise ValueError(f"no extraction among the inputs ({', '.join(map(str, dirs))}): put the extract stage in 'after'")
    if vocab is None:
        raise ValueError(f"no draft vocabulary among the inputs ({', '.join(map(str, dirs))}): put the vocab stage in 'after'")
    return ext[0], ext[1], vocab


def pick_device(s: TrainSettings, dist: Dist) -> torch.device:
    if s.device:
        dev = torch.device(s.device)
    else:
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        dev = torch.device("cuda", dist.local_rank)
        torch.cuda.set_device(dev)
    return dev


def build_draft(model_id: str, aux: list[int], vm: draft_vocab.VocabMap, s: TrainSettings) -> tuple[Eagle3Draft, torch.Tensor]:
    from pipeline.target_capture import load_target_tensors, target_config

    tcfg = target_config(model_id)
    cfg = DraftConfig.from_target(tcfg, vm.size, aux)
    torch.manual_seed(s.seed)
    draft = Eagle3Draft(cfg)
    t = load_target_tensors(model_id)
    draft.embed_tokens.weight.data.copy_(t["embed"])
    draft.set_vocab(vm.d2t, vm.t2d)
    head_d = t["head"][vm.draft_ids].clone()
    if s.init_lm_head == "target":
        draft.lm_head.weight.data.copy_(head_d)
        draft.norm.weight.data.copy_(t["norm"])
    return draft, head_d


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m pipeline.train", description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--input", action="append", default=[], help="an upstream out dir (default: the stage's inputs)")
    args = ap.parse_args(argv)
    dist = Dist()
    if dist.world > 1:
        die_with_parent()
    ctx = StageContext.from_cli(args) if dist.main else None
    plan_ctx = ctx or StageContext.from_cli(args)  # non-zero ranks read the plan, never emit
    try:
        s = TrainSettings.from_section(plan_ctx.plan.section("train"), str(plan_ctx.plan.path))
        mode = hs.storage_mode(plan_ctx.plan)
    except (ValueError, hs.StoreError) as exc:
        fail(ctx, str(exc))
    if s.nproc > 1 and "LOCAL_RANK" not in os.environ:
        if ctx is not None:
            ctx.message(f"starting {s.nproc} processes under torchrun")
            ctx.close()
        reexec_under_torchrun(s.nproc, argv)
    if dist.world != s.nproc and "LOCAL_RANK" in os.environ and ctx is not None:
        ctx.message(f"running with WORLD_SIZE={dist.world} (plan says nproc={s.nproc})", level="warning")
    inputs = [Path(p) for p in args.input] if args.input else [plan_ctx.inputs[k] for k in sorted(plan_ctx.inputs)]
    try:
        return train(ctx, plan_ctx, s, mode, inputs, dist)
    except (ValueError, hs.StoreError, draft_vocab.VocabError) as exc:
        fail(ctx, str(exc))
    finally:
        dist.close()
    return 1


def train(ctx: StageContext | None, plan_ctx: StageContext, s: TrainSettings, mode: str, inputs: list[Path],
          dist: Dist) -> int:
    plan = plan_ctx.plan
    out = plan_ctx.out
    model_id = str(plan.target.get("model") or "")
    man, ext_dir, vocab_dir = find_inputs(inputs)
    aux = list(man["aux_layer_ids"])
    if man.get("target") not in (None, model_id):
        raise ValueError(f"{ext_dir / 'manifest.json'}: extracted from {man.get('target')!r} but the plan's target is {model_id!r}")
    device = pick_device(s, dist)
    dist.init(device)
    autocast = device.type == "cuda"
    dtype = torch.bfloat16 if autocast else torch.float32
    vm = draft_vocab.load(vocab_dir)
    draft, head_d = build_draft(model_id, aux, vm, s)
    draft.to(device)
    head_d = head_d.to(device)
    if man["mode"] == "offline":
        data: Any = OfflineData(hs.HiddenStore(ext_dir))
    else:
        from pipeline.shards import iter_rows, training_order
        from pipeline.target_capture import load_target

        max_len = man.get("max_length") or s.max_length or plan.target.get("max_length")
        wanted = set(man.get("row_ids") or [])
        rows = training_order([r for r in iter_rows([Path(p) for p in man["sources"]], float(man.get("holdout", 0.0)),
                                                    "train", None, max_len) if r.id in wanted])
        if len(rows) != len(wanted):
            raise ValueError(f"{ext_dir / 'manifest.json'}: lists {len(wanted)} rows but the sources now hold "
                             f"{len(rows)} of them; rerun extraction with --fresh")
        data = OnlineData(rows, load_target(model_id, aux, dtype=dtype, device=device))
    n = len(data)
    if s.batch_size % dist.world:
        raise ValueError(f"train.batch_size ({s.batch_size}) must be a multiple of the {dist.world} processes")
    if n < s.batch_size:
        raise ValueError(f"only {n} training sequences but train.batch_size is {s.batch_size}")
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay)
    start = 0
    found = checkpoints(out)
    if found:
        step0, path = found[-1]
        st = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        draft.load_state_dict(st["model"], strict=False)
        opt.load_state_dict(st["optimizer"])
        start = int(st["step"])
        if ctx:
            ctx.message(f"resuming from checkpoint {path.name} (step {start})", code="resumed_from_checkpoint", step=start)
    model: Any = draft
    if dist.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(draft, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
    draft.train()
    if ctx:
        ctx.message(f"training {sum(p.numel() for p in params) / 1e6:.1f}M parameters on {n:,} sequences "
                    f"({man['mode']} data), {dist.world} process(es) on {device.type}, steps {start + 1}..{s.steps}, "
                    f"TTT {s.ttt_steps}")
        ctx.progress(start, s.steps, unit="steps", force=True)
    per_rank = s.batch_size // dist.world
    extra = {"world_size": dist.world, "aux_layer_ids": aux, "mode": man["mode"]}
    last_saved = start
    for step in range(start + 1, s.steps + 1):
        if dist.any(plan_ctx.pause_requested(), device):
            wait_paused(ctx, plan_ctx, dist, device)
        t0 = time.monotonic()
        idx = global_indices(step, n, s.batch_size, s.seed)[dist.rank::dist.world]
        idx.sort(key=lambda i: (-data.length(i), i))
        chunks = [idx[a:a + s.micro_batch] for a in range(0, per_rank, s.micro_batch)]
        batches = [data.batch(c, device, dtype) for c in chunks]
        counts = dist.sum(counts_of(batches, s.ttt_steps, device))
        denom = counts.clamp(min=1)
        lr = lr_at(step, s)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss_sums = torch.zeros(s.ttt_steps, dtype=torch.float64, device=device)
        correct = torch.zeros(s.ttt_steps, dtype=torch.float64, device=device)
        for bi, b in enumerate(batches):
            sync = bi == len(batches) - 1 or dist.world == 1
            ctxm = model.no_sync() if (dist.world > 1 and not sync) else _null()
            with ctxm:
                losses, corr = ttt_sums(model, draft, b, head_d, s.ttt_steps, autocast)
                total = sum((s.loss_decay ** j) * losses[j] / denom[j] for j in range(s.ttt_steps))
                (total * dist.world).backward()
            loss_sums += torch.stack([x.detach().double() for x in losses])
            correct += corr
        torch.nn.utils.clip_grad_norm_(params, s.max_grad_norm)
        opt.step()
        stats = dist.sum(torch.cat([loss_sums, correct, torch.tensor([float(sum(int(b.lengths.sum()) for b in batches))],
                                                                      dtype=torch.float64, device=device)]))
        dt = time.monotonic() - t0
        k = s.ttt_steps
        step_loss = sum((s.loss_decay ** j) * float(stats[j] / denom[j]) for j in range(k))
        if ctx and (step % s.log_every == 0 or step == s.steps or step == start + 1):
            ctx.metric("loss", step_loss, step=step)
            for j in range(k):
                ctx.metric(f"acc_{j}", float(stats[k + j] / denom[j]), step=step)
            ctx.metric("lr", lr, step=step)
            ctx.metric("tokens_per_s", float(stats[2 * k]) / max(dt, 1e-9), step=step)
            ctx.progress(step, s.steps, unit="steps")
        if step % s.checkpoint_every == 0 or step == s.steps:
            if dist.main:
                p = save_checkpoint(out, step, draft, opt, s, extra)
                if ctx:
                    ctx.message(f"checkpoint {p.name}", code="checkpoint", step=step)
            last_saved = step
            dist.barrier()
    if dist.main:
        final = out / FINAL_DIR
        tmp = out / (FINAL_DIR + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        save_draft(draft, tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_json(out / "manifest.json", {
            "kind": "draft", "path": FINAL_DIR, "step": last_saved, "target": model_id, "aux_layer_ids": aux,
            "draft_vocab_size": vm.size, "ttt_steps": s.ttt_steps, "mode": man["mode"],
            "token_sources": list(man.get("sources", [])), "holdout": man.get("holdout"),
            "max_length": man.get("max_length"), "world_size": dist.world,
        })
        if ctx:
            ctx.progress(s.steps, s.steps, unit="steps", force=True)
            ctx.message(f"draft written to {final} (SGLang: --speculative-algorithm EAGLE3 "
                        f"--speculative-draft-model-path {final})")
    return 0


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def wait_paused(ctx: StageContext | None, plan_ctx: StageContext, dist: Dist, device: torch.device) -> None:
    """All ranks pause together (a rank alone in a collective would hang) and resume together."""
    if ctx:
        ctx.message("paused at a safe point", code="paused")
    while dist.any(plan_ctx.pause_requested(), device):
        time.sleep(0.5)
    if ctx:
        ctx.message("resumed", code="resumed")


if __name__ == "__main__":
    sys.exit(main())
