"""Durations as the CLI prints them: always with a unit."""

from __future__ import annotations


def duration(seconds: float) -> str:
    """'8.2 s', '4 min 05 s', '2 h 03 min', '3 d 04 h'."""
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h} h {m:02d} min"
    d, h = divmod(h, 24)
    return f"{d} d {h:02d} h"
