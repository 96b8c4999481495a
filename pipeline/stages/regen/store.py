"""The regeneration stage's resumable answer log: ``responses.jsonl``, one answered record per line.

Each answer is appended with one ``write`` on an ``O_APPEND`` descriptor the moment it arrives and
fsynced at least every ``fsync_s`` seconds, so a killed stage loses at most the answers of that
window's last unsynced writes on a machine crash, and none on a plain process kill. On open, a torn
last line (a kill in the middle of a write) is cut off, and the ids already answered are loaded: a
retry never asks for them again.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class ResponseLog:
    def __init__(self, path: Path, fsync_s: float = 1.0) -> None:
        self.path = Path(path)
        self.fsync_s = fsync_s
        self.answered: dict[str, int] = {}  # id -> line number
        self.repaired_bytes = 0
        self._load()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._last_sync = time.monotonic()
        self._dirty = False

    def _load(self) -> None:
        if not self.path.exists():
            return
        raw = self.path.read_bytes()
        end = raw.rfind(b"\n") + 1
        if end < len(raw):  # a torn last line: the write that was cut is not an answer
            self.repaired_bytes = len(raw) - end
            with open(self.path, "r+b") as fh:
                fh.truncate(end)
                os.fsync(fh.fileno())
            raw = raw[:end]
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                rid = rec["id"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{self.path}: line {n}: not an answer record (JSON with an 'id')") from None
            self.answered[str(rid)] = n

    def __contains__(self, rid: str) -> bool:
        return rid in self.answered

    def __len__(self) -> int:
        return len(self.answered)

    def append(self, rec: dict[str, Any]) -> None:
        rid = str(rec["id"])
        if rid in self.answered:
            return  # never two answers for one record
        os.write(self._fd, (json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n").encode())
        self.answered[rid] = len(self.answered) + 1
        self._dirty = True
        if time.monotonic() - self._last_sync >= self.fsync_s:
            self.sync()

    def sync(self) -> None:
        if self._dirty and self._fd >= 0:
            os.fsync(self._fd)
            self._dirty = False
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1

    def records(self) -> dict[str, dict[str, Any]]:
        """Every answered record by id (reads the file)."""
        out: dict[str, dict[str, Any]] = {}
        with open(self.path, "rb") as fh:
            for line in fh:
                if line.strip():
                    rec = json.loads(line)
                    out[str(rec["id"])] = rec
        return out
