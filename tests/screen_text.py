"""The text of a Textual screenshot (SVG), as the rows of characters the operator reads."""

from __future__ import annotations

import html
import re

_TEXT = re.compile(r'<text class="[^"]*" x="([\d.]+)" y="([\d.]+)" textLength="([\d.]+)"[^>]*>(.*?)</text>')


def svg_rows(svg: str) -> list[str]:
    rows: dict[float, list[tuple[float, str, float]]] = {}
    for m in _TEXT.finditer(svg):
        rows.setdefault(float(m[2]), []).append(
            (float(m[1]), html.unescape(m[4]).replace("\xa0", " "), float(m[3]))
        )
    cell = next((tl / len(t) for items in rows.values() for _x, t, tl in items if len(t) > 3), 12.2)
    out = []
    for y in sorted(rows):
        line = [" "] * 512
        for x, t, _tl in rows[y]:
            c = round(x / cell)
            for i, ch in enumerate(t):
                if c + i < len(line):
                    line[c + i] = ch
        out.append("".join(line).rstrip())
    return out
