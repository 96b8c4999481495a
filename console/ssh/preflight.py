"""Bootstrap + preflight of an ssh plan, before its first stage: ``aerie preflight PLAN``.

Over 450 lines because the checks run in order over one connection, each feeding the next (the run dir
the upload, the uploaded pipeline the plan check): one sequence, :func:`_run_checks`, read top to bottom,
each step a named function below it.

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
9. what the executor kind adds (:func:`console.executors.host_preflight_checks`, run from
   :data:`HOST_CHECKS`): **slurm** — for ``[executor] kind = "slurm"`` with a host (the login node):
   ``sinfo`` and a probe job on a compute node (``python -m pipeline.run.hosts.slurm.preflight`` there).

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import asyncssh

import pipeline
from console import executors
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
                v = tv.plan_sglang(loaded) if hasattr(tv, "plan_sglang") else tv.classify_sglang(uses)
                r["sglang"] = {"level": v.level, "detail": v.detail, "uses": uses}
                if v.level == "absent" and hasattr(tv, "gpu_python_problem"):
                    r["sglang"]["python"] = tv.gpu_python_problem(sys.version_info[:3], sys.implementation.name)
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
        rep.add("sglang", False, f"{detail} — the plan runs SGLang ({', '.join(sg.get('uses', []))})")
        if sg.get("python"):  # this Python cannot install the GPU lock at all: say so before pip runs
            rep.add("python", False, str(sg["python"]))
        return False
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


@dataclass
class _OnHost:
    """Where the checks stand on the host once the pipeline is there: the steps after it read this."""

    conn: HostConnection
    python: str  # the host's interpreter, by the path it gave
    pythonpath: str | None  # the uploaded pipeline's directory; None: the host's own pipeline
    root: str  # the run directory
    remote_plan: str  # where the plan is uploaded


async def _run_checks(plan: Plan, conn: HostConnection, rep: PreflightReport) -> None:
    mode = _pipeline_mode(plan, rep)
    if mode is None or not await _check_connection(conn, rep):  # 1. connection
        return
    info = await _check_python(conn, plan, rep)  # 2. python (first probe, the host's own environment)
    if info is None:
        return
    # [executor] python as given (a wrapper script that sets up an environment stays the one that runs),
    # never the interpreter path the probe reports
    python, root = plan.executor.python, str(info["root"])
    text = plan.path.read_bytes()
    if not _run_dir_free(info, text, conn.target.label, rep):  # 3. run dir
        return
    async with conn.sftp() as sftp:
        if not await _make_run_dir(sftp, info, rep):
            return
        ok, pythonpath = await _check_pipeline(sftp, info, mode, rep)  # 4. pipeline package
        if not ok:
            return
        host = _OnHost(conn, python, pythonpath, root, posixpath.join(root, UPLOADED_PLAN))
        checked = await _check_plan(sftp, host, plan, text, rep)  # 5. plan
        if checked is None:
            return
        # 6. SGLang: the host's release against the tested-versions table (pipeline/tested_versions.py)
        sg = checked.get("sglang")
        if sg and not _sglang(rep, sg):
            return
        if not _check_disk(plan, info, root, rep):  # 7. disk
            return
        # 8. the EAGLE-3 chain, checked on the host against the host's copy of the target
        if any(st.run in EAGLE3_STAGES for st in plan.stages):
            await _chain(rep, conn, python, pythonpath, host.remote_plan)
            if not rep.ok:
                return
        for name in executors.host_preflight_checks(plan.executor):  # 9. what the executor kind adds
            if not await HOST_CHECKS[name](rep, host):
                return
        layout = RemoteLayout(root=root, python=python, pythonpath=pythonpath, plan=host.remote_plan)
        await _write_atomic(sftp, posixpath.join(root, LAYOUT_FILE), layout.to_json().encode())
        rep.layout = layout


def _pipeline_mode(plan: Plan, rep: PreflightReport) -> str | None:
    """The plan's ``[executor] options.pipeline`` (auto, upload or installed), or None, reported, when bad."""
    mode = str(plan.executor.options.get("pipeline", "auto"))
    if mode not in PIPELINE_MODES:
        rep.add(
            "plan",
            False,
            f"{plan.path}: executor.options.pipeline: must be one of {', '.join(PIPELINE_MODES)}",
        )
        return None
    return mode


async def _check_connection(conn: HostConnection, rep: PreflightReport) -> bool:
    """The ``connection`` line: connect (host key checked) unless the caller's connection already is."""
    if conn.connected:
        return rep.add("connection", True, f"{conn.target.label}, host key verified")
    t = time.monotonic()
    try:
        await conn.connect()
    except SshError as exc:
        return rep.add("connection", False, str(exc))
    return rep.add(
        "connection",
        True,
        f"{conn.target.label}, host key verified ({(time.monotonic() - t) * 1000:.0f} ms)",
    )


async def _check_python(conn: HostConnection, plan: Plan, rep: PreflightReport) -> dict | None:
    """The ``python`` line from the first probe; returns the probe's answer when the interpreter will do."""
    ex = plan.executor
    info, err = await _probe(conn, ex.python, None, {"root": ex.remote_dir})
    if info is None:
        rep.add("python", False, err)
        return None
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
        return None
    return info


def _run_dir_free(info: dict, text: bytes, label: str, rep: PreflightReport) -> bool:
    """Whether the run directory may be used: it holds no *different* plan and can be created."""
    root = info["root"]
    if info.get("plan_sha256") and info["plan_sha256"] != hashlib.sha256(text).hexdigest():
        return rep.add(
            "run dir",
            False,
            f"{root} already holds a different plan: attach to it (aerie attach "
            f"ssh://{label}{root}) or set a new [executor] remote_dir",
        )
    if not info["writable"]:
        return rep.add(
            "run dir", False, f"{info['existing']} is not writable by the ssh user: cannot create {root}"
        )
    return True


async def _make_run_dir(sftp: asyncssh.SFTPClient, info: dict, rep: PreflightReport) -> bool:
    """Create the run directory (and its ``.aerie``), then the ``run dir`` line saying what was there."""
    root = str(info["root"])
    try:
        # 0700 (the run dir, as the supervisor makes it): its logs and events are the operator's
        await sftp.makedirs(
            posixpath.join(root, ".aerie"), attrs=asyncssh.SFTPAttrs(permissions=0o700), exist_ok=True
        )
    except asyncssh.SFTPError as exc:
        return rep.add("run dir", False, f"cannot create {root}: {exc.reason}")
    existed = (
        "exists, holding this plan (re-attaching)"
        if info.get("plan_sha256")
        else ("exists" if info["root_exists"] else "created")
    )
    return rep.add("run dir", True, f"{root} ({existed})")


async def _check_pipeline(
    sftp: asyncssh.SFTPClient, info: dict, mode: str, rep: PreflightReport
) -> tuple[bool, str | None]:
    """The ``pipeline`` line: the host's own package, or this console's uploaded. Returns (usable, the
    uploaded copy's directory for PYTHONPATH, None for the host's own)."""
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
            return False, None
        return rep.add("pipeline", True, f"the host's own, from {info['pipeline_dir']}"), None
    try:
        pythonpath, what = await _upload_package(sftp, str(info["root"]))
    except (asyncssh.SFTPError, OSError) as exc:
        rep.add("pipeline", False, f"uploading the pipeline package failed: {exc}")
        return False, None
    why = "" if mode == "upload" else f" (the host has none: {info.get('pipeline_error', 'other protocol')})"
    return rep.add("pipeline", True, what + why), pythonpath


async def _check_plan(
    sftp: asyncssh.SFTPClient, host: _OnHost, plan: Plan, text: bytes, rep: PreflightReport
) -> dict | None:
    """The ``plan`` line: upload the plan, then validate it on the host with the host's pipeline (its stage
    modules must import there). Returns the second probe's answer when the plan is valid there."""
    try:
        await _write_atomic(sftp, host.remote_plan, text)
    except asyncssh.SFTPError as exc:
        rep.add("plan", False, f"uploading the plan to {host.remote_plan} failed: {exc.reason}")
        return None
    modules = sorted({stage_module(s.run) for s in plan.stages if s.run})
    checked, err = await _probe(
        host.conn,
        host.python,
        host.pythonpath,
        {"root": host.root, "verify": True, "plan": host.remote_plan, "modules": modules},
    )
    if checked is None or "pipeline_error" in checked:
        why = f"pipeline does not import on the host: {checked['pipeline_error']}" if checked else ""
        rep.add("plan", False, err or why or "the host's Python gave no answer")
        return None
    if checked.get("plan_error"):
        rep.add("plan", False, f"the host rejects the plan: {checked['plan_error']}")
        return None
    bad = checked.get("module_errors") or {}
    if bad:
        rep.add(
            "plan",
            False,
            "stage modules that do not import on the host: "
            + "; ".join(f"{m}: {e}" for m, e in bad.items())
            + " (install the `pipeline` extra there)",
        )
        return None
    rep.add(
        "plan",
        True,
        f"uploaded to {host.remote_plan}; valid on the host ({len(plan.stages)} stages"
        + (f", modules {', '.join(modules)} import" if modules else "")
        + ")",
    )
    return checked


def _check_disk(plan: Plan, info: dict, root: str, rep: PreflightReport) -> bool:
    """The ``disk`` line: free space at the run directory against the outputs the stages declare."""
    declared = sum(s.output_bytes for s in plan.stages)
    free = info.get("free_bytes")
    if free is None:
        return rep.add("disk", False, f"cannot read free space at {root}: {info.get('free_error')}")
    if declared and free < declared:
        return rep.add(
            "disk",
            False,
            f"{_gib(free)} free at {root}, but the stages declare {_gib(declared)} of outputs",
        )
    return rep.add(
        "disk",
        True,
        f"{_gib(free)} free at {root}" + (f" (stages declare {_gib(declared)})" if declared else ""),
    )


async def _check_slurm(rep: PreflightReport, host: _OnHost) -> bool:
    """The ``slurm`` line: the login node's sinfo and a probe job on a compute node
    (``python -m pipeline.run.hosts.slurm.preflight`` on the host)."""
    r = await host.conn.run(
        remote_python(
            host.python,
            host.pythonpath,
            "-m",
            "pipeline.run.hosts.slurm.preflight",
            host.remote_plan,
            "--run-dir",
            host.root,
        ),
        timeout_s=600.0,
    )
    lines = [x.strip() for x in (r.stdout + r.stderr).splitlines() if x.strip().startswith(("ok", "FAIL"))]
    detail = (
        "; ".join(x.split(None, 1)[-1] for x in lines if x.startswith("FAIL"))
        if r.returncode
        else f"{len(lines)} checks passed: " + "; ".join(x.split(None, 1)[-1] for x in lines)
    )
    return rep.add("slurm", r.returncode == 0, detail or (r.stderr or r.stdout).strip()[-500:])


# The checks an executor kind adds on its host (named by console.executors.host_preflight_checks), in the
# order it names them: each returns False, reported, when the run cannot start.
HOST_CHECKS: dict[str, Callable[[PreflightReport, _OnHost], Awaitable[bool]]] = {"slurm": _check_slurm}
