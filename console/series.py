"""Metric history for the console's curves: bounded, whatever the length of the run.

Every numeric ``metric`` event a stage emits becomes a sample of the series ``(stage, attempt, name)``:
``x`` is the event's ``step`` when it has one (training steps), else seconds since the attempt's
first metric. A series holds at most :data:`MAX_POINTS` points. Each point is the mean of ``stride``
consecutive samples; ``stride`` starts at 1 and doubles whenever the series is full, by merging
neighbouring points in pairs. So a week-long run still draws its whole curve, evenly spaced from its
first step to its last, in fixed memory (512 points x 2 floats per series); the latest value is kept
exactly for the labels. Per stage at most :data:`MAX_SERIES` names and the last
:data:`MAX_ATTEMPTS` attempts are kept.

A NaN or infinite sample (a diverged loss) is no point of the mean — it would poison every point it is
averaged into — but it is kept: as the series' ``last`` (the legend says ``nan``) and in ``nonfinite``, the
steps where the value was not finite (the last :data:`MAX_NONFINITE`), which the curves mark.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_POINTS = 512
MAX_NONFINITE = 64  # the non-finite samples kept per series (each marked on its curve)
MAX_SERIES = 48  # metric names per stage
MAX_ATTEMPTS = 3


@dataclass
class Series:
    """One metric of one attempt: evenly downsampled points plus the bucket being filled."""

    points_x: list[float] = field(default_factory=list)
    points_y: list[float] = field(default_factory=list)
    stride: int = 1  # samples per point
    last: float | None = None  # the latest sample, exactly
    last_x: float | None = None
    nonfinite: list[tuple[float, float]] = field(default_factory=list)  # (x, nan or ±inf)
    _sx: float = 0.0
    _sy: float = 0.0
    _n: int = 0

    def add(self, x: float, y: float) -> None:
        if self.last_x is not None and x < self.last_x:
            self._restart(x)
        self.last, self.last_x = y, x
        if not math.isfinite(y):
            self.nonfinite = [*self.nonfinite[-(MAX_NONFINITE - 1) :], (x, y)]
            return
        self._sx += x
        self._sy += y
        self._n += 1
        if self._n >= self.stride:
            self.points_x.append(self._sx / self._n)
            self.points_y.append(self._sy / self._n)
            self._sx = self._sy = 0.0
            self._n = 0
            if len(self.points_x) >= MAX_POINTS:
                self.points_x = [
                    (a + b) / 2 for a, b in zip(self.points_x[::2], self.points_x[1::2], strict=True)
                ]
                self.points_y = [
                    (a + b) / 2 for a, b in zip(self.points_y[::2], self.points_y[1::2], strict=True)
                ]
                self.stride *= 2

    def _restart(self, x: float) -> None:
        """A resumed training went back to its checkpoint step: the curve continues from there."""
        keep = next((i for i in range(len(self.points_x) - 1, -1, -1) if self.points_x[i] < x), -1) + 1
        del self.points_x[keep:], self.points_y[keep:]
        self.nonfinite = [(nx, ny) for nx, ny in self.nonfinite if nx < x]
        self._sx = self._sy = 0.0
        self._n = 0

    @property
    def xs(self) -> list[float]:
        return self.points_x + ([self._sx / self._n] if self._n else [])

    @property
    def ys(self) -> list[float]:
        return self.points_y + ([self._sy / self._n] if self._n else [])

    def __len__(self) -> int:
        return len(self.points_x) + (1 if self._n else 0)

    @property
    def drawable(self) -> bool:
        """Anything to draw: a finite point, or a non-finite one to mark."""
        return bool(len(self) or self.nonfinite)


class StageHistory:
    """Every series of one stage, by attempt and metric name."""

    def __init__(self) -> None:
        self.attempts: dict[int, dict[str, Series]] = {}
        self._t0: dict[int, float] = {}
        self.version = 0  # bumped on every point: widgets redraw when it moved
        self._stepped: set[str] = set()

    def add(
        self, attempt: int, name: str, value: float, step: float | None, t: float, x_time: float | None = None
    ) -> None:
        """A sample: at ``step``, else at wall time ``t`` (or at ``x_time`` seconds, already relative)."""
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
            x = x_time if x_time is not None else t - self._t0.setdefault(attempt, t)
        else:
            x = float(step)
            self._stepped.add(name)
        s.add(x, value)
        self.version += 1

    def t0(self, attempt: int) -> float | None:
        """Wall time of the attempt's first step-less metric (x = 0 on its time axis)."""
        return self._t0.get(attempt)

    def merge_after(self, later: StageHistory) -> None:
        """Append ``later`` (what was read after this history's events) to this one, series by series."""
        for attempt, series in sorted(later.attempts.items()):
            for name, s in series.items():
                shift = 0.0
                if not later.uses_steps(name):
                    lt0 = later.t0(attempt)
                    if lt0 is not None:
                        shift = lt0 - self._t0.setdefault(attempt, lt0)
                points = sorted([*zip(s.xs, s.ys, strict=True), *s.nonfinite], key=lambda p: p[0])
                for x, y in points:
                    self.add(attempt, name, y, x if later.uses_steps(name) else None, 0.0, x_time=x + shift)
                mine = self.get(name, attempt)
                if mine is not None and s.last is not None and not math.isfinite(s.last):
                    mine.last = s.last  # the latest sample, exactly, even when it is the NaN

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
