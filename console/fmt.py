"""Formatting for the console: durations, rates, ETAs and text progress bars (humanized)."""

from __future__ import annotations

import math

import humanize

from pipeline.run.projection.text import span


def duration(seconds: float | None) -> str:
    """``3h 05m``, ``4m 12s``, ``9s`` — compact enough for a table column (:func:`span`; ``—`` for none)."""
    if seconds is None or math.isinf(seconds) or math.isnan(seconds):
        return "—"
    return span(seconds)


def rate(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    unit = unit or "items"
    if value >= 100:
        return f"{humanize.intword(int(value)) if value >= 1e6 else f'{value:,.0f}'} {unit}/s"
    if value >= 1:
        return f"{value:.1f} {unit}/s"
    if value > 0:
        return f"{value * 60:.1f} {unit}/min"
    return f"0 {unit}/s"


def count(value: float | None) -> str:
    if value is None:
        return "?"
    if value >= 10_000:
        return humanize.intword(int(value), format="%.1f").replace(" thousand", "K").replace(" million", "M")
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def bar(fraction: float | None, width: int = 12) -> str:
    if fraction is None:
        return "·" * width
    filled = int(round(fraction * width * 8))
    full, part = divmod(filled, 8)
    partial = " ▏▎▍▌▋▊▉"[part] if part and full < width else ""
    return ("█" * full + partial).ljust(width, "░")[:width]


def size(nbytes: float | None) -> str:
    """Bytes, binary units: ``139.8 GiB``; ``—`` when unknown."""
    return "—" if nbytes is None else humanize.naturalsize(nbytes, binary=True, format="%.1f")


def byte_rate(bps: float | None) -> str:
    """``300.0 MiB/s`` (negative when a disk frees space)."""
    if bps is None:
        return "—"
    return ("-" if bps < 0 else "") + size(abs(bps)) + "/s"
