"""Staging on the lent machine: the chunk folders ``bench/gpu/stage_sglang.sh`` made here, each carried by one
``run`` call, copied under ``/tmp/sgl``; once every part is there they are joined, checked against ``c1/SHA256``
and unpacked into SGLang's site folder (``runner.SITE``), which later calls on the warm machine reuse.
"""

from __future__ import annotations

import hashlib
import shutil
import tarfile
import time
from pathlib import Path

from bench.gpu.runner import BASE, SITE, log


def stage(sources: list[Path]) -> None:
    """Copy carried chunk parts to /tmp/sgl/parts; once all are there, join, check and unpack the site folder."""
    parts = BASE / "parts"
    copy_carried(sources, parts)
    if (SITE / ".complete").exists():
        return
    if not (parts / "PARTS").exists():
        log("stage: chunk c1 (PARTS, SHA256) not carried yet")
        return
    want = int((parts / "PARTS").read_text())
    have = sorted(parts.glob("part.*"))
    if len(have) < want:
        log(f"stage: {len(have)}/{want} parts here; carry the rest")
        return
    t = time.monotonic()
    unpack(have, (parts / "SHA256").read_text().strip())
    log(f"stage: site unpacked in {time.monotonic() - t:.0f} s ({len(have)} parts)")


def copy_carried(sources: list[Path], parts: Path) -> None:
    """A chunk's files go to ``parts``; its folders (extra wheels, the tokenizer) straight under ``BASE``."""
    parts.mkdir(parents=True, exist_ok=True)
    for src in sources:
        for f in src.iterdir():
            if f.is_dir():
                shutil.copytree(f, BASE / f.name, dirs_exist_ok=True)
            else:
                shutil.copy2(f, parts / f.name)


def unpack(have: list[Path], sha256: str) -> None:
    """Join the parts in order, check the archive's sha256, unpack it under ``BASE`` and mark the site complete."""
    h = hashlib.sha256()
    joined = BASE / "site.tar.xz"
    with joined.open("wb") as out:
        for f in have:
            data = f.read_bytes()
            h.update(data)
            out.write(data)
    if h.hexdigest() != sha256:
        raise SystemExit("stage: joined archive's sha256 differs from c1/SHA256")
    with tarfile.open(joined) as tf:
        tf.extractall(BASE, filter="fully_trusted")
    (SITE / ".complete").write_text("ok")
    for f in (SITE / "bin").glob("*"):
        f.chmod(0o755)
