"""Turning measured figures into docs/BENCHMARKS.md: number formatting, growth with N, the machine block, the
marked sections of the doc and the PNG line charts. Nothing here measures (that is :mod:`bench.common` and each
benchmark's own measuring functions)."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import Machine

__all__ = ["stat", "growth", "machine_lines", "update_doc", "line_plot"]


def stat(values: Sequence[float], scale: float = 1.0, fmt: str = ".1f") -> str:
    """``median (min–max)`` of ``values * scale``."""
    v = [x * scale for x in values]
    return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}–{max(v):{fmt}})"


def growth(xs: Sequence[float], ys: Sequence[float]) -> str:
    """'flat' / 'linear' / 'sub-linear' from the first and last point (log-log slope)."""
    if len(xs) < 2 or min(ys) <= 0:
        return "n/a"
    slope = math.log(ys[-1] / ys[0]) / math.log(xs[-1] / xs[0])
    kind = "flat" if slope < 0.25 else "linear" if slope > 0.75 else "sub-linear"
    return f"{kind} (×{ys[-1] / ys[0]:.1f} for ×{xs[-1] / xs[0]:.0f} N; log-log slope {slope:.2f})"


def machine_lines(m: Machine) -> list[str]:
    """Markdown bullet lines: date, CPU and load, RAM and disk, versions, OS."""
    return [
        f"- Date: {m.date}",
        f"- CPU: {m.cpu}; {m.cores} logical cores ({m.usable} usable); "
        f"load average at start {m.load:.2f} (shared machine: wall times include waiting for a CPU)",
        f"- RAM: {m.ram}; disk: {m.disk}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in m.versions.items()),
        f"- OS: {m.os}",
    ]


# ------------------------------------------------------------------------------------------------ doc + plots
def update_doc(doc: Path, section: str, body: str) -> None:
    """Replace the text between ``<!-- bench:SECTION:begin -->`` and ``<!-- bench:SECTION:end -->`` in ``doc``
    (appending the markers if absent), leaving everything else as it is."""
    begin, end = f"<!-- bench:{section}:begin -->", f"<!-- bench:{section}:end -->"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n\n"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        pre, rest = text.split(begin, 1)
        _, post = rest.split(end, 1)
        text = pre + block + post
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    tmp = doc.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, doc)


_COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189), (140, 86, 75)]


@dataclass(frozen=True)
class _Frame:
    """One panel's plot area in pixels and the value range it shows (x always log10; y log10 unless ``logy``)."""

    x0: int
    y0: int
    w: int
    h: int
    xmin: float
    xmax: float
    ymin: float
    ymax: float
    logy: bool

    def fy(self, v: float) -> float:
        return math.log10(v) if self.logy else v

    def px(self, v: float) -> float:
        return self.x0 + (math.log10(v) - self.xmin) / (self.xmax - self.xmin) * self.w

    def py(self, v: float) -> float:
        return self.y0 + self.h - (self.fy(v) - self.ymin) / (self.ymax - self.ymin) * self.h


def _frame(k: int, pw: int, ph: int, top: int, panel: dict[str, Any], pts: list[tuple[float, float]]) -> _Frame:
    """The ``k``-th panel's frame, its ranges padded so that a single x or y value still spans the frame."""
    logy = panel.get("logy", True)
    fy = math.log10 if logy else (lambda v: v)
    xs, ys = [math.log10(x) for x, _ in pts], [fy(y) for _, y in pts]
    xmin, xmax = min(xs), max(xs)
    if xmax == xmin:
        xmin, xmax = xmin - 0.5, xmax + 0.5
    if logy:
        ymin, ymax = math.floor(min(ys)), math.ceil(max(ys))
    else:
        ymin, ymax = 0.0, max(ys) * 1.15
    if ymax == ymin:
        ymax = ymin + 1
    return _Frame(k * pw + 70, top + 30, pw - 100, ph - 90, xmin, xmax, ymin, ymax, logy)


def _draw_axes(d: Any, font: Any, left: int, f: _Frame, panel: dict[str, Any],
               pts: list[tuple[float, float]]) -> None:
    """The frame, the panel's title and axis labels, x ticks at the data's x values and the y grid."""
    x0, y0, w, h, ymin, ymax = f.x0, f.y0, f.w, f.h, f.ymin, f.ymax
    d.rectangle([x0, y0, x0 + w, y0 + h], outline="black")
    d.text((x0 + 10, y0 - 22), panel["title"], fill="black", font=font)
    d.text((x0 + w // 2 - 30, y0 + h + 22), panel["xlabel"], fill="black", font=font)
    d.text((left + 4, y0 - 22), panel["ylabel"], fill="black", font=font)
    # ticks
    for xv in sorted({x for x, _ in pts}):
        X = f.px(xv)
        d.line([X, y0 + h, X, y0 + h + 4], fill="black")
        d.text((X - 14, y0 + h + 6), f"{xv:g}" if xv < 1e4 else f"{xv / 1000:g}k", fill="black", font=font)
    if f.logy:
        for e in range(int(ymin), int(ymax) + 1):
            Y = y0 + h - (e - ymin) / (ymax - ymin) * h
            d.line([x0 - 4, Y, x0 + w, Y], fill=(225, 225, 225))
            d.text((x0 - 62, Y - 7), f"{10.0 ** e:g}", fill="black", font=font)
    else:
        for j in range(6):
            v = ymin + (ymax - ymin) * j / 5
            Y = y0 + h - j / 5 * h
            d.line([x0 - 4, Y, x0 + w, Y], fill=(225, 225, 225))
            d.text((x0 - 62, Y - 7), f"{v:.4g}", fill="black", font=font)


def _draw_series(d: Any, font: Any, f: _Frame, panel: dict[str, Any]) -> None:
    """Each series as a line with dots (positive values only), and its entry in the legend."""
    x0, y0 = f.x0, f.y0
    for i, (name, series) in enumerate(panel["series"].items()):
        c = _COLORS[i % len(_COLORS)]
        s = sorted((x, y) for x, y in series if y and y > 0)
        coords = [(f.px(x), f.py(y)) for x, y in s]
        if len(coords) > 1:
            d.line(coords, fill=c, width=3)
        for X, Y in coords:
            d.ellipse([X - 4, Y - 4, X + 4, Y + 4], fill=c)
        d.rectangle([x0 + 8, y0 + 8 + 18 * i, x0 + 22, y0 + 20 + 18 * i], fill=c)
        d.text((x0 + 28, y0 + 7 + 18 * i), name, fill="black", font=font)


def line_plot(path: Path, panels: list[dict[str, Any]], title: str = "") -> None:
    """Draw panels of log-log line charts into one PNG with Pillow (matplotlib is not a dependency).

    Each panel: ``{"title", "xlabel", "ylabel", "series": {name: [(x, y), ...]}, "logy": bool}``.
    """
    from PIL import Image, ImageDraw, ImageFont

    pw, ph, top = 520, 380, 40 if title else 10
    img = Image.new("RGB", (pw * len(panels), ph + top), "white")
    d = ImageDraw.Draw(img)
    try:
        font = ImageFont.load_default(size=13)
    except TypeError:  # Pillow < 10.1
        font = ImageFont.load_default()
    if title:
        d.text((10, 10), title, fill="black", font=font)
    for k, panel in enumerate(panels):
        pts = [(x, y) for s in panel["series"].values() for x, y in s if y and y > 0]
        if not pts:
            continue
        f = _frame(k, pw, ph, top, panel, pts)
        _draw_axes(d, font, k * pw, f, panel, pts)
        _draw_series(d, font, f, panel)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
