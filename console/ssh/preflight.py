"""Bootstrap + preflight of an ssh plan, before its first stage: ``aerie preflight PLAN``.

Over 450 lines because the checks run in order over one connection, each feeding the next (the run dir
the upload, the uploaded pipeline the plan check): one sequence read top to bottom.

Over the one connection, in order, each step a named check in the report:

1. **connection** — host key checked against known_hosts, credentials accepted;
2. **python** — the plan's ``[executor] python`` runs on the host and is 3.11 or newer;
3. **run dir** — the remote run directory is created (makedirs, so copying into a missing
   directory cannot happen) and writable, and does not already hold a *different* plan;
4. **pipeline** — Aerie's ``pipeline`` package imports there; if the host lacks it (or has one
   speaking another agent protocol) this console's copy is uploaded by SFTP into
   ``RUN/.aerie/pkg-<hash>/`` (``[executor] options.pipeline = "upload"`` forces it,
   ``"installed"`` forbids it);
5. **plan** — the plan is uploaded (atomically) and validated *on the host*, with the host's
   ``pipeline``; every built-in stage module the plan uses must import there (a missing
   ``torch`` is reported now, not an hour into the run);
6. **sglang** — for a plan that runs SGLang (a serve stage, ``[target] engine = "sglang"``): the host's SGLang
   against the tested-versions table (:mod:`pipeline.tested_versions`): untested warns, known broken for what
   the plan uses or missing refuses;
7. **disk** — free space at the run directory, refused when below the plan's declared outputs.
8. **chain** — the EAGLE-3 chain against the host's copy of the target, when the plan trains;
9. **slurm** — for ``[executor] kind = "slurm"`` with a host (the login node): ``sinfo`` and a probe
   job on a compute node (``python -m pipeline.run.hosts.slurm.preflight`` on the login node).

Nothing is started when a check fails; :meth:`PreflightReport.render` lists every check with
what to do. On success the report carries the :class:`RemoteLayout` (also written to
``RUN/.aerie/layout.json`` for ``aerie attach``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import posixpath
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import asyncssh

import pipeline
from console.ssh.connection import HostConnection, SshError, SshTarget, remote_python
from console.ssh.transport import AGENT_PROTOCOL, LAYOUT_FILE, RemoteLayout
from pipeline.run.hosts.checks import CheckReport
from pipeline.run.plan.dag import Plan, stage_module

UPLOADED_PLAN = "plan.submitted.toml"
MIN_PYTHON = (3, 11)
PIPELINE_MODES = ("auto", "upload", "installed")

# Runs on the host with its own interpreter (any Python 3), reading one JSON argument. Only the
# standard library, and careful to report rather than crash: an old or broken host is the point.
PROBE = r"""
import hashlib, importlib, json, os, sys
a = json.loads(sys.argv[1])
r = {"python": "%d.%d.%d" % tuple(sys.version_info[:3]), "executable": sys.executable,
     "version_ok": tuple(sys.version_info[:2]) >= tuple(a["min_python"])}
root = os.path.abspath(os.path.expanduser(a["root"]))
r["root"] = root
p = root
while not os.path.isdir(p):
    p = os.path.dirname(p)
r["existing"] = p
r["root_exists"] = p == root
r["writable"] = os.access(p, os.W_OK | os.X_OK)
try:
    st = os.statvfs(p)
    r["free_bytes"] = st.f_bavail * st.f_frsize
except OSError as e:
    r["free_error"] = str(e)
plan = os.path.join(root, "plan.toml")
if os.path.isfile(plan):
    with open(plan, "rb") as fh:
        r["plan_sha256"] = hashlib.sha256(fh.read()).hexdigest()
try:
    import pipeline.run.hosts.remote_agent as ra
    r["pipeline_dir"] = os.path.dirname(os.path.dirname(os.path.abspath(ra.__file__)))
    r["protocol"] = getattr(ra, "PROTOCOL", None)
except Exception as e:
    r["pipeline_error"] = "%s: %s" % (type(e).__name__, e)
if a.get("verify"):
    try:
        import pipeline.run.supervise.ctl, pipeline.run.stage_side.launcher, pipeline.run.supervise.supervisor
        from pipeline.run.plan import dag as plan_mod
        loaded = plan_mod.load(a["plan"], run_dir=root)
    except Exception as e:
        r["plan_error"] = "%s: %s" % (type(e).__name__, e)
    else:
        try:
            from pipeline import tested_versions as tv
            uses = sorted(tv.sglang_uses(loaded))
            if uses:
                v = tv.classify_sglang(uses)
                r["sglang"] = {"level": v.level, "detail": v.detail, "uses": uses}
        except Exception as e:
            r["sglang"] = {"level": "warn", "detail": "the host's pipeline cannot classify its SGLang (%s: %s)"
                           % (type(e).__name__, e)}
    errs = {}
    for m in a.get("modules", []):
        try:
            importlib.import_module(m)
        except BaseException as e:
            errs[m] = "%s: %s" % (type(e).__name__, e)
    r["module_errors"] = errs
print(json.dumps(r))
"""


EAGLE3_STAGES = ("extract", "train", "bench")


async def _chain(
    rep: PreflightReport, conn: HostConnection, python: str, pythonpath: str | None, remote_plan: str
) -> None:
    """``python -m pipeline.eagle3.chain_check`` on the host: each of its checks becomes a ``chain:`` line.

    A target not yet on the host (a plan whose first stages download it) is a warning, not a refusal.
    """
    cmd = remote_python(python, pythonpath, "-m", "pipeline.eagle3.chain_check", remote_plan, "--json")
    r = await conn.run(cmd, timeout_s=900.0)
    try:
        doc = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        rep.add(
            "chain",
            False,
            f"the deep check did not run on the host (exit {r.returncode}): "
            f"{(r.stderr or r.stdout).strip()[-400:]}",
        )
        return
    for c in doc.get("checks", []):
        if c["name"] == "sglang":
            continue  # the probe's sglang line said it already
        if c["name"] == "target" and not c["ok"]:
            rep.add(
                "chain", True, c["detail"] + " — the deep check is skipped until it is there", warning=True
            )
            return
        rep.add(f"chain: {c['name']}", bool(c["ok"]), c["detail"], warning=bool(c.get("warning")))


def _sglang(rep: PreflightReport, sg: dict) -> bool:
    """The probe's SGLang verdict as the ``sglang`` line: a known-broken release for what the plan uses, or
    none at all on the host that runs its SGLang stages, refuses; an untested one warns."""
    level, detail = str(sg.get("level")), str(sg.get("detail"))
    if level == "absent":
        return rep.add("sglang", False, f"{detail} — the plan runs SGLang ({', '.join(sg.get('uses', []))})")
    return rep.add("sglang", level != "refuse", detail, warning=level == "warn")


@dataclass
class PreflightReport(CheckReport):
    """The SSH preflight's report: the checks (:class:`pipeline.run.hosts.checks.CheckReport`), the host's layout
    once known, and how long the checks took."""

    host: str = ""
    remote_dir: str = ""
    layout: RemoteLayout | None = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.title = self.title or f"preflight {self.host}:{self.remote_dir}"

    def render(self) -> str:
        lines = self.lines()
        if self.failed:
            lines.append(
                f"REFUSED: {len(self.failed)} check(s) failed ({', '.join(self.failed)}); nothing was started."
            )
        else:
            lines.append(f"ready ({self.seconds:.1f}s): the run can start on {self.host}.")
        return "\n".join(lines)


def local_package() -> tuple[Path, list[Path], str]:
    """This console's ``pipeline`` package: its directory, its files, and a hash of their content."""
    root = Path(pipeline.__file__).resolve().parent
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
    )
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return root, files, h.hexdigest()


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


async def _probe(
    conn: HostConnection, python: str, pythonpath: str | None, args: dict
) -> tuple[dict | None, str]:
    args = {"min_python": list(MIN_PYTHON), **args}
    cmd = remote_python(python, pythonpath, "-", json.dumps(args))
    r = await conn.run(cmd, input=PROBE, timeout_s=300.0)
    if r.returncode == 127:
        return None, f"{python!r} was not found on the host (set [executor] python to the interpreter's path)"
    try:
        return json.loads(r.stdout.strip().splitlines()[-1]), ""
    except (ValueError, IndexError):
        return None, f"{python!r} failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-500:]}"


async def _write_atomic(sftp: asyncssh.SFTPClient, path: str, data: bytes) -> None:
    tmp = f"{path}.partial-{secrets.token_hex(4)}"
    async with sftp.open(tmp, "wb", attrs=asyncssh.SFTPAttrs(permissions=0o600)) as fh:
        await fh.write(data)
    try:
        await sftp.posix_rename(tmp, path)
    except asyncssh.SFTPOpUnsupported:
        if await sftp.exists(path):
            await sftp.remove(path)
        await sftp.rename(tmp, path)


async def _upload_package(sftp: asyncssh.SFTPClient, root: str) -> tuple[str, str]:
    """Upload this console's ``pipeline`` under ``root/.aerie/pkg-<hash>/``; returns (dir, what happened)."""
    src, files, digest = local_package()
    final = posixpath.join(root, ".aerie", f"pkg-{digest[:12]}")
    if await sftp.isdir(posixpath.join(final, "pipeline")):
        return final, f"this console's pipeline is already on the host ({final})"
    staging = f"{final}.partial-{secrets.token_hex(4)}"
    dirs = sorted({posixpath.join(staging, "pipeline", *p.relative_to(src).parent.parts) for p in files})
    for d in dirs:
        await sftp.makedirs(d, exist_ok=True)
    sem = asyncio.Semaphore(8)

    async def put(p: Path) -> None:
        async with sem:
            await sftp.put(str(p), posixpath.join(staging, "pipeline", *p.relative_to(src).parts))

    await asyncio.gather(*(put(p) for p in files))
    try:
        await sftp.rename(staging, final)
    except asyncssh.SFTPError:
        if not await sftp.isdir(final):  # not a concurrent bootstrap that won the race
            raise
        await sftp.rmtree(staging)
    return final, f"uploaded this console's pipeline ({len(files)} files) to {final}"


async def preflight(plan: Plan, conn: HostConnection | None = None) -> PreflightReport:
    """Bootstrap and check ``plan``'s ssh executor; never raises for a failed check (see the report)."""
    ex = plan.executor
    t0 = time.monotonic()
    assert ex.remote_dir
    try:
        target = SshTarget.from_executor(ex, plan.path) if conn is None else conn.target
    except SshError as exc:
        rep = PreflightReport(host=str(ex.host), remote_dir=ex.remote_dir)
        rep.add("plan", False, str(exc))
        return rep
    rep = PreflightReport(host=target.label, remote_dir=ex.remote_dir)
    own = conn is None
    conn = conn or HostConnection(target)
    try:
        await _run_checks(plan, conn, rep)
    except SshError as exc:  # the connection broke half-way
        rep.add("connection", False, str(exc))
    finally:
        if own:
            await conn.close()
        rep.seconds = time.monotonic() - t0
    return rep


async def _run_checks(plan: Plan, conn: HostConnection, rep: PreflightReport) -> None:
    ex = plan.executor
    mode = str(ex.options.get("pipeline", "auto"))
    if mode not in PIPELINE_MODES:
        rep.add(
            "plan",
            False,
            f"{plan.path}: executor.options.pipeline: must be one of {', '.join(PIPELINE_MODES)}",
        )
        return
    # 1. connection
    if not conn.connected:
        t = time.monotonic()
        try:
            await conn.connect()
        except SshError as exc:
            rep.add("connection", False, str(exc))
            return
        rep.add(
            "connection",
            True,
            f"{conn.target.label}, host key verified ({(time.monotonic() - t) * 1000:.0f} ms)",
        )
    else:
        rep.add("connection", True, f"{conn.target.label}, host key verified")
    # 2. python (first probe, with the host's own environment)
    info, err = await _probe(conn, ex.python, None, {"root": ex.remote_dir})
    if info is None:
        rep.add("python", False, err)
        return
    if not rep.add(
        "python",
        bool(info["version_ok"]),
        f"{info['executable']} {info['python']}"
        + (
            ""
            if info["version_ok"]
            else f": Aerie needs Python {'.'.join(map(str, MIN_PYTHON))}+ on the host (set [executor] python)"
        ),
    ):
        return
    python, root = str(info["executable"]), str(info["root"])
    # 3. run dir
    text = plan.path.read_bytes()
    if info.get("plan_sha256") and info["plan_sha256"] != hashlib.sha256(text).hexdigest():
        rep.add(
            "run dir",
            False,
            f"{root} already holds a different plan: attach to it (aerie attach "
            f"ssh://{conn.target.label}{root}) or set a new [executor] remote_dir",
        )
        return
    if not info["writable"]:
        rep.add("run dir", False, f"{info['existing']} is not writable by the ssh user: cannot create {root}")
        return
    async with conn.sftp() as sftp:
        try:
            # 0700 (the run dir, as the supervisor makes it): its logs and events are the operator's
            await sftp.makedirs(
                posixpath.join(root, ".aerie"), attrs=asyncssh.SFTPAttrs(permissions=0o700), exist_ok=True
            )
        except asyncssh.SFTPError as exc:
            rep.add("run dir", False, f"cannot create {root}: {exc.reason}")
            return
        existed = (
            "exists, holding this plan (re-attaching)"
            if info.get("plan_sha256")
            else ("exists" if info["root_exists"] else "created")
        )
        rep.add("run dir", True, f"{root} ({existed})")
        # 4. pipeline package
        pythonpath: str | None = None
        native_ok = info.get("protocol") == AGENT_PROTOCOL
        if mode == "installed" or (mode == "auto" and native_ok):
            if not native_ok:
                why = (
                    info.get("pipeline_error")
                    or f"it speaks agent protocol {info.get('protocol')}, not {AGENT_PROTOCOL}"
                )
                rep.add(
                    "pipeline",
                    False,
                    f"the host's pipeline cannot be used ({why}) and options.pipeline = "
                    '"installed" forbids uploading this console\'s copy',
                )
                return
            rep.add("pipeline", True, f"the host's own, from {info['pipeline_dir']}")
        else:
            try:
                pythonpath, what = await _upload_package(sftp, root)
            except (asyncssh.SFTPError, OSError) as exc:
                rep.add("pipeline", False, f"uploading the pipeline package failed: {exc}")
                return
            why = (
                ""
                if mode == "upload"
                else f" (the host has none: {info.get('pipeline_error', 'other protocol')})"
            )
            rep.add("pipeline", True, what + why)
        # 5. plan: upload, then validate on the host with the host's pipeline
        remote_plan = posixpath.join(root, UPLOADED_PLAN)
        try:
            await _write_atomic(sftp, remote_plan, text)
        except asyncssh.SFTPError as exc:
            rep.add("plan", False, f"uploading the plan to {remote_plan} failed: {exc.reason}")
            return
        modules = sorted({stage_module(s.run) for s in plan.stages if s.run})
        checked, err = await _probe(
            conn, python, pythonpath, {"root": root, "verify": True, "plan": remote_plan, "modules": modules}
        )
        if checked is None or "pipeline_error" in checked:
            why = f"pipeline does not import on the host: {checked['pipeline_error']}" if checked else ""
            rep.add("plan", False, err or why or "the host's Python gave no answer")
            return
        if checked.get("plan_error"):
            rep.add("plan", False, f"the host rejects the plan: {checked['plan_error']}")
            return
        bad = checked.get("module_errors") or {}
        if bad:
            rep.add(
                "plan",
                False,
                "stage modules that do not import on the host: "
                + "; ".join(f"{m}: {e}" for m, e in bad.items())
                + " (install the `pipeline` extra there)",
            )
            return
        rep.add(
            "plan",
            True,
            f"uploaded to {remote_plan}; valid on the host ({len(plan.stages)} stages"
            + (f", modules {', '.join(modules)} import" if modules else "")
            + ")",
        )
        # 6. SGLang: the host's release against the tested-versions table (pipeline/tested_versions.py)
        sg = checked.get("sglang")
        if sg and not _sglang(rep, sg):
            return
        # 7. disk
        declared = sum(s.output_bytes for s in plan.stages)
        free = info.get("free_bytes")
        if free is None:
            rep.add("disk", False, f"cannot read free space at {root}: {info.get('free_error')}")
            return
        if declared and free < declared:
            rep.add(
                "disk",
                False,
                f"{_gib(free)} free at {root}, but the stages declare {_gib(declared)} of outputs",
            )
            return
        rep.add(
            "disk",
            True,
            f"{_gib(free)} free at {root}" + (f" (stages declare {_gib(declared)})" if declared else ""),
        )
        # 8. the EAGLE-3 chain, checked on the host against the host's copy of the target
        if any(st.run in EAGLE3_STAGES for st in plan.stages):
            await _chain(rep, conn, python, pythonpath, remote_plan)
            if not rep.ok:
                return
        # 9. a Slurm plan: the login node's sinfo and a probe job on a compute node (pipeline.run.hosts.slurm.preflight)
        if ex.kind == "slurm":
            r = await conn.run(
                remote_python(
                    python,
                    pythonpath,
                    "-m",
                    "pipeline.run.hosts.slurm.preflight",
                    remote_plan,
                    "--run-dir",
                    root,
                ),
                timeout_s=600.0,
            )
            lines = [
                x.strip() for x in (r.stdout + r.stderr).splitlines() if x.strip().startswith(("ok", "FAIL"))
            ]
            detail = (
                "; ".join(x.split(None, 1)[-1] for x in lines if x.startswith("FAIL"))
                if r.returncode
                else f"{len(lines)} checks passed: " + "; ".join(x.split(None, 1)[-1] for x in lines)
            )
            if not rep.add("slurm", r.returncode == 0, detail or (r.stderr or r.stdout).strip()[-500:]):
                return
        layout = RemoteLayout(root=root, python=python, pythonpath=pythonpath, plan=remote_plan)
        await _write_atomic(sftp, posixpath.join(root, LAYOUT_FILE), layout.to_json().encode())
        rep.layout = layout
