"""Metric history for the console's curves: bounded, whatever the length of the run.

Every numeric ``metric`` event a stage emits becomes a point of the series ``(stage, attempt, name)``:
``x`` is the event's ``step`` when it has one (training steps), else seconds since the attempt's
first metric. A series keeps at most :data:`MAX_POINTS` points. When it is full, the older half is
halved: neighbouring pairs there merge into one point (mean ``x``, mean ``y``), so the recent past
stays at full resolution and older history gets coarser — a week-long run still draws its whole
curve, in a fixed amount of memory (512 points x 2 floats per series). Per stage at most
:data:`MAX_SERIES` names and the last :data:`MAX_ATTEMPTS` attempts are kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_POINTS = 512
MAX_SERIES = 48  # metric names per stage
MAX_ATTEMPTS = 3


@dataclass
class Series:
    """One metric of one attempt: (x, y) points, downsampled in place when full."""

    xs: list[float] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)
    merged: int = 0  # how many times the older half was halved (0: every point is a sample)

    def add(self, x: float, y: float) -> None:
        if self.xs and x < self.xs[-1]:
            # A restart (a resumed training going back to its checkpoint step): the curve continues from there.
            keep = next((i for i in range(len(self.xs) - 1, -1, -1) if self.xs[i] <= x), -1) + 1
            del self.xs[keep:], self.ys[keep:]
        self.xs.append(x)
        self.ys.append(y)
        if len(self.xs) > MAX_POINTS:
            self._halve_old()

    def _halve_old(self) -> None:
        half = (len(self.xs) // 2) & ~1  # an even count of the oldest points, merged in pairs
        xs = [(self.xs[i] + self.xs[i + 1]) / 2 for i in range(0, half, 2)]
        ys = [(self.ys[i] + self.ys[i + 1]) / 2 for i in range(0, half, 2)]
        self.xs[:half] = xs
        self.ys[:half] = ys
        self.merged += 1

    @property
    def last(self) -> float | None:
        return self.ys[-1] if self.ys else None

    def __len__(self) -> int:
        return len(self.xs)


class StageHistory:
    """Every series of one stage, by attempt and metric name."""

    def __init__(self) -> None:
        self.attempts: dict[int, dict[str, Series]] = {}
        self._t0: dict[int, float] = {}
        self.version = 0  # bumped on every point: widgets redraw when it moved
        self._stepped: set[str] = set()

    def add(self, attempt: int, name: str, value: float, step: float | None, t: float) -> None:
        series = self.attempts.get(attempt)
        if series is None:
            series = self.attempts[attempt] = {}
            for old in sorted(self.attempts)[:-MAX_ATTEMPTS]:
                del self.attempts[old]
                self._t0.pop(old, None)
            if attempt not in self.attempts:
                return  # an attempt older than the ones kept
        s = series.get(name)
        if s is None:
            if len(series) >= MAX_SERIES:
                return
            s = series[name] = Series()
        if step is None:
            t0 = self._t0.setdefault(attempt, t)
            x = t - t0
        else:
            x = float(step)
            self._stepped.add(name)
        s.add(x, value)
        self.version += 1

    def names(self, attempt: int | None = None) -> list[str]:
        """Metric names of an attempt (default: the latest), in the order they first appeared."""
        if not self.attempts:
            return []
        return list(self.attempts[attempt if attempt is not None else max(self.attempts)].keys())

    def latest(self) -> int | None:
        return max(self.attempts) if self.attempts else None

    def get(self, name: str, attempt: int | None = None) -> Series | None:
        a = attempt if attempt is not None else self.latest()
        return self.attempts.get(a, {}).get(name) if a is not None else None

    def across_attempts(self, name: str) -> list[tuple[int, Series]]:
        return [(a, s[name]) for a, s in sorted(self.attempts.items()) if name in s]

    def uses_steps(self, name: str) -> bool:
        """True when ``name`` came with steps (the x axis is "step"), else it is seconds."""
        return name in self._stepped
