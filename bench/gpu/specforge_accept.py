"""SpecForge's EAGLE-3 draft side by side with Aerie's on acceptance: one GPU call, on what ``bench/gpu/quality.py`` left.

``python -m bench.gpu.specforge_accept [--work /tmp/gpu_quality] [--seed 0] [--sides specforge|aerie|aerie,specforge]``

Run after ``bench/gpu/quality.py`` on the same warm machine: its work dir holds the plan, the hidden-state store
(``ext/``) and the draft vocabulary (``voc/``) made from the real SmolLM2-135M target, and Aerie's draft
(``train/``) benched by the bench stage (``bench/``). Side ``specforge`` trains SpecForge 0.2.0's draft with its
own trainer on that store (``bench/gpu/specforge_train.py``: the same steps, batch, learning rate, TTT and seed as
the plan's ``[train]``, Aerie's data order and draft init) and benches it with the same bench stage and plan
(same held-out prompts, 3/1/4). Side ``aerie`` trains and benches Aerie's draft again with ``[train] seed``
set to ``--seed`` (seed 0 is gpu_quality's own run). Each side is about 130-250 s on an H200, so a second
seed is two more calls; a call cut after SpecForge's training only benches when repeated. Every result is kept in ``WORK/side_by_side.json`` (calls add to it) and written to
``$OUT/gpu_specforge.json`` as it comes; the table of every side and seed so far is printed at the end.

SpecForge is not installed on the device: ``python -m bench.gpu.specforge_accept --stage`` (here) copies the
installed pure-Python package (``pip install --no-deps -r .ci/specforge-requirements.txt``) into
``.gpu-stage/sf`` (~2 MB), which the call carries and this script puts on the path.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu.quality import log, stage
from bench.gpu.results import stage_metrics, write_out
from bench.gpu.runner import ROOT

SF_SITE = ROOT / ".gpu-stage" / "sf"


def stage_specforge() -> int:
    """Copy the installed specforge package and its dist-info into ``.gpu-stage/sf`` (no caches)."""
    from importlib.metadata import distribution

    dist = distribution("specforge")
    site = Path(str(dist.locate_file("")))
    shutil.rmtree(SF_SITE, ignore_errors=True)
    SF_SITE.mkdir(parents=True)
    info = next(site.glob(f"specforge-{dist.version}.dist-info"))
    for src in (site / "specforge", info):
        shutil.copytree(src, SF_SITE / src.name, ignore=shutil.ignore_patterns("__pycache__"))
    size = sum(p.stat().st_size for p in SF_SITE.rglob("*") if p.is_file())
    print(f"specforge {dist.version} staged in {SF_SITE} ({size / 2**20:.1f} MiB): carry .gpu-stage/sf")
    return 0


def seeded_plan(plan: Path, seed: int) -> Path:
    """A copy of ``plan`` with ``[train] seed = seed`` (set, or added under the table's header)."""
    text = plan.read_text()
    head = re.search(r"^\[train\]\s*$", text, re.M)
    if head is None:
        raise SystemExit(f"{plan}: no [train] table")
    nxt = re.search(r"^\[", text[head.end() :], re.M)
    end = head.end() + (nxt.start() if nxt else len(text[head.end() :]))
    table = text[head.end() : end]
    table = (
        re.sub(r"^seed\s*=.*$", f"seed = {seed}", table, flags=re.M)
        if re.search(r"^seed\s*=", table, re.M)
        else f"\nseed = {seed}" + table
    )
    out = plan.with_name(f"plan_seed{seed}.toml")
    out.write_text(text[: head.end()] + table + text[end:])
    return out


def bench_result(d: Path) -> dict[str, Any]:
    r = json.loads((d / "results.json").read_text())
    return {"accept_len": r["accept_len"], "verify_steps": r["verify_steps"], "bench_dir": str(d)}


def aerie_side(work: Path, seed: int) -> dict[str, Any]:
    if seed == 0 and (work / "bench" / "results.json").is_file():
        train, bench = work / "train", work / "bench"  # gpu_quality's own run ([train] seed defaults to 0)
        res: dict[str, Any] = {"source": "bench/gpu/quality.py's run"}
    else:
        plan = seeded_plan(work / "plan.toml", seed)
        train, bench = work / f"train_seed{seed}", work / f"bench_seed{seed}"
        res = {"train_s": stage("pipeline.stages.train", plan, train, [work / "ext", work / "voc"])}
        res["bench_s"] = stage("pipeline.stages.bench", plan, bench, [train])
    tps = sorted(e.value for e in stage_metrics(train, "tokens_per_s"))
    man = json.loads((train / "manifest.json").read_text())
    res.update(
        bench_result(bench), kept_step=man["step"], train_tok_s_median=statistics.median(tps) if tps else None
    )
    return res


def specforge_side(work: Path, seed: int, s: Any) -> dict[str, Any]:
    out = work / f"specforge_seed{seed}"
    argv = [sys.executable, "-m", "bench.gpu.specforge_train", "--run", str(work), "--out", str(out)]
    argv += ["--steps", str(s.steps), "--batch", str(s.batch_size), "--lr", str(s.lr), "--seed", str(seed)]
    argv += [
        "--ttt",
        str(s.ttt_steps),
        "--micro-batch",
        str(s.micro_batch),
        "--device",
        "cuda" if cuda() else "cpu",
    ]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(SF_SITE), str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    t = time.monotonic()
    done = out / "specforge_train.json"
    if done.is_file() and "draft" in json.loads(done.read_text()):  # trained by a call that was cut later
        log(f"SpecForge seed {seed}: trained already ({out}); benching it")
    else:
        p = subprocess.run(argv, cwd=ROOT, env=env)  # its progress lines go straight to this call's output
        if p.returncode != 0:
            raise SystemExit(f"bench/gpu/specforge_train.py failed ({p.returncode})")
    call_s = time.monotonic() - t  # with the process start, the target's and SpecForge's loading
    tr = json.loads(done.read_text())
    res: dict[str, Any] = {"train_s": tr["train_s"], "train_call_s": call_s, "train_tok_s": tr["train_tok_s"]}
    res["eager"] = tr["eager"]
    res.update({k: tr[k] for k in ("first_loss", "last_loss", "peak_gib", "eager_fallback") if k in tr})
    res["bench_s"] = stage("pipeline.stages.bench", work / "plan.toml", work / f"sfbench_seed{seed}", [out])
    res.update(bench_result(work / f"sfbench_seed{seed}"))
    return res


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def table(doc: dict[str, Any]) -> str:
    lines = ["side       seed  accept length (3/1/4)  verify steps  train tok/s"]
    for key, r in sorted(doc["runs"].items()):
        side, seed = key.split(":")
        tps = r.get("train_tok_s") or r.get("train_tok_s_median") or 0
        lines.append(
            f"{side:<10} {seed:>4}  {r['accept_len']:>21.3f}  {r['verify_steps']:>12}  {tps:>11,.0f}"
        )
    for side in ("aerie", "specforge"):
        vals = [r["accept_len"] for k, r in doc["runs"].items() if k.startswith(side + ":")]
        if vals:
            lines.append(
                f"{side}: mean {statistics.mean(vals):.3f}, spread {max(vals) - min(vals):.3f} over {len(vals)} seed(s)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--work", default="/tmp/gpu_quality", help="bench/gpu/quality.py's work dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sides", default="specforge", help="comma-separated: specforge, aerie")
    ap.add_argument(
        "--stage", action="store_true", help="here: copy the installed SpecForge into .gpu-stage/sf"
    )
    args = ap.parse_args(argv)
    if args.stage:
        return stage_specforge()
    work = Path(args.work)
    for need in ("plan.toml", "ext/manifest.json", "voc/manifest.json"):
        if not (work / need).is_file():
            raise SystemExit(
                f"{work / need}: missing: run bench/gpu/quality.py --work {work} first (same machine)"
            )
    if SF_SITE.is_dir():
        sys.path.insert(0, str(SF_SITE))
    from bench.gpu.specforge_peer import specforge_available
    from pipeline.run.plan import dag as plan_mod

    why = specforge_available()
    if why:
        raise SystemExit(
            f"{why}; stage it here with python -m bench.gpu.specforge_accept --stage and carry .gpu-stage/sf"
        )
    s = plan_mod.load(work / "plan.toml").settings.train
    path = work / "side_by_side.json"
    doc: dict[str, Any] = (
        json.loads(path.read_text()) if path.is_file() else {"bench": "gpu_specforge", "runs": {}}
    )
    doc["plan_train"] = {"steps": s.steps, "batch": s.batch_size, "lr": s.lr, "ttt": s.ttt_steps}
    log(
        f"side by side on {work}: {s.steps} steps x {s.batch_size}, lr {s.lr}, TTT {s.ttt_steps}, seed {args.seed}"
    )
    for side in args.sides.split(","):
        doc["runs"][f"{side}:{args.seed}"] = {"status": "running"}
        write_out("gpu_specforge.json", doc)
        if side == "aerie":
            r = aerie_side(work, args.seed)
        elif side == "specforge":
            r = specforge_side(work, args.seed, s)
        else:
            raise SystemExit(f"--sides: unknown side {side!r} (specforge, aerie)")
        doc["runs"][f"{side}:{args.seed}"] = r
        path.write_text(json.dumps(doc, indent=1) + "\n")
        write_out("gpu_specforge.json", doc)
        log(
            f"{side} seed {args.seed}: accept length {r['accept_len']:.3f} over {r['verify_steps']} verify steps"
        )
    done = {k: v for k, v in doc["runs"].items() if "accept_len" in v}
    print(table({"runs": done}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
