"""The releases Aerie is tested with, and what to say when another one is installed.

Three sets are tested: the CPU lock (``constraints.txt``, what CI and the README install), the lent GPU
image (torch 2.11, transformers 5.17), and the GPU lock (``constraints-gpu.txt``: torch 2.11 with SGLang
0.5.14's transformers 5.8.1, which the capture through SGLang ran with; the other stages ran on 5.17 there). Other releases may work, but some change behaviour Aerie relies on
without an error: transformers 5.25 moved DeepSeek-V3's routed experts from the tensor-parallel plan to an
expert-parallel plan, so the same ``tp_plan="auto"`` load holds 6x the bytes per rank. Where that matters
(the deep check's memory figures, a tensor-parallel capture) Aerie says which release it is running on and
that it was not tested, rather than silently shard differently. See docs/testing.md, "Versions".

The GPU stack (:data:`SGLANG_STACKS`): each SGLang release Aerie knows, with the torch, transformers and
sglang-kernel it ran with, and whether it is *tested* (it ran on the lent H200; the GPU lock
``constraints-gpu.txt`` pins it) or *known-broken* (and why, and for which use). :func:`classify_sglang` says
what the host's installed SGLang is against that table; ``aerie preflight`` and ``aerie plan check --deep``
report it: a tested stack passes, another release or a tested release beside other torch/transformers is a
warning, a known-broken release refuses a plan that uses what it breaks. CI checks the SGLang source Aerie
calls (class, function and attribute names, signatures) in every release of the table, from its wheel
(``tests/test_sglang_api.py``), so a row's status is checked, not remembered; the table in docs/operating.md
is this one (a test compares them).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# package -> {major.minor: where it is tested}
TESTED: dict[str, dict[str, str]] = {
    "torch": {"2.13": "the CPU lock", "2.11": "the GPU image"},
    "transformers": {
        "5.24": "the CPU lock",
        "5.17": "the GPU image",
        "5.8": "the GPU lock: SGLang 0.5.14's pin, with which the extract stage captured through SGLang on the H200",
    },
}


def installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def minor(version: str) -> str:
    """``"5.24.0"`` and ``"2.13.0+cpu"`` -> ``"5.24"``, ``"2.13"``."""
    return ".".join(version.split("+")[0].split(".")[:2])


def untested(versions: dict[str, str | None] | None = None) -> list[str]:
    """One sentence per installed package whose release is not a tested one (empty when all are).

    ``versions`` overrides what is installed (``{"transformers": "5.25.0"}``), for tests and reports.
    """
    notes = []
    for package, tested in TESTED.items():
        version = versions[package] if versions and package in versions else installed(package)
        if version is None or minor(version) in tested:
            continue
        where = ", ".join(f"{v} ({w})" for v, w in tested.items())
        notes.append(f"{package} {version} is not a release Aerie was tested with (tested: {where})")
    return notes


TESTED_STATUS = "tested"
KNOWN_BROKEN = "known-broken"

# What a plan asks of SGLang: "serve" (a serve stage with backend = "sglang") and "capture" ([target] engine =
# "sglang": SGLang's model runner in the extract or train process, Aerie driving its batch API).
USES = ("serve", "capture")


@dataclass(frozen=True)
class SGLangStack:
    """One SGLang release and the packages it ran with (its own pins: torch, transformers, sglang-kernel)."""

    sglang: str
    torch: str
    transformers: str
    sglang_kernel: str
    status: str  # TESTED_STATUS or KNOWN_BROKEN
    why: str
    broken_for: tuple[str, ...] = ()  # the USES a known-broken release breaks; the others are only untested


SGLANG_STACKS: tuple[SGLangStack, ...] = (
    SGLangStack(
        "0.5.14",
        "2.11.0",
        "5.8.1",
        "0.4.4",
        TESTED_STATUS,
        "ran on the lent H200: the serve stage's argv serving EAGLE-3 and DFlash drafts, and the capture "
        "through its model runner (docs/performance.md); the GPU lock pins it (constraints-gpu.txt)",
    ),
    SGLangStack(
        "0.5.23",
        "2.14.1",
        "5.19.0",
        "0.4.10",
        KNOWN_BROKEN,
        "its batch API changed: Req no longer has fill_len, extend_input_len or prefix_indices, "
        "ScheduleBatch no capture_hidden_mode, and ForwardBatch.init_new needs return_hidden_states_before_norm, "
        "so the capture through its model runner cannot run; its launch argv parses (CI), serving never ran on "
        "a GPU",
        broken_for=("capture",),
    ),
)

SGLANG_PACKAGES = {
    "sglang": "sglang",
    "torch": "torch",
    "transformers": "transformers",
    "sglang_kernel": "sglang-kernel",
}


@dataclass(frozen=True)
class Verdict:
    """What the installed SGLang is against :data:`SGLANG_STACKS`: ``level`` ok, warn, refuse or absent."""

    level: str
    detail: str
    sglang: str | None = None

    @property
    def ok(self) -> bool:
        return self.level != "refuse"

    @property
    def warning(self) -> bool:
        return self.level in ("warn", "absent")


def base(version: str) -> str:
    """``"2.11.0+cu130"`` -> ``"2.11.0"``: a local build label does not change the release."""
    return version.split("+")[0]


def stack_of(sglang: str) -> SGLangStack | None:
    return next((s for s in SGLANG_STACKS if s.sglang == base(sglang)), None)


def tested_sglang() -> list[str]:
    return [s.sglang for s in SGLANG_STACKS if s.status == TESTED_STATUS]


ALLOW_UNTESTED_KEY = "target.allow_untested_sglang"
INSTALL = "pip install -c constraints-gpu.txt '.[pipeline,gpu]'"


def release(version: str) -> tuple[int, ...]:
    """``"0.5.23.post1"`` -> ``(0, 5, 23)``: the release numbers, for "newer than" (standard library only)."""
    nums = []
    for part in base(version).split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        nums.append(int(digits))
        if digits != part:
            break
    return tuple(nums)


def newest_tested() -> str:
    return max(tested_sglang(), key=release)


def gpu_extra_requirement() -> str:
    """The ``gpu`` extra's SGLang requirement the table implies: from the oldest to the newest tested release,
    every known-broken release between them excluded (pyproject.toml carries it; a test compares them)."""
    tested = sorted(tested_sglang(), key=release)
    spec = [f">={tested[0]}", f"<={tested[-1]}"]
    lo, hi = release(tested[0]), release(tested[-1])
    spec += [
        f"!={s.sglang}" for s in SGLANG_STACKS if s.status == KNOWN_BROKEN and lo < release(s.sglang) < hi
    ]
    return "sglang" + ",".join(spec)


def _unknown(sg: str, used: list[str], allow_untested: bool) -> Verdict:
    """A release the table does not hold: newer than the last tested one refuses capture unless the plan allows it."""
    tested, newest = ", ".join(tested_sglang()), newest_tested()
    if "capture" in used and release(sg) > release(newest) and not allow_untested:
        return Verdict(
            "refuse",
            f"SGLang {sg} is newer than the last release Aerie was tested with ({newest}): Aerie's capture drives "
            f"its batch API, which changes between releases; install a tested release ({tested}: {INSTALL}), or "
            f"set {ALLOW_UNTESTED_KEY} = true in the plan to try it",
            sg,
        )
    allowed = f" (allowed by {ALLOW_UNTESTED_KEY})" if allow_untested and "capture" in used else ""
    return Verdict(
        "warn",
        f"SGLang {sg} is not a release Aerie was tested with (tested: {tested}){allowed}; Aerie's capture "
        f"drives its batch API, which changes between releases ({INSTALL})",
        sg,
    )


def classify_sglang(
    uses: Iterable[str] = USES,
    version_of: Callable[[str], str | None] | None = None,
    allow_untested: bool = False,
) -> Verdict:
    """The installed SGLang stack against the table, for a plan that ``uses`` SGLang so.

    ``version_of`` maps a distribution name to its installed version (default: this interpreter's);
    tests and remote reports pass their own. ``allow_untested``: the plan's ``[target] allow_untested_sglang``.
    """
    get = version_of or installed
    used = sorted(set(uses))
    have = {key: get(dist) for key, dist in SGLANG_PACKAGES.items()}
    tested = ", ".join(tested_sglang())
    install = INSTALL
    sg = have["sglang"]
    if sg is None:
        return Verdict("absent", f"SGLang is not installed here (tested: {tested}; {install})")
    row = stack_of(sg)
    if row is None:
        return _unknown(sg, used, allow_untested)
    if row.status == KNOWN_BROKEN:
        hit = [u for u in used if u in row.broken_for]
        if hit:
            return Verdict(
                "refuse",
                f"SGLang {sg} is known broken for {' and '.join(hit)}: {row.why}; install a tested release "
                f"({tested}: {install})",
                sg,
            )
        return Verdict("warn", f"SGLang {sg} is untested for {', '.join(used) or 'this plan'}: {row.why}", sg)
    off = [
        f"{key.replace('_', '-')} {have[key]} (ran with {getattr(row, key)})"
        for key in ("torch", "transformers", "sglang_kernel")
        if have[key] is not None and base(str(have[key])) != getattr(row, key)
    ]
    if off:
        return Verdict(
            "warn",
            f"SGLang {sg} is tested, but beside other packages than it ran with: {', '.join(off)} ({install})",
            sg,
        )
    return Verdict(
        "ok",
        f"SGLang {sg}, torch {have['torch']}, transformers {have['transformers']}, sglang-kernel "
        f"{have['sglang_kernel']}: tested ({row.why.split(':')[0]})",
        sg,
    )


def sglang_uses(plan: object) -> set[str]:
    """What a loaded plan asks of SGLang (:data:`USES`); empty when it never runs SGLang."""
    settings = getattr(plan, "settings", None)
    uses = set()
    if getattr(getattr(settings, "target", None), "engine", None) == "sglang":
        uses.add("capture")
    serve = getattr(settings, "serve", None)
    if getattr(serve, "backend", None) == "sglang" and any(
        getattr(s, "run", None) == "serve" for s in getattr(plan, "stages", ())
    ):
        uses.add("serve")
    return uses


def allows_untested(plan: object) -> bool:
    """The plan's ``[target] allow_untested_sglang``."""
    target = getattr(getattr(plan, "settings", None), "target", None)
    return bool(getattr(target, "allow_untested_sglang", False))


def plan_sglang(plan: object, version_of: Callable[[str], str | None] | None = None) -> Verdict | None:
    """The installed SGLang against the table for what ``plan`` asks of it; ``None`` when it runs no SGLang."""
    uses = sglang_uses(plan)
    return classify_sglang(uses, version_of, allows_untested(plan)) if uses else None


def stage_refusal(
    plan: object, use: str, version_of: Callable[[str], str | None] | None = None
) -> str | None:
    """The line a stage about to run SGLang (``use``: serve or capture) fails with at its start, before any
    model loads: SGLang absent, or the table refuses it; ``None`` when it may go on (a warning is not a refusal)."""
    v = classify_sglang([use], version_of, allows_untested(plan))
    if v.level == "absent":
        return f"{v.detail}: this stage runs SGLang ({use}) with this interpreter ({sys.executable})"
    return v.detail if v.level == "refuse" else None


# constraints-gpu.txt resolves on CPython 3.12 only (sglang 0.5.14 ships cp312 wheels)
GPU_LOCK_PYTHON = (3, 12)


def gpu_python_problem(version: tuple[int, ...], implementation: str = "cpython") -> str | None:
    """Why the GPU lock cannot install on this interpreter (one line), or ``None``: it needs CPython 3.12; on
    3.11 or 3.13 pip fails after minutes blaming scipy or outlines-core rather than the Python."""
    if implementation == "cpython" and tuple(version[:2]) == GPU_LOCK_PYTHON:
        return None
    want = ".".join(map(str, GPU_LOCK_PYTHON))
    have = f"{implementation} {'.'.join(map(str, version[:3]))}"
    return (
        f"the GPU lock (constraints-gpu.txt) installs on CPython {want} only, this is {have}: create the "
        f"environment with python{want} (e.g. `python{want} -m venv .venv`) before `{INSTALL}`"
    )


def markdown_table() -> str:
    """The table of :data:`SGLANG_STACKS` as docs/operating.md carries it (tests compare the two)."""
    rows = [
        "| SGLang | torch | transformers | sglang-kernel | status | why |",
        "|---|---|---|---|---|---|",
    ]
    for s in SGLANG_STACKS:
        status = s.status + (f" ({', '.join(s.broken_for)})" if s.broken_for else "")
        rows.append(f"| {s.sglang} | {s.torch} | {s.transformers} | {s.sglang_kernel} | {status} | {s.why} |")
    return "\n".join(rows)
