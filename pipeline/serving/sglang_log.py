"""Defensive parser of inference-server log lines: SGLang scheduler lines become numbers.

SGLang's scheduler prints one line per logged batch (``python/sglang/srt/managers/
scheduler_metrics_mixin.py``), e.g.::

    [2025-02-27 04:46:39 TP0] Decode batch. #running-req: 8, #token: 62531, token usage: 0.12,
        gen throughput (token/s): 186.64, #queue-req: 0
    [2026-04-05 20:02:51] Prefill batch, #new-seq: 1, #new-token: 158, #cached-token: 0, token usage: 0.08,
        #running-req: 31, #queue-req: 0, cuda graph: True, input throughput (token/s): 559.53

The field list changes between releases (``batch.`` vs ``batch,``, ``cache hit rate: 0.00%``,
``accept len`` with speculative decoding, ``full token usage`` on hybrid models, trailing commas,
other prefixes), so the parser reads *any* ``key: value`` list after ``Prefill batch`` / ``Decode
batch`` and maps the keys it knows to metrics; unknown keys are kept as fields, unknown lines give
``None`` and pass through untouched. Nothing in here raises on input text.

Uvicorn access lines (``"POST /v1/chat/completions HTTP/1.1" 200``), which SGLang and the local
``transformers serve`` backend both print, are parsed too, so both backends count requests the same way.

Pure standard library: the console imports :class:`ServerStats` for the server's live line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

MAX_LINE = 8192  # longer lines are cut before matching: a log line never costs more than this

_BATCH = re.compile(r"\b(?P<kind>Prefill|Decode) batch\b[.,:]?\s*")
_PREFIX = re.compile(r"^\s*\[(?P<inner>[^\]]{0,80})\]")
_RANK = re.compile(r"\b(?P<rank>(?:DP|TP|PP|EP|CP)\d+)\b")
_ACCESS = re.compile(
    r'"(?P<method>GET|POST|PUT|DELETE|PATCH|HEAD|OPTIONS) (?P<path>\S+) HTTP/[\d.]+"\s+(?P<status>\d{3})\b'
)
_READY = ("The server is fired up and ready to roll", "Application startup complete", "Uvicorn running on")
_NUM = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$")

# Normalised key -> metric name. Several source keys may feed one metric (format changes).
METRIC_KEYS: dict[str, str] = {
    "gen_throughput": "gen_throughput",
    "input_throughput": "input_throughput",
    "running_req": "running_req",
    "queue_req": "queue_req",
    "token_usage": "token_usage",
    "full_token_usage": "token_usage",
    "token": "kv_tokens",
    "full_token": "kv_tokens",
    "accept_len": "accept_len",
    "accept_rate": "accept_rate",
    "new_seq": "new_seq",
    "new_token": "new_token",
    "cached_token": "cached_token",
    "cache_hit_rate": "cache_hit_rate",
    "pending_token": "pending_token",
}
# Units shown next to each metric (the console's labels).
METRIC_UNITS = {
    "gen_throughput": "tok/s",
    "input_throughput": "tok/s",
    "running_req": "req",
    "queue_req": "req",
    "token_usage": "fraction",
    "kv_tokens": "tokens",
    "accept_len": "tokens",
    "accept_rate": "fraction",
    "new_seq": "seq",
    "new_token": "tokens",
    "cached_token": "tokens",
    "cache_hit_rate": "fraction",
    "pending_token": "tokens",
}


@dataclass(frozen=True)
class LogRecord:
    """One recognised line. ``kind``: ``decode`` | ``prefill`` | ``access`` | ``ready``."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)
    rank: str | None = None  # "TP0", "DP1 TP0", ... when the prefix names ranks
    stamp: str | None = None  # the time prefix as printed, when present

    def metrics(self) -> dict[str, float]:
        """Metric name -> value for the keys this parser knows (numbers only, booleans excluded)."""
        out: dict[str, float] = {}
        for k, v in self.fields.items():
            name = METRIC_KEYS.get(k)
            if name is None or isinstance(v, bool) or not isinstance(v, int | float):
                continue
            out.setdefault(name, float(v))
        return out


def normalise_key(raw: str) -> str:
    """``'#running-req'`` -> ``'running_req'``; ``'gen throughput (token/s)'`` -> ``'gen_throughput'``."""
    k = raw.strip().lower().lstrip("#").strip()
    k = re.sub(r"\([^)]*\)", "", k).strip()
    k = re.sub(r"[^a-z0-9]+", "_", k).strip("_")
    return k


def parse_value(raw: str) -> Any:
    """``'0.12'`` -> 0.12, ``'8'`` -> 8, ``'True'`` -> True, ``'12.5%'`` -> 0.125; else the text."""
    v = raw.strip().rstrip(",").strip()
    if v in ("True", "False"):
        return v == "True"
    pct = v.endswith("%")
    num = v[:-1].strip() if pct else v
    if _NUM.match(num):
        try:
            x: float | int = float(num) if any(c in num for c in ".eE") else int(num)
        except ValueError:
            return v
        return x / 100.0 if pct else x
    return v


def _fields(body: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in body.split(","):
        if ":" not in part:
            continue
        key, _, val = part.rpartition(":")
        k = normalise_key(key)
        if not k or not val.strip():
            continue
        out[k] = parse_value(val)
    return out


def _prefix(line: str) -> tuple[str | None, str | None]:
    m = _PREFIX.match(line)
    if not m:
        return None, None
    inner = m.group("inner")
    ranks = _RANK.findall(inner)
    rank = " ".join(ranks) if ranks else None
    stamp = _RANK.sub("", inner).strip() or None
    return stamp, rank


def parse_line(line: str | bytes) -> LogRecord | None:
    """The record of one log line, or ``None`` for anything not recognised. Never raises."""
    try:
        if isinstance(line, bytes):
            line = line.decode("utf-8", errors="replace")
        line = line[:MAX_LINE].rstrip("\r\n")
        m = _BATCH.search(line)
        if m:
            stamp, rank = _prefix(line)
            fields = _fields(line[m.end() :])
            if not fields:
                return None
            return LogRecord(m.group("kind").lower(), fields, rank, stamp)
        a = _ACCESS.search(line)
        if a:
            stamp, rank = _prefix(line)
            return LogRecord(
                "access",
                {"method": a.group("method"), "path": a.group("path"), "status": int(a.group("status"))},
                rank,
                stamp,
            )
        for marker in _READY:
            if marker in line:
                stamp, rank = _prefix(line)
                return LogRecord("ready", {"marker": marker}, rank, stamp)
    except Exception:  # noqa: BLE001 - a format change must never crash the stage
        return None
    return None


@dataclass
class ServerStats:
    """Latest server numbers, for the live line: tok/s, running, queued, token usage, accept length."""

    gen_throughput: float | None = None
    input_throughput: float | None = None
    running_req: float | None = None
    queue_req: float | None = None
    token_usage: float | None = None
    accept_len: float | None = None
    requests: int = 0  # completed HTTP requests to the generation endpoints
    errors: int = 0  # of those, answered with a 5xx
    lines: int = 0  # recognised batch lines

    def update(self, rec: LogRecord | None) -> None:
        if rec is None:
            return
        if rec.kind == "access":
            if "/completions" in str(rec.fields.get("path", "")) or "/generate" in str(
                rec.fields.get("path", "")
            ):
                self.requests += 1
                if int(rec.fields.get("status", 0)) >= 500:
                    self.errors += 1
            return
        if rec.kind not in ("decode", "prefill"):
            return
        self.lines += 1
        m = rec.metrics()
        for name in ("running_req", "queue_req", "token_usage"):
            if name in m:
                setattr(self, name, m[name])
        if rec.kind == "decode":
            if "gen_throughput" in m:
                self.gen_throughput = m["gen_throughput"]
            if "accept_len" in m:
                self.accept_len = m["accept_len"]
        elif "input_throughput" in m:
            self.input_throughput = m["input_throughput"]

    def line(self) -> str:
        """``'1635.1 tok/s · running 32 · queued 0 · tokens 8% · accept 2.17 · 12 req'``."""
        parts = []
        if self.gen_throughput is not None:
            parts.append(f"{self.gen_throughput:.1f} tok/s")
        if self.running_req is not None:
            parts.append(f"running {int(self.running_req)}")
        if self.queue_req is not None:
            parts.append(f"queued {int(self.queue_req)}")
        if self.token_usage is not None:
            parts.append(f"tokens {self.token_usage * 100:.0f}%")
        if self.accept_len is not None:
            parts.append(f"accept {self.accept_len:.2f}")
        if self.requests:
            parts.append(f"{self.requests} req" + (f" ({self.errors} 5xx)" if self.errors else ""))
        return " · ".join(parts) if parts else "no server statistics yet"
