"""The torch and transformers releases Aerie is tested with, and what to say when another one is installed.

Two sets are tested: the CPU lock (``constraints.txt``, what CI and the README install) and the lent GPU
image (torch 2.11, transformers 5.17). Other releases may work, but some change behaviour Aerie relies on
without an error: transformers 5.25 moved DeepSeek-V3's routed experts from the tensor-parallel plan to an
expert-parallel plan, so the same ``tp_plan="auto"`` load holds 6x the bytes per rank. Where that matters
(the deep check's memory figures, a tensor-parallel capture) Aerie says which release it is running on and
that it was not tested, rather than silently shard differently. See docs/testing.md, "Versions".
"""

from __future__ import annotations

import importlib.metadata

# package -> {major.minor: where it is tested}
TESTED: dict[str, dict[str, str]] = {
    "torch": {"2.13": "the CPU lock", "2.11": "the GPU image"},
    "transformers": {"5.24": "the CPU lock", "5.17": "the GPU image"},
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
