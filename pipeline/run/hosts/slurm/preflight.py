"""``aerie preflight`` for a Slurm plan: ``python -m pipeline.run.hosts.slurm.preflight PLAN``, on the login node.

Before any job is submitted it checks, and says in one line each, what would make the run fail later:

* the Slurm commands answer (``sinfo``);
* every partition the stages use exists and is up, with enough nodes for the largest stage, enough CPUs
  per node and enough GPUs per node (its ``gpu`` GRES) for every stage;
* a tiny probe job on a compute node (``srun``) sees the run directory (it reads a file written here and
  writes one back: the shared filesystem works both ways), and runs the supervisor's Python with the
  ``pipeline`` package and the stages' imports (torch, transformers) — the same interpreter the stages'
  batch scripts use — and, for a plan that serves or captures through SGLang, that interpreter's SGLang against
  the tested-versions table (absent or refused: FAIL, as the local and SSH preflights say).

Exit 0 when every check passed, 2 otherwise (as ``aerie preflight`` for ssh plans). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.run.hosts.checks import CheckReport
from pipeline.run.hosts.procs import env_with_pipeline
from pipeline.run.hosts.slurm import commands as slurm
from pipeline.run.plan import dag as plan_mod
from pipeline.run.plan.dag import Plan, StageSpec

PROBE_TIMEOUT_S = 300.0
# What a compute node must import for the built-in stages the plan runs (operator commands need none).
STAGE_IMPORTS = {
    "prep": ["datasets"],
    "regen": ["aiohttp"],
    "extract": ["torch", "transformers"],
    "vocab": ["torch"],
    "train": ["torch", "transformers"],
    "bench": ["torch", "transformers"],
    "serve": [],
    "telemetry": [],
}

PROBE = r"""
import importlib, json, os, platform, socket, sys
token, reply, mods = sys.argv[1], sys.argv[2], sys.argv[3].split(",") if sys.argv[3] else []
out = {"host": socket.gethostname(), "python": sys.executable, "version": platform.python_version(),
       "node": os.environ.get("SLURMD_NODENAME", "")}
try:
    out["token"] = open(token).read().strip()
except OSError as exc:
    out["token_error"] = str(exc)
for m in ["pipeline.run.stage_side.launcher", *mods]:
    try:
        mod = importlib.import_module(m)
        out.setdefault("imports", {})[m] = getattr(mod, "__version__", "ok")
    except Exception as exc:
        out.setdefault("import_errors", {})[m] = f"{type(exc).__name__}: {exc}"
sg = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
if sg.get("uses"):
    try:
        from pipeline import tested_versions as tv
        v = tv.classify_sglang(sg["uses"], None, bool(sg.get("allow")))
        out["sglang"] = {"level": v.level, "detail": v.detail}
    except Exception as exc:
        out["sglang"] = {"level": "warn", "detail": "cannot classify SGLang here: %s: %s" % (type(exc).__name__, exc)}
with open(reply, "w") as fh:
    json.dump(out, fh)
print(json.dumps(out))
"""


@dataclass
class Partition:
    name: str
    up: bool
    nodes: int
    cpus: int
    gpus: int
    default: bool = False


def gres_gpus(gres: str) -> int:
    """GPUs per node from a GRES string (``gpu:8``, ``gpu:h100:4(S:0-1)``, ``gpu:a100:2,shard:4``)."""
    total = 0
    for item in gres.split(","):
        m = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
        if m:
            total = max(total, int(m.group(1)))
    return total


def partitions() -> dict[str, Partition]:
    """Partitions as ``sinfo`` sees them (one row per partition and node configuration)."""
    p = subprocess.run(
        ["sinfo", "--noheader", "--format=%P|%a|%D|%c|%G"],
        capture_output=True,
        text=True,
        timeout=slurm.TIMEOUT_S,
    )
    if p.returncode != 0:
        raise slurm.SlurmError(p.stderr.strip() or f"sinfo exited {p.returncode}")
    out: dict[str, Partition] = {}
    for line in p.stdout.splitlines():
        cols = line.strip().split("|")
        if len(cols) != 5:
            continue
        name, avail, nodes, cpus, gres = cols
        default = name.endswith("*")
        name = name.rstrip("*")
        part = out.setdefault(name, Partition(name, avail == "up", 0, 0, 0, default))
        part.nodes += int(nodes) if nodes.isdigit() else 0
        part.cpus = max(part.cpus, int(re.sub(r"\D.*", "", cpus) or 0))
        part.gpus = max(part.gpus, gres_gpus(gres))
    return out


def stage_partition(plan: Plan, spec: StageSpec, parts: dict[str, Partition]) -> str | None:
    name = spec.slurm.get("partition", plan.settings.slurm.partition)
    if name is None:
        return next((p.name for p in parts.values() if p.default), None)
    return str(name)


def check_partitions(plan: Plan, report: CheckReport) -> None:
    try:
        parts = partitions()
    except slurm.SlurmError as exc:
        report.add("", False, f"sinfo: {exc}")
        return
    report.add("", True, f"sinfo answers: partitions {', '.join(parts) or '(none)'}")
    by_part: dict[str | None, list[StageSpec]] = {}
    for spec in plan.stages:
        if not spec.skip:
            by_part.setdefault(stage_partition(plan, spec, parts), []).append(spec)
    for name, specs in by_part.items():
        if name is None:
            report.add(
                "",
                False,
                f"stages {', '.join(s.id for s in specs)} name no partition and Slurm has no default one",
            )
            continue
        part = parts.get(name)
        if part is None:
            report.add(
                "",
                False,
                f"partition {name!r} does not exist (sinfo lists {', '.join(parts) or 'none'}); "
                f"used by {', '.join(s.id for s in specs)}",
            )
            continue
        if not part.up:
            report.add("", False, f"partition {name!r} is not up")
        big = max(specs, key=lambda s: s.nodes)
        report.add(
            "",
            big.nodes <= part.nodes,
            f"partition {name!r}: {part.nodes} node(s); the largest stage ({big.id}) needs {big.nodes}",
        )
        cpu = max(specs, key=lambda s: s.cpu)
        report.add(
            "",
            cpu.cpu <= part.cpus,
            f"partition {name!r}: {part.cpus} CPUs per node; {cpu.id} asks {cpu.cpu} per node",
        )
        gpu = max(specs, key=lambda s: len(s.gpus))
        if gpu.gpus:
            report.add(
                "",
                len(gpu.gpus) <= part.gpus,
                f"partition {name!r}: {part.gpus} GPU(s) per node; {gpu.id} asks {len(gpu.gpus)} per node",
            )


def write_probe_token(root: Path) -> tuple[Path, Path, str]:
    """A fresh token file in the run dir, for the probe job to read: its path, the reply's path, its word."""
    root.mkdir(parents=True, exist_ok=True)
    token = root / f".aerie-preflight-{secrets.token_hex(4)}"
    reply = token.with_suffix(".reply")
    word = secrets.token_hex(8)
    token.write_text(word)
    return token, reply, word


def probe_argv(plan: Plan, python: str, token: Path, reply: Path) -> list[str]:
    """The ``srun`` command line of the probe job: one task on one node, in the plan's partition, account and
    QoS, checking the imports of the built-in stages the plan runs."""
    mods = sorted({m for s in plan.stages if s.run for m in STAGE_IMPORTS.get(s.run, [])})
    sect = plan.settings.slurm.given()
    return [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        "--job-name=aerie-preflight",
        "--time=5",
        *([f"--partition={sect['partition']}"] if sect.get("partition") else []),
        *([f"--account={sect['account']}"] if sect.get("account") else []),
        *([f"--qos={sect['qos']}"] if sect.get("qos") else []),
        python,
        "-c",
        PROBE,
        str(token),
        str(reply),
        ",".join(mods),
        json.dumps(sglang_ask(plan)),
    ]


def sglang_ask(plan: Plan) -> dict[str, Any]:
    """What the plan runs through SGLang (``pipeline.tested_versions.sglang_uses``' rule, which this standard-library
    module does not import) and whether it allows an untested release: the probe classifies the node's SGLang."""
    s = plan.settings
    uses = ["capture"] if s.target.engine == "sglang" else []
    if s.serve.backend == "sglang" and any(st.run == "serve" for st in plan.stages):
        uses.append("serve")
    return {"uses": uses, "allow": bool(getattr(s.target, "allow_untested_sglang", False))}


def run_probe(
    argv: list[str], report: CheckReport, timeout_s: float
) -> subprocess.CompletedProcess[str] | None:
    """The probe job run to its end; None (and a FAIL line) when no node ran it in time or srun is missing."""
    try:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env_with_pipeline(),
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        report.add(
            "",
            False,
            f"probe job: no compute node ran it within {timeout_s:g}s (queue busy?); "
            "the run dir and imports were not checked on a node",
        )
    except FileNotFoundError:
        report.add("", False, "probe job: srun not found")
    return None


def report_probe_reply(got: dict[str, Any], report: CheckReport, root: Path, token: Path, word: str) -> None:
    """What the compute node's reply says: the run dir shared, its Python, and each import that worked or not."""
    where = got.get("node") or got.get("host")
    report.add(
        "",
        got.get("token") == word,
        f"run directory {root} is shared with compute node {where}"
        if got.get("token") == word
        else f"compute node {where} cannot read {token.name} in {root}: {got.get('token_error', 'other content')}",
    )
    report.add("", True, f"compute node {where}: Python {got.get('version')} at {got.get('python')}")
    for m, why in (got.get("import_errors") or {}).items():
        report.add("", False, f"compute node {where}: import {m} failed: {why}")
    ok = [
        f"{m} {v}" for m, v in (got.get("imports") or {}).items() if m != "pipeline.run.stage_side.launcher"
    ]
    if "pipeline.run.stage_side.launcher" in (got.get("imports") or {}):
        report.add("", True, f"compute node {where}: pipeline imports" + (f"; {', '.join(ok)}" if ok else ""))
    sg = got.get("sglang")
    if isinstance(
        sg, dict
    ):  # the engine the stages will run, on the node they run on (tested-versions table)
        level = sg.get("level")
        report.add(
            "sglang",
            level in ("ok", "warn"),
            f"compute node {where}: {sg.get('detail')}",
            warning=level == "warn",
        )


def check_compute_node(plan: Plan, report: CheckReport, python: str, timeout_s: float) -> None:
    """A tiny job: the shared run dir both ways, and the stages' Python and imports on a compute node."""
    root = plan.run_dir
    try:
        token, reply, word = write_probe_token(root)
    except OSError as exc:
        report.add("", False, f"run directory {root}: cannot write it here: {exc}")
        return
    argv = probe_argv(plan, python, token, reply)
    try:
        p = run_probe(argv, report, timeout_s)
    finally:
        token.unlink(missing_ok=True)
    if p is None:
        return
    try:
        got = json.loads(reply.read_text())
    except (OSError, ValueError):
        why = (p.stderr or p.stdout).strip().splitlines()
        report.add(
            "",
            False,
            f"probe job: no reply in {root} from the compute node "
            f"({why[-1] if why else f'srun exited {p.returncode}'}): is the run dir on a shared "
            "filesystem the nodes mount at the same path?",
        )
        return
    finally:
        reply.unlink(missing_ok=True)
    report_probe_reply(got, report, root, token, word)


def preflight(plan: Plan, python: str = sys.executable, timeout_s: float = PROBE_TIMEOUT_S) -> CheckReport:
    report = CheckReport(f"preflight {plan.path} (Slurm, run dir {plan.run_dir})")
    missing = slurm.available()
    if missing:
        report.add("", False, missing)
        return report
    check_partitions(plan, report)
    check_compute_node(plan, report, python, timeout_s)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.run.hosts.slurm.preflight", description=__doc__.split("\n")[0]
    )
    ap.add_argument("plan", type=Path)
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=PROBE_TIMEOUT_S, help="how long the probe job may wait")
    args = ap.parse_args(argv)
    try:
        plan = plan_mod.load(args.plan, run_dir=args.run_dir)
    except plan_mod.PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if plan.executor.kind != "slurm":
        print(f'error: {plan.path}: executor.kind is {plan.executor.kind!r}, not "slurm"', file=sys.stderr)
        return 2
    report = preflight(plan, timeout_s=args.timeout)
    print("\n".join(report.lines()))
    print("ready: the run can start" if report.ok else "not ready: fix the FAIL lines above")
    return 0 if report.ok else 2


if __name__ == "__main__":
    raise SystemExit(main())
