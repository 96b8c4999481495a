"""Disk budget and GPU guard: projected output bytes, and the two admission checks.

Every stage may declare ``output_bytes`` in the plan. Extraction (``run = "extract"``)
is projected from the plan and the upstream manifests instead, the way ``pipeline.stages.extract`` and
``pipeline.eagle3.hidden_store`` store it::

    bytes = tokens x captured layers x hidden size x dtype bytes  (+ 9 B/token: ids, mask, argmax)

with ``tokens`` the sum of ``"tokens"`` of the ``tokenized`` manifests (``manifest.json`` of each
upstream out dir, or of its sub-folders; ``prompts`` manifests carry none), capped by ``[extract]
max_tokens`` / ``max_rows``; ``captured layers`` the three aux layers EAGLE-3 fuses (``[extract]
aux_layers``) plus the final hidden state; ``hidden size`` from the target's ``config.json`` (local
folder, bundled model or Hugging Face cache; ``[target] hidden_size`` overrides); stored as bf16.
``[extract] mode = "online"`` (or ``[train] mode``) stores nothing. The held-out rows are counted
too, so before the stage runs this is an upper bound; once it runs, the ``projected_bytes`` metric it
emits replaces it.

Before a stage starts the supervisor calls :func:`disk_budget_check`: it refuses when the bytes the
stage still has to write exceed the free space of the run-dir filesystem minus ``[resources]
disk_reserve_gb`` (default 1) minus what running stages have still to write. :func:`gpu_guard_check`
refuses a stage that needs GPUs while any process holds one of them, naming the pid, its owner
("foreign" or a stage) and the GPU. ``python -m pipeline.run.supervise.ctl RUN force STAGE`` overrides both once;
the supervisor records that in the stage's events.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pipeline.manifests import shards as shards_manifest
from pipeline.manifests.base import ManifestError, of_kind
from pipeline.run.hosts.gpus import FOREIGN, GpuProbe
from pipeline.run.plan.dag import Plan, StageSpec
from pipeline.run.rundir.events import parse_lines
from pipeline.run.rundir.layout import RunDir
from pipeline.run.rundir.protocol import Metric, decode_all
from pipeline.run.rundir.stage_row import TERMINAL, StageState


class RunView(Protocol):
    """What the admission checks read of the supervisor (kept structural: budget never imports it)."""

    plan: Plan
    run: RunDir
    specs: dict[str, StageSpec]
    status: dict[str, Any]  # stage id -> StageStatus (has .state)


GB = 10**9


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; binary units, as ``df -h`` shows them."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def extraction_bytes(tokens: int, layers: int, hidden_size: int, dtype_bytes: int) -> int:
    """Bytes of stored hidden states: one ``hidden_size`` vector per token per captured layer."""
    for name, v in (
        ("tokens", tokens),
        ("layers", layers),
        ("hidden_size", hidden_size),
        ("dtype_bytes", dtype_bytes),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"extraction_bytes: {name} must be a non-negative integer, got {v!r}")
    return tokens * layers * hidden_size * dtype_bytes


@dataclass(frozen=True)
class Projection:
    """Projected output of one stage and how it was computed (shown in refusals)."""

    bytes: int
    how: str


class BudgetError(ValueError):
    """A plan or manifest value the projection cannot use; names the file and key."""


# ------------------------------------------------------------------------------ projection
STORED_DTYPE_BYTES = 2  # hidden states are stored as bf16 whatever the compute dtype
EXTRA_BYTES_PER_TOKEN = 4 + 1 + 4  # input_ids int32, loss_mask int8, target_argmax int32


def manifest_tokens(out_dir: Path) -> tuple[int, int] | None:
    """(tokens, rows) of the ``tokenized`` manifests of ``out_dir`` (top level, else sub-folders), read through
    :mod:`pipeline.manifests.shards`; ``prompts`` manifests (nothing to extract yet) are skipped."""
    tokens, rows, found = 0, 0, False
    try:
        for f in of_kind(out_dir, (shards_manifest.TOKENIZED,)):
            man = shards_manifest.read(f)
            tokens += man.tokens or 0
            rows += man.rows or 0
            found = True
    except ManifestError as exc:
        raise BudgetError(str(exc)) from None
    return (tokens, rows) if found else None


def _config_hidden_size(model: str) -> int | None:
    """``hidden_size`` from the target's config.json, without loading the model (or transformers)."""
    cfg: Path | None = None
    if model.startswith("builtin:"):
        from pipeline.run.plan.builtin_models import cache_dir

        cfg = cache_dir() / "models" / model[len("builtin:") :] / "config.json"
    elif Path(model).expanduser().is_dir():
        cfg = Path(model).expanduser() / "config.json"
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(model, "config.json")
            cfg = Path(hit) if isinstance(hit, str) else None
        except Exception:  # noqa: BLE001 - a missing/odd hub cache means "unknown", not a crash
            cfg = None
    if cfg is None or not cfg.is_file():
        return None
    try:
        doc = json.loads(cfg.read_text())
    except ValueError:
        return None
    hs = doc.get("hidden_size") or (doc.get("text_config") or {}).get("hidden_size")
    return int(hs) if isinstance(hs, int) else None


def emitted_projection(run: RunDir, sid: str, scan_bytes: int = 256 << 10) -> int | None:
    """The ``projected_bytes`` metric a running extraction emitted (early in its events), if any."""
    try:
        with open(run.stage(sid).events, "rb") as fh:
            head = fh.read(scan_bytes)
    except OSError:
        return None
    found = None
    events, _bad = parse_lines([line for line in head.splitlines() if b'"projected_bytes"' in line])
    for ev in decode_all(events):
        if isinstance(ev, Metric) and ev.name == "projected_bytes" and ev.finite:
            found = int(ev.value)
    return found


def extraction_projection(spec: StageSpec, plan: Plan, run: RunDir) -> Projection | None:
    """The projected bytes of an extraction stage; ``None`` while it cannot be computed yet."""
    if plan.settings.storage_mode == "online":
        return Projection(0, "online extraction stores nothing")
    emitted = emitted_projection(run, spec.id)
    if emitted is not None:
        return Projection(emitted, "projected_bytes reported by the stage")
    ext = plan.settings.extract
    layers = ext.aux_layer_count + 1  # + the final hidden state
    if plan.target.hidden_size is not None:
        hidden = plan.target.hidden_size
    else:
        h = _config_hidden_size(str(plan.target.model or ""))
        if h is None:
            return None
        hidden = h
    tokens, rows, found = 0, 0, False
    for dep in spec.after:
        got = manifest_tokens(run.stage(dep).out)
        if got is not None:
            tokens, rows, found = tokens + got[0], rows + got[1], True
    if not found:
        return None
    if ext.max_rows and rows:
        tokens = min(tokens, tokens * ext.max_rows // rows)
    if ext.max_tokens:
        tokens = min(tokens, ext.max_tokens)
    b = extraction_bytes(tokens, layers, hidden, STORED_DTYPE_BYTES) + tokens * EXTRA_BYTES_PER_TOKEN
    return Projection(
        b, f"{tokens:,} tokens x {layers} layers x hidden {hidden} x {STORED_DTYPE_BYTES} B (bf16)"
    )


def projected_bytes(spec: StageSpec, plan: Plan, run: RunDir) -> Projection | None:
    """What ``spec`` will write: its declared ``output_bytes``, else the extraction projection."""
    if spec.output_bytes > 0:
        return Projection(spec.output_bytes, "output_bytes declared in the plan")
    if spec.run == "extract":
        return extraction_projection(spec, plan, run)
    return None


def dir_bytes(path: Path) -> int:
    """Bytes allocated under ``path`` (like ``du``; symlinks not followed, errors skipped)."""
    total = 0
    stack = [path]
    while stack:
        p = stack.pop()
        try:
            with os.scandir(p) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(Path(e.path))
                        else:
                            st = e.stat(follow_symlinks=False)
                            total += st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
                    except OSError:
                        continue
        except OSError:
            continue
    return total


def disk_free(path: Path) -> tuple[int, int, int]:
    """(total, used, available-to-us) bytes of the filesystem holding ``path``."""
    st = os.statvfs(path)
    total = st.f_blocks * st.f_frsize
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    return total, used, st.f_bavail * st.f_frsize


def mount_of(path: Path) -> str:
    """The filesystem holding ``path``, named as an operator reads it: its mount point, and the device or
    source mounted there when ``/proc/self/mounts`` says (``/data (/dev/nvme1n1)``). The disk meter and
    the run projection both name it, so two figures about "the disk" are seen to be about the same one."""
    p = os.path.realpath(path)
    while not os.path.ismount(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    source = ""
    try:
        with open("/proc/self/mounts") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) > 1 and fields[1].replace("\\040", " ") == p:
                    source = fields[0]  # the last mount at a point is the one in effect
    except OSError:
        pass
    return f"{p} ({source})" if source and source.startswith("/") else p


def reserve_bytes(plan: Plan) -> int:
    return int(plan.resources.disk_reserve_gb * GB)


class _Cache:
    """Small TTL cache: admission checks run every supervisor tick; ``du`` of TBs must not."""

    def __init__(self, ttl_s: float = 10.0) -> None:
        self.ttl_s = ttl_s
        self._d: dict[Any, tuple[float, Any]] = {}

    def get(self, key: Any, fn: Any) -> Any:
        now = time.monotonic()
        hit = self._d.get(key)
        if hit and now - hit[0] < self.ttl_s:
            return hit[1]
        v = fn()
        self._d[key] = (now, v)
        return v


_written = _Cache()


def remaining_bytes(spec: StageSpec, plan: Plan, run: RunDir) -> tuple[int, Projection | None]:
    """Bytes ``spec`` has still to write (projection minus what its out dir already holds)."""
    proj = projected_bytes(spec, plan, run)
    if proj is None or proj.bytes <= 0:
        return 0, proj
    out = run.stage(spec.id).out
    written = _written.get(str(out), lambda: dir_bytes(out) if out.is_dir() else 0)
    return max(0, proj.bytes - written), proj


def remaining_projected_output(plan: Plan, run: RunDir, states: dict[str, str]) -> int:
    """Sum of what every not-yet-finished stage has still to write (for the console's warning)."""
    total = 0
    for spec in plan.stages:
        if states.get(spec.id, StageState.PENDING) in TERMINAL:
            continue
        try:
            total += remaining_bytes(spec, plan, run)[0]
        except (BudgetError, OSError):
            continue
    return total


# ------------------------------------------------------------------------ admission checks
def disk_budget_check(spec: StageSpec, sup: RunView) -> str | None:
    """Refuse ``spec`` when what it will write does not fit in free space minus the reserve."""
    try:
        return _disk_budget(spec, sup)
    except BudgetError as exc:
        return f"disk budget: cannot project {spec.id}'s output: {exc}"
    except Exception as exc:  # noqa: BLE001 - a refusal the operator can read and --force beats a crash
        return f"disk budget: check failed for {spec.id}: {type(exc).__name__}: {exc}"


def _disk_budget(spec: StageSpec, sup: RunView) -> str | None:
    need, proj = remaining_bytes(spec, sup.plan, sup.run)
    if proj is None or need <= 0:
        return None
    _, _, avail = disk_free(sup.run.root)
    reserve = reserve_bytes(sup.plan)
    committed = 0
    for sid, st in sup.status.items():
        if sid != spec.id and st.state in (StageState.RUNNING, StageState.PAUSED):
            try:
                committed += remaining_bytes(sup.specs[sid], sup.plan, sup.run)[0]
            except BudgetError:
                continue
    room = avail - reserve - committed
    if need <= room:
        return None
    others = f", {human_bytes(committed)} still to be written by running stages" if committed else ""
    return (
        f"disk budget: {spec.id} needs {human_bytes(need)} ({proj.how}) but {sup.run.root} has "
        f"{human_bytes(avail)} free minus a {human_bytes(reserve)} reserve{others}; free space, or "
        f"override once with `python -m pipeline.run.supervise.ctl {sup.run.root} force {spec.id}`"
    )


_probe: GpuProbe | None = None


def gpu_probe() -> GpuProbe:
    global _probe
    if _probe is None:
        _probe = GpuProbe()
    return _probe


def gpu_guard_check(spec: StageSpec, sup: RunView, probe: GpuProbe | None = None) -> str | None:
    """Refuse a stage needing GPUs while any process holds one of them (the stage is not running yet,
    so every holder is someone else: a foreign process, or a leftover of a stopped stage)."""
    if not spec.gpus or sup.plan.executor.kind == "slurm":  # Slurm hands out the GPUs of its nodes
        return None
    try:
        holders = (probe or gpu_probe()).holders(sup.run)
    except Exception as exc:  # noqa: BLE001 - visible and overridable, never a supervisor crash
        return f"GPU guard: cannot read GPU processes: {type(exc).__name__}: {exc}"
    if holders is None:
        return None  # no NVML on this host: nothing can be checked
    taken = []
    for g in spec.gpus:
        for p in holders.get(g, []):
            owner = p.get("owner", FOREIGN)
            who = f"foreign pid {p['pid']}" if owner == FOREIGN else f"pid {p['pid']} of stage {owner}"
            detail = ", ".join(
                x for x in (p.get("name"), human_bytes(p["mem"]) if p.get("mem") else None) if x
            )
            taken.append(f"GPU {g} held by {who}" + (f" ({detail})" if detail else ""))
    if not taken:
        return None
    return (
        "GPU guard: " + "; ".join(taken) + f" — stop it, or override once with "
        f"`python -m pipeline.run.supervise.ctl {sup.run.root} force {spec.id}`"
    )
