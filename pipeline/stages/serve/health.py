"""Health of a running server: one ``GET /health`` probe, and the state machine around it.

``starting`` until the first good probe (``unhealthy`` if none within the startup timeout),
``ready`` after it, ``unhealthy`` after ``unhealthy_after`` failed probes in a row, ``ready`` again
after a good one. Probes use ``http.client`` directly (no proxy variables apply to loopback).
"""

from __future__ import annotations

import http.client
from dataclasses import dataclass

from pipeline.run.rundir.stage_row import HealthState


def probe(host: str, port: int, timeout_s: float, path: str = "/health") -> tuple[bool, str]:
    """``(ok, detail)`` of one probe: ok means HTTP 200 within ``timeout_s``."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read(200).decode(errors="replace").strip()
        if resp.status == 200:
            return True, body
        return False, f"HTTP {resp.status} {body[:120]}".strip()
    except TimeoutError:
        return False, f"no answer within {timeout_s:g}s"
    except (OSError, http.client.HTTPException) as exc:
        return False, f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


@dataclass
class HealthTracker:
    """Turns probe results into health transitions (``update`` returns the new state on a change)."""

    startup_timeout_s: float
    unhealthy_after: int = 3
    state: HealthState = HealthState.STARTING
    failures: int = 0
    ever_ready: bool = False

    def update(self, ok: bool, elapsed_s: float) -> HealthState | None:
        old = self.state
        if ok:
            self.failures = 0
            self.ever_ready = True
            self.state = HealthState.READY
        else:
            self.failures += 1
            if not self.ever_ready:
                if elapsed_s > self.startup_timeout_s:
                    self.state = HealthState.UNHEALTHY
            elif self.failures >= self.unhealthy_after:
                self.state = HealthState.UNHEALTHY
        return self.state if self.state != old else None

    @property
    def startup_expired(self) -> bool:
        return not self.ever_ready and self.state == HealthState.UNHEALTHY
