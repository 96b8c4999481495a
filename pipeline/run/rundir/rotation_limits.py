"""How big each kind of run file grows before it rotates, and how many generations are kept (``os`` only).

The table :mod:`pipeline.run.rundir.growth` rotates by, apart so that a stage's log writer, started at every
launch, reads its limit without importing the rotation machinery (docs/performance.md, "Launches").
"""

from __future__ import annotations

import os

MiB = 1 << 20
#: kind -> (bytes at which the file rotates, rotated generations kept)
LIMITS: dict[str, tuple[int, int]] = {
    "events": (64 * MiB, 3),
    "log": (256 * MiB, 2),
    "audit": (16 * MiB, 4),
    "supervisor": (16 * MiB, 2),
    "alerts": (4 * MiB, 2),  # RUN/alerts.jsonl (pipeline.run.alerts.record): its head carries the open ones
}
ENV_PREFIX = "AERIE_ROTATE_BYTES_"
RETRY_BYTES = 1 * MiB  # a rotation that failed is tried again after this much more was appended


def limit(kind: str) -> int:
    """Bytes at which a file of ``kind`` rotates (``AERIE_ROTATE_BYTES_<KIND>`` overrides; 0: never)."""
    default, _keep = LIMITS[kind]
    raw = os.environ.get(ENV_PREFIX + kind.upper(), "").strip()
    if not raw:
        return default
    try:
        return max(0, int(raw))
    except ValueError:
        return default


def keep(kind: str) -> int:
    """Rotated generations kept for ``kind``."""
    return LIMITS[kind][1]
