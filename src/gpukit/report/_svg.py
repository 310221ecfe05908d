"""Line and stacked-area charts as inline SVG text: no script, no network, opens anywhere.

Why SVG written here rather than a plotting library or a canvas script: the report must be
one self-contained file that opens offline, so a JS charting library would have to be inlined
(hundreds of KB) and matplotlib would be a heavy new dependency for PNGs. SVG paths are a few
lines of Python, stay sharp when zoomed, print well, and can be checked without a browser.
Long series are thinned by bucket means to at most ``MAX_POINTS`` points per line.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["MAX_POINTS", "Series", "chart", "nice_ticks"]

MAX_POINTS = 600
_W, _H = 600, 230
_L, _R, _T, _B = 68, 12, 26, 34  # margins: left (y labels), right, top (title), bottom (x labels)


@dataclass
class Series:
    """One line: ``ys[i]`` at ``xs[i]`` (``None`` values are gaps)."""

    name: str
    xs: Sequence[float]
    ys: Sequence[float | None]
    color: str
    width: float = 1.6
    dash: str | None = None


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values (1, 2, 5 x 10^k steps) covering ``[low, high]``."""
    if not math.isfinite(low) or not math.isfinite(high):
        return [0.0]
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / max(1, count)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    start = math.floor(low / step) * step
    ticks = []
    value = start
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    if ticks[-1] < high:
        ticks.append(round(value, 12))
    return ticks


def _thin(xs: Sequence[float], ys: Sequence[float | None]) -> tuple[list[float], list[float | None]]:
    if len(xs) <= MAX_POINTS:
        return list(xs), list(ys)
    size = math.ceil(len(xs) / MAX_POINTS)
    out_x: list[float] = []
    out_y: list[float | None] = []
    for i in range(0, len(xs), size):
        vals = [y for y in ys[i:i + size] if y is not None]
        out_x.append(sum(xs[i:i + size]) / len(xs[i:i + size]))
        out_y.append(sum(vals) / len(vals) if vals else None)
    return out_x, out_y


def _fmt_number(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.1e}"
    return f"{value:g}"


def chart(series: Sequence[Series], *, title: str, x_label: str, y_format: Callable[[float], str] | None = None,
          stacked: bool = False, y_min: float | None = 0.0, y_max: float | None = None,
          y_bytes: bool = False, markers: Sequence[tuple[float, str]] = ()) -> str:
    """An SVG chart of ``series`` (a ``<figure>`` element with a legend), or a note when empty.

    Args:
        series: lines to draw; with ``stacked`` each is filled on top of the ones before it.
        title, x_label: texts; the y unit belongs in the title.
        y_format: tick label of a y value (default: compact number).
        y_bytes: y values are bytes: ticks fall on round MiB / GiB.
        y_min, y_max: fixed ends of the y axis (``None``: from the data).
        markers: vertical dashed lines at x with a label (events).
    """
    fmt = y_format or _fmt_number
    # a NaN or infinite loss is a gap in its line, not a broken chart
    lines = [(s, *_thin(s.xs, [y if isinstance(y, (int, float)) and math.isfinite(y) else None for y in s.ys]))
             for s in series if len(s.xs)]
    if stacked:
        running: list[float] = []
        stacked_lines = []
        for s, xs, ys in lines:
            if not running:
                running = [0.0] * len(xs)
            base = list(running)
            running = [b + (y or 0.0) for b, y in zip(base, ys)]
            stacked_lines.append((s, xs, list(running), base))
    points = [(x, y) for _, xs, ys in lines for x, y in zip(xs, ys) if y is not None]
    heading = f'<figcaption>{html.escape(title)}</figcaption>'
    if not points:
        return (f'<figure class="chart empty">{heading}<p class="nodata">Not recorded in this run.</p></figure>')
    x_low, x_high = min(p[0] for p in points), max(p[0] for p in points)
    if stacked:
        tops = [y for _, _, top, _ in stacked_lines for y in top]
        y_values = tops + [0.0]
    else:
        y_values = [p[1] for p in points]
    low = min(y_values) if y_min is None else min(y_min, min(y_values))
    high = max(y_values) if y_max is None else y_max
    if y_bytes:  # round numbers of the unit the values are read in
        unit, name = next((u, n) for u, n in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))
                          if max(abs(high), abs(low)) >= u or u == 1)
        y_ticks = [t * unit for t in nice_ticks(low / unit, high / unit)]
        fmt = lambda v, unit=unit, name=name: f"{v / unit:g} {name}"  # noqa: E731
    else:
        y_ticks = nice_ticks(low, high)
    x_ticks = nice_ticks(x_low, x_high, 6)
    y0, y1 = y_ticks[0], y_ticks[-1]
    x0, x1 = (x_ticks[0], x_ticks[-1]) if x_high > x_low else (x_low - 0.5, x_low + 0.5)
    plot_w, plot_h = _W - _L - _R, _H - _T - _B

    def px(x: float) -> float:
        return _L + (x - x0) / (x1 - x0) * plot_w

    def py(y: float) -> float:
        return _T + plot_h - (y - y0) / ((y1 - y0) or 1.0) * plot_h

    out = [f'<svg viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img" '
           f'xmlns="http://www.w3.org/2000/svg"><title>{html.escape(title)}</title>']
    for tick in y_ticks:
        out.append(f'<line class="grid" x1="{_L}" x2="{_W - _R}" y1="{py(tick):.1f}" y2="{py(tick):.1f}"/>'
                   f'<text class="tick" x="{_L - 6}" y="{py(tick) + 4:.1f}" text-anchor="end">'
                   f'{html.escape(fmt(tick))}</text>')
    for tick in x_ticks:
        if x0 <= tick <= x1:
            out.append(f'<text class="tick" x="{px(tick):.1f}" y="{_H - _B + 15}" text-anchor="middle">'
                       f'{html.escape(_fmt_number(tick))}</text>')
    out.append(f'<text class="axis" x="{_L + plot_w / 2:.0f}" y="{_H - 4}" text-anchor="middle">'
               f'{html.escape(x_label)}</text>')
    out.append(f'<rect class="frame" x="{_L}" y="{_T}" width="{plot_w}" height="{plot_h}"/>')
    for x, label in markers:
        if x0 <= x <= x1:
            out.append(f'<line class="marker" x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{_T}" y2="{_T + plot_h}">'
                       f'<title>{html.escape(label)}</title></line>')
    if stacked:
        for s, xs, top, base in stacked_lines:
            upper = " L".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, top))
            lower = " L".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(reversed(xs), reversed(base)))
            out.append(f'<path class="series area" d="M{upper} L{lower} Z" fill="{s.color}" '
                       f'stroke="{s.color}"><title>{html.escape(s.name)}</title></path>')
    else:
        for s, xs, ys in lines:
            d = _path(xs, ys, px, py)
            if d:
                dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
                out.append(f'<path class="series" d="{d}" fill="none" stroke="{s.color}" '
                           f'stroke-width="{s.width}"{dash}><title>{html.escape(s.name)}</title></path>')
    out.append("</svg>")
    legend = "".join(f'<span><i style="background:{s.color}"></i>{html.escape(s.name)}</span>'
                     for s, _, _ in lines)
    return f'<figure class="chart">{heading}{"".join(out)}<div class="legend">{legend}</div></figure>'


def _path(xs: list[float], ys: list[float | None], px: Callable[[float], float],
          py: Callable[[float], float]) -> str:
    parts: list[str] = []
    pen_down = False
    for x, y in zip(xs, ys):
        if y is None:
            pen_down = False
            continue
        parts.append(f"{'L' if pen_down else 'M'}{px(x):.1f},{py(y):.1f}")
        pen_down = True
    if len(parts) == 1:  # a single point: draw a short tick so it is visible
        parts.append("h0.1")
    return " ".join(parts)
