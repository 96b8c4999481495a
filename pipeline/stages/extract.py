"""Extraction stage: run the target over the prepped shards and store what EAGLE-3 training needs.

``python -m pipeline.stages.extract --plan PLAN [--input DIR ...] [--out DIR]``

Reads every ``tokenized`` manifest of its inputs (``prompts`` manifests are skipped), leaves out the
held-out rows (``[bench] holdout``), orders the rest by length and cuts them into shards of about
``[extract] shard_tokens`` tokens; each shard is run through the target in batches of at most
``batch_tokens`` padded tokens and written atomically (see ``pipeline.eagle3.hidden_store``). The host
copy and the write run behind the target (``pipeline.eagle3.shard_sink``: pinned buffers and
asynchronous copies on CUDA, a writer thread streaming each batch into its shard file while the
next batch runs, one fsync per shard). A retry skips the shards already written, so a kill costs at
most the shards in flight. Events: progress in tokens, a ``tokens_per_s`` metric per batch (with the
writer behind, the first batches of a run can read high; the ``overall`` one at the end is exact), ``projected_bytes`` before the first shard and ``actual_bytes``
after each. With ``[extract] mode = "online"`` nothing is stored: the manifest only points training
at the tokenized sources, and ``projected_bytes`` is 0.

Plan keys (``[extract]``): ``mode``, ``aux_layers`` (default SpecForge's ``[1, L//2-1, L-4]``),
``batch_tokens`` (8192), ``shard_tokens`` (262144), ``max_length`` (default ``[target] max_length``),
``max_rows`` / ``max_tokens`` (caps, for demos), ``eval_rows`` (64: held-out rows stored as ``eval-*`` shards,
on which training measures acceptance), ``device`` (``"auto"``: the target's layers spread over
every visible GPU, for a target no single GPU holds), ``parallel = "tp"`` with ``tp_size`` (default: the
number of GPUs the stage holds), ``dtype`` (bf16 on GPU, fp32 on CPU), ``write_queue`` (2: batches
that may wait for the writer thread; 0 writes in the stage's own thread, one batch at a time) and
``io_threads`` (4: parallel ``pwrite`` calls for one batch's large tensors).

**Capture through SGLang** (``[target] engine = "sglang"``, offline mode on GPUs): the target is loaded by
SGLang's own model runner in this process (``pipeline.eagle3.sglang_target``: its kernels, its tensor
parallelism over the torchrun ranks of ``parallel = "tp"``, quantized weights kept packed) and told to capture
the same aux layers; its packed output is laid out as the transformers capture's, so the store is the same.

**Tensor-parallel capture** (``parallel = "tp"``, for a target like Kimi-K2.5 that no GPU holds): the
stage re-runs itself under ``torchrun`` with ``tp_size`` ranks; each rank loads its shard of the target
(transformers' ``tp_plan="auto"``: MLP and MoE experts split across ranks), every rank runs the same
batch (the all-reduces leave every rank the same hidden states), and rank 0 alone writes the shards
and speaks for the stage. Pause is taken by all ranks together at a batch boundary. ``device =
"auto"`` remains for a target spread layer by layer (one GPU busy at a time).

Over 450 lines: one stage program whose steps (the rows to extract, the target, the resumable shard state,
the capture loop) are used only here, each a function of its own; a sibling module would be another "stage"
to the layout rules, so a split waits for the stage to become a package.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline import tested_versions
from pipeline.data.shards import Row, ShardError, holdout_fraction, iter_rows, training_order
from pipeline.eagle3 import hidden_store as hs
from pipeline.eagle3.draft_config import (
    DraftModelError,
    default_aux_layers,
    normalise_aux_layers,
    sglang_capture_ids,
)
from pipeline.eagle3.shard_sink import HostBatch, HostStager, ShardSink, ShardWriteError, WrittenShard
from pipeline.manifests import hidden_store as hs_manifest
from pipeline.manifests.hidden_store import HiddenStatesManifest, StoredShard
from pipeline.run.hosts import nospace
from pipeline.run.plan.sections import ExtractSection
from pipeline.run.rundir.layout import read_json, write_json
from pipeline.run.stage_side.ranks import Dist, tensor_parallel_rank, tp_device
from pipeline.run.stage_side.runtime import StageContext, add_common_args, fail

STATE_FILE = "extract-state.json"


def pick_device(sec: ExtractSection) -> tuple[str, torch.dtype]:
    """``(device, dtype)``; ``device = "auto"`` spreads the target's layers over every visible GPU."""
    dev = sec.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = torch.cuda.is_available() if dev == "auto" else torch.device(dev).type == "cuda"
    name = sec.dtype or ("bfloat16" if on_gpu else "float32")
    dtypes = {
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float32": torch.float32,
        "fp32": torch.float32,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in dtypes:
        raise ValueError(f"dtype {name!r} not supported (use one of {', '.join(dtypes)})")
    return dev, dtypes[name]


def aux_layers_from(sec: ExtractSection, num_layers: int, where: str) -> list[int]:
    """``[extract] aux_layers`` as SGLang will capture them: ascending, distinct, in range."""
    if sec.aux_layers is None:
        return default_aux_layers(num_layers)
    try:
        return normalise_aux_layers(list(sec.aux_layers), num_layers, f"{where}: extract.aux_layers")
    except DraftModelError as exc:
        raise ValueError(str(exc)) from None


def plan_shards(rows: list[Row], shard_tokens: int) -> list[list[Row]]:
    """Rows in training order (longest first, then id), cut into shards of about ``shard_tokens`` tokens."""
    ordered = training_order(rows)
    shards: list[list[Row]] = []
    cur: list[Row] = []
    n = 0
    for r in ordered:
        if cur and n + r.num_tokens > shard_tokens:
            shards.append(cur)
            cur, n = [], 0
        cur.append(r)
        n += r.num_tokens
    if cur:
        shards.append(cur)
    return shards


def length_batches(rows: list[Row], batch_tokens: int) -> list[list[Row]]:
    """Consecutive rows (already sorted by length) in batches whose padded size fits the budget."""
    out: list[list[Row]] = []
    cur: list[Row] = []
    longest = 0
    for r in rows:
        longest_new = max(longest, r.num_tokens)
        if cur and longest_new * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur, longest_new = [], r.num_tokens
        cur.append(r)
        longest = longest_new
    if cur:
        out.append(cur)
    return out


def eval_split(inputs: list[Path], holdout: float, vocab_size: int, max_length: Any, n: int) -> list[Row]:
    """The first ``n`` held-out rows (training order) with something to predict: stored apart, so the train
    stage can measure acceptance on rows it never trains on (the bench stage's prompts come from the same split)."""
    if n <= 0 or holdout <= 0:
        return []
    held = [
        r
        for r in iter_rows(inputs, holdout, "heldout", vocab_size, max_length)
        if r.num_tokens >= 2 and r.loss_mask.any()
    ]
    return training_order(held)[:n]


def fingerprint(rows: list[Row], aux: list[int], model: str) -> str:
    h = hashlib.sha1(json.dumps([model, aux]).encode())
    for r in rows:
        h.update(f"{r.id}:{r.num_tokens};".encode())
    return h.hexdigest()


def collect_inputs(args: argparse.Namespace, ctx: StageContext) -> list[Path]:
    dirs = [Path(p) for p in args.input] if args.input else [ctx.inputs[k] for k in sorted(ctx.inputs)]
    return dirs


def capture_batch(target: Any, batch: list[Row]) -> tuple[Any, torch.Tensor]:
    """The target over one padded batch: its :class:`Capture` and greedy tokens, left on the device."""
    longest = max(r.num_tokens for r in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, : r.num_tokens] = torch.from_numpy(r.input_ids.astype("int64"))
        mask[i, : r.num_tokens] = 1
    cap = target.capture(ids.to(target.device), attention_mask=mask.to(target.device))
    return cap, target.argmax(cap.last_hidden)


def stage_batch(stager: HostStager, target: Any, batch: list[Row]) -> HostBatch:
    """Capture one batch and start its rows' copy to the host (asynchronous on CUDA)."""
    cap, am = capture_batch(target, batch)
    return stager.stage(
        cap.aux,
        cap.last_hidden,
        am,
        [r.num_tokens for r in batch],
        np.concatenate([r.input_ids for r in batch]),
        np.concatenate([r.loss_mask for r in batch]),
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.stages.extract", description=__doc__.splitlines()[0]
    )
    add_common_args(ap)
    ap.add_argument(
        "--input", action="append", default=[], help="an upstream out dir (default: the stage's inputs)"
    )
    args = ap.parse_args(argv)
    ctx = StageContext.from_cli(args)
    if ctx.plan.target.engine == "sglang":  # in seconds, before a target of hundreds of GB loads
        refusal = tested_versions.stage_refusal(ctx.plan, "capture")
        if refusal:
            fail(ctx, f'{ctx.plan.path}: target.engine = "sglang": {refusal}', 2)
    dist = Dist()
    finished = False
    try:
        tp = tensor_parallel_rank(ctx, "extract", "pipeline.stages.extract", argv)
        rc = run(ctx, collect_inputs(args, ctx), dist if tp else None)
        finished = rc == 0
        return rc
    except ShardWriteError as exc:
        if nospace.is_nospace(exc):
            raise  # the stage's full-disk hook names the device (and the message names the shard)
        fail(ctx, str(exc))
    except (ShardError, hs.StoreError, ValueError) as exc:
        fail(ctx, str(exc))
    finally:
        dist.close(finished)
    return 1


def run(ctx: StageContext, inputs: list[Path], dist: Dist | None = None) -> int:
    """Extract; with ``dist`` (tensor-parallel ranks) every rank runs it and rank 0 writes."""
    ex = plan_extraction(ctx, inputs)
    writer = dist is None or dist.main  # tensor-parallel: rank 0 alone writes
    if ctx.plan.settings.storage_mode == "online":
        if writer:
            write_online(ctx, ex)
        return 0
    shard_tokens = ctx.plan.settings.extract.shard_tokens
    jobs = [(hs.shard_name(i), sh) for i, sh in enumerate(plan_shards(ex.rows, shard_tokens))]
    jobs += [(hs.eval_shard_name(i), sh) for i, sh in enumerate(plan_shards(ex.eval_rows, shard_tokens))]
    rec = ShardRecord.resume(ctx, fingerprint(ex.rows + ex.eval_rows, ex.aux, ex.model_id))
    projected = ex.total_tokens * ex.per_token
    ctx.metric("projected_bytes", projected, tokens=ex.total_tokens, bytes_per_token=ex.per_token)
    if len(rec.done) == len(jobs) and (ctx.out / "manifest.json").is_file():
        ctx.metric("actual_bytes", sum(v["bytes"] for v in rec.done.values()))
        ctx.progress(ex.total_tokens, ex.total_tokens, unit="tokens", force=True)
        ctx.message(f"already extracted: {len(jobs)} shards, {ex.total_tokens:,} tokens")
        return 0
    ctx.message(
        f"extracting {len(ex.rows):,} rows (+ {len(ex.eval_rows)} held out, for acceptance while training) / "
        f"{ex.total_tokens:,} tokens into {len(jobs)} shards; "
        f"aux layers {ex.aux}; projected {projected / 1e9:.3f} GB"
        + (f"; resuming with {len(rec.done)} shards done" if rec.done else "")
    )
    target = load_extract_target(ctx, ex, dist)
    tokens_done = sum(v["tokens"] for v in rec.done.values())
    ctx.progress(tokens_done, ex.total_tokens, unit="tokens", force=True)
    t_start, tok_start = time.monotonic(), tokens_done
    tokens_done = extract_shards(ctx, ex, jobs, target, rec, tokens_done, dist)
    if not writer:
        return 0
    done = {name: rec.done[name] for name, _ in jobs}
    stored = [
        (name, StoredShard(file=name, rows=d.get("rows"), tokens=d.get("tokens"), bytes=d.get("bytes")))
        for name, d in done.items()
    ]
    manifest = dataclasses.replace(
        ex.base_manifest,
        bytes=rec.actual,
        shards=tuple(sh for name, sh in stored if not hs.is_eval_shard(name)),
        eval_shards=tuple(sh for name, sh in stored if hs.is_eval_shard(name)),
    )
    hs_manifest.write(ctx.out / "manifest.json", manifest)
    elapsed = time.monotonic() - t_start
    if tokens_done > tok_start:
        ctx.metric("tokens_per_s", (tokens_done - tok_start) / max(elapsed, 1e-9), overall=True)
    ctx.progress(ex.total_tokens, ex.total_tokens, unit="tokens", force=True)
    ctx.message(
        f"extracted {ex.total_tokens:,} tokens: {rec.actual / 1e6:.1f} MB actual vs {projected / 1e6:.1f} MB projected"
    )
    return 0


@dataclass
class Extraction:
    """What the plan asks to extract: the target, its aux layers, the rows (training and held out), and the
    manifest keys every outcome writes."""

    model_id: str
    aux: list[int]
    arch: Any
    vocab_size: int
    hidden: int
    rows: list[Row]
    eval_rows: list[Row]
    base_manifest: HiddenStatesManifest  # no shards yet

    @property
    def total_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows) + sum(r.num_tokens for r in self.eval_rows)

    @property
    def per_token(self) -> int:
        return hs.bytes_per_token(self.hidden, len(self.aux))


def plan_extraction(ctx: StageContext, inputs: list[Path]) -> Extraction:
    """The target's layers and the rows to extract, checked (a failure names the plan key or the inputs)."""
    from pipeline.eagle3.target_capture import target_architecture, target_config

    plan, sec = ctx.plan, ctx.plan.settings.extract
    model_id = str(plan.target.model or "")
    if not model_id:
        fail(ctx, f"{plan.path}: target.model is not set")
    if not inputs:
        fail(
            ctx,
            "no inputs: extraction needs the out dirs of the prep/regen stages (after = [...] in the plan)",
        )
    trc = plan.target.trust_remote_code
    tcfg = target_config(model_id, trust_remote_code=trc)
    num_layers, hidden = int(tcfg.num_hidden_layers), int(tcfg.hidden_size)
    aux = aux_layers_from(sec, num_layers, str(plan.path))
    arch = target_architecture(model_id, trust_remote_code=trc)
    try:
        capture = sglang_capture_ids(aux, arch)
    except DraftModelError as exc:
        fail(ctx, f"{plan.path}: extract.aux_layers: {exc}")
    holdout = holdout_fraction(plan)
    max_length = sec.max_length or plan.target.max_length
    rows, eval_rows = select_rows(inputs, sec, holdout, int(tcfg.vocab_size), max_length)
    if not rows:
        fail(
            ctx,
            f"no training rows in the inputs ({', '.join(map(str, inputs))}): every row is held out, empty or "
            "has no assistant tokens",
        )
    eval_tokens = sum(r.num_tokens for r in eval_rows)
    base_manifest = HiddenStatesManifest(
        kind=hs.KIND,
        format=hs.FORMAT,
        mode=plan.settings.storage_mode,
        target=model_id,
        hidden_size=hidden,
        num_layers=num_layers,
        aux_layer_ids=tuple(aux),
        sglang_layers_to_capture=tuple(capture),
        target_architecture=arch,
        dtype="bfloat16",
        sources=tuple(str(Path(p).absolute()) for p in inputs),
        holdout=holdout,
        max_length=max_length,
        rows=len(rows),
        tokens=sum(r.num_tokens for r in rows),
        eval_rows=len(eval_rows),
        eval_tokens=eval_tokens,
        shards=(),
    )
    if sec.aux_layers is not None and list(sec.aux_layers) != aux:
        ctx.message(
            f"extract.aux_layers {list(sec.aux_layers)} used as {aux}: SGLang captures layers in ascending "
            "order, each once",
            level="warning",
        )
    return Extraction(model_id, aux, arch, int(tcfg.vocab_size), hidden, rows, eval_rows, base_manifest)


def select_rows(
    inputs: list[Path], sec: ExtractSection, holdout: float, vocab_size: int, max_length: Any
) -> tuple[list[Row], list[Row]]:
    """(the training rows with assistant tokens, cut to ``max_rows`` and ``max_tokens``; the held-out rows)."""
    rows = list(iter_rows(inputs, holdout, "train", vocab_size, max_length))
    rows = [r for r in rows if r.num_tokens >= 2 and r.loss_mask.any()]
    eval_rows = eval_split(inputs, holdout, vocab_size, max_length, sec.eval_rows)
    if sec.max_rows:
        rows = rows[: sec.max_rows]
    if sec.max_tokens:
        kept, n = [], 0
        for r in rows:
            if n + r.num_tokens > sec.max_tokens:
                break
            kept.append(r)
            n += r.num_tokens
        rows = kept
    return rows, eval_rows


def write_online(ctx: StageContext, ex: Extraction) -> None:
    """Online mode: nothing stored; the manifest lists the rows training runs the target over."""
    ctx.metric("projected_bytes", 0)
    hs_manifest.write(
        ctx.out / "manifest.json",
        dataclasses.replace(
            ex.base_manifest, bytes=0, shards=(), row_ids=tuple(r.id for r in training_order(ex.rows))
        ),
    )
    ctx.metric("actual_bytes", 0)
    ctx.message(
        f"online mode: nothing stored; training runs the target over {ex.total_tokens:,} tokens "
        f"(offline would store {ex.total_tokens * ex.per_token / 1e9:.2f} GB)"
    )
    ctx.progress(ex.total_tokens, ex.total_tokens, unit="tokens", force=True)


def load_extract_target(ctx: StageContext, ex: Extraction, dist: Dist | None) -> Any:
    """The target (``target_capture.Target``, or the SGLang runner answering the same calls): SGLang's model
    runner, transformers tensor-parallel over the ranks, or transformers on ``[extract] device``."""
    from pipeline.eagle3.target_capture import load_target

    plan, sec = ctx.plan, ctx.plan.settings.extract
    trc = plan.target.trust_remote_code
    device, dtype = pick_device(sec)
    if plan.target.engine == "sglang":
        from pipeline.eagle3.sglang_target import load_for_plan

        runner = load_for_plan(
            plan, ex.aux, ex.arch, ex.vocab_size, max(r.num_tokens for r in ex.rows + ex.eval_rows), dist
        )
        ctx.message(
            f"target loaded by SGLang's model runner (TP {dist.world if dist else 1}), capturing layers {ex.aux}"
        )
        return runner
    if dist is not None:
        dev = tp_device(dist, sec.device)
        if dev.type == "cpu":
            dist.init(dev)  # gloo: transformers would pick the accelerator's backend where there is one
        if sec.dtype is None:
            dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        target = load_target(
            ex.model_id, ex.aux, dtype=dtype, device=dev, parallel="tp", trust_remote_code=trc
        )
        dist.init(dev)  # a no-op: transformers started the group (NCCL, bound to this rank's GPU)
        ctx.message(f"target loaded tensor-parallel over {dist.world} ranks ({dev.type})")
        return target
    return load_target(ex.model_id, ex.aux, dtype=dtype, device=device, trust_remote_code=trc)


@dataclass
class ShardRecord:
    """The shards done (``extract-state.json``: what a retry skips) and the bytes written so far."""

    ctx: StageContext
    state_path: Path
    fingerprint: str
    done: dict[str, dict]
    actual: int = 0

    @classmethod
    def resume(cls, ctx: StageContext, fp: str) -> ShardRecord:
        """The state a partial extraction left, refused where its inputs or settings changed."""
        state_path = ctx.out / STATE_FILE
        state = read_json(state_path) or {}
        if state.get("fingerprint") not in (None, fp):
            fail(
                ctx,
                f"{state_path}: the inputs or settings changed since the partial extraction; retry with --fresh",
            )
        done: dict[str, dict] = state.get("done", {})
        # A shard is done only if recorded *and* present (a stray file without a record is redone).
        done = {k: v for k, v in done.items() if (ctx.out / k).is_file()}
        return cls(ctx, state_path, fp, done, sum(v["bytes"] for v in done.values()))

    def record(self, written: list[WrittenShard]) -> None:
        """Shards the sink made whole: into the state file (what a retry skips), then the metric."""
        for w in written:
            self.done[w.name] = {"rows": w.rows, "tokens": w.tokens, "bytes": w.bytes}
            self.actual += w.bytes
            write_json(self.state_path, {"fingerprint": self.fingerprint, "done": self.done})
            self.ctx.metric("actual_bytes", self.actual, shard=w.index)


def extract_shards(
    ctx: StageContext,
    ex: Extraction,
    jobs: list[tuple[str, list[Row]]],
    target: Any,
    rec: ShardRecord,
    tokens_done: int,
    dist: Dist | None,
) -> int:
    """Capture every shard not done yet, batch by batch (rank 0 writes through the sink; the other
    tensor-parallel ranks only capture); returns the tokens done."""
    sec = ctx.plan.settings.extract
    sink = stager = None
    if dist is None or dist.main:
        stager = HostStager(target.device, slots=sec.write_queue + 2)
        sink = ShardSink(
            ctx.out,
            len(ex.aux) * ex.hidden,
            ex.hidden,
            queue_batches=sec.write_queue,
            io_threads=sec.io_threads,
        )
    try:
        for si, (name, shard_rows) in enumerate(jobs):
            if name in rec.done:
                continue
            if sink is not None:
                sink.begin(si, name, [r.id for r in shard_rows], [r.num_tokens for r in shard_rows])
            for batch in length_batches(shard_rows, sec.batch_tokens):
                if dist is not None:
                    dist.safe_point(ctx, target.device)
                else:
                    ctx.safe_point()
                t0 = time.monotonic()
                if sink is not None and stager is not None:
                    sink.put(stage_batch(stager, target, batch))
                else:
                    capture_batch(target, batch)  # a tensor-parallel rank that does not write
                n = sum(r.num_tokens for r in batch)
                tokens_done += n
                ctx.metric("tokens_per_s", n / max(time.monotonic() - t0, 1e-9))
                ctx.progress(tokens_done, ex.total_tokens, unit="tokens")
                if sink is not None:
                    rec.record(sink.completed())
            if sink is not None:
                sink.end()
                rec.record(sink.completed())
            else:
                rec.done[name] = {}
        if sink is not None:
            rec.record(sink.close())
    except BaseException:
        if sink is not None:
            sink.abort()  # shards already whole stay, and are recorded; the open one is removed
            with contextlib.suppress(OSError):  # (the disk may be full: the first error is the one to tell)
                rec.record(sink.drain())
        raise
    return tokens_done


if __name__ == "__main__":
    sys.exit(main())
