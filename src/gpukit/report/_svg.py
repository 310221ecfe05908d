"""Line and stacked-area charts as inline SVG text: no script, no network, opens anywhere.

Why SVG written here rather than a plotting library or a canvas script: the report must be
one self-contained file that opens offline, so a JS charting library would have to be inlined
(hundreds of KB) and matplotlib would be a heavy new dependency for PNGs. SVG paths are a few
lines of Python, stay sharp when zoomed, print well, and can be checked without a browser.
Long series are thinned by bucket means to at most ``MAX_POINTS`` points per line, so a chart
is a few tens of KB whatever the record holds. Axis ticks come from :mod:`._axis`.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from gpukit.report._axis import Axis, axis_for, nice_ticks

__all__ = ["MAX_MARKERS", "MAX_POINTS", "Series", "chart", "nice_ticks"]

MAX_POINTS = 600
MAX_MARKERS = 200  # event lines drawn per chart
_W, _H = 600, 230
_L, _R, _T, _B = 68, 12, 26, 34  # margins: left (y labels), right, top (title), bottom (x labels)
_PLOT_H = _H - _T - _B


@dataclass
class Series:
    """One line: ``ys[i]`` at ``xs[i]`` (a ``None`` y is a gap; a ``None`` x a break between runs)."""

    name: str
    xs: Sequence[float | None]
    ys: Sequence[float | None]
    color: str
    width: float = 1.6
    dash: str | None = None


def _segments(xs: Sequence[float | None], ys: Sequence[float | None]) -> list[tuple[list[float], list[float | None]]]:
    """Split at ``None`` x values (a break between runs: the pen is lifted there)."""
    out: list[tuple[list[float], list[float | None]]] = [([], [])]
    for x, y in zip(xs, ys):
        if x is None:
            if out[-1][0]:
                out.append(([], []))
            continue
        out[-1][0].append(x)
        out[-1][1].append(y)
    return [seg for seg in out if seg[0]]


def _thin(xs: Sequence[float | None], ys: Sequence[float | None]) -> tuple[list[float | None], list[float | None]]:
    """At most about ``MAX_POINTS`` points (bucket means), breaks kept; each segment gets its share."""
    segments = _segments(xs, ys)
    total = sum(len(seg[0]) for seg in segments)
    out_x: list[float | None] = []
    out_y: list[float | None] = []
    for seg_x, seg_y in segments:
        if out_x:
            out_x.append(None)
            out_y.append(None)
        budget = max(2, MAX_POINTS * len(seg_x) // max(1, total))
        size = math.ceil(len(seg_x) / budget)
        if size <= 1:
            out_x.extend(seg_x)
            out_y.extend(seg_y)
            continue
        for i in range(0, len(seg_x), size):
            vals = [y for y in seg_y[i:i + size] if y is not None]
            out_x.append(sum(seg_x[i:i + size]) / len(seg_x[i:i + size]))
            out_y.append(sum(vals) / len(vals) if vals else None)
    return out_x, out_y


def _stack(lines: list[tuple[Series, list[float | None], list[float | None]]]) -> list[tuple[Series, list, list, list]]:
    """Each series' top and base when filled on top of the ones before it (same x positions)."""
    running: list[float | None] = []
    out = []
    for s, xs, ys in lines:
        if len(running) != len(xs):
            running = [None if x is None else 0.0 for x in xs]
        base = list(running)
        running = [None if b is None else b + (y or 0.0) for b, y in zip(base, ys)]
        out.append((s, xs, list(running), base))
    return out


def chart(series: Sequence[Series], *, title: str, x_label: str, x_kind: str = "number",
          y_kind: str = "number", stacked: bool = False, y_min: float | None = 0.0, y_max: float | None = None,
          markers: Sequence[tuple[float, str]] = (), run_starts: Sequence[tuple[float, str]] = ()) -> str:
    """An SVG chart of ``series`` (a ``<figure>`` element with a legend), or a note when empty.

    Args:
        series: lines to draw (a ``None`` x lifts the pen: a break between runs); with ``stacked``
            each is filled on top of the ones before it.
        title, x_label: texts.
        x_kind, y_kind: ``"seconds"``, ``"bytes"`` or ``"number"``: ticks are round values in a
            unit chosen for the axis's range (ms / s / min / h; B / KiB / ... / TiB).
        y_min, y_max: fixed ends of the y axis (``None``: from the data).
        markers: vertical dashed lines at x with a label shown on hover (events).
        run_starts: vertical lines at x with a short label drawn (where each run starts).
    """
    # a NaN or infinite loss is a gap in its line, not a broken chart
    lines = [(s, *_thin(s.xs, [y if isinstance(y, (int, float)) and math.isfinite(y) else None for y in s.ys]))
             for s in series if len(s.xs)]
    stacked_lines = _stack(lines) if stacked else []
    if stacked:
        points = [(x, y) for _, xs, top, _ in stacked_lines for x, y in zip(xs, top) if x is not None and y is not None]
    else:
        points = [(x, y) for _, xs, ys in lines for x, y in zip(xs, ys) if x is not None and y is not None]
    heading = f'<figcaption>{html.escape(title)}</figcaption>'
    if not points:
        return f'<figure class="chart empty">{heading}<p class="nodata">Not recorded in this run.</p></figure>'
    plot = _Plot.around(points, x_kind, y_kind, y_min=y_min, y_max=y_max, with_zero=stacked)
    out = [f'<svg viewBox="0 0 {_W} {_H}" role="img" '
           f'xmlns="http://www.w3.org/2000/svg"><title>{html.escape(title)}</title>']
    out += plot.axes(x_label)
    out += plot.vertical_lines(markers, run_starts)
    out += plot.areas(stacked_lines) if stacked else plot.lines(lines)
    out.append("</svg>")
    legend = "".join(f'<span><i style="background:{s.color}"></i>{html.escape(s.name)}</span>'
                     for s, _, _ in lines)
    return f'<figure class="chart">{heading}{"".join(out)}<div class="legend">{legend}</div></figure>'


@dataclass(frozen=True)
class _Plot:
    """The plotting area: the axes, the data range they span, and data -> pixel positions."""

    x_axis: Axis
    y_axis: Axis
    x0: float
    x1: float

    @classmethod
    def around(cls, points: list[tuple[float, float]], x_kind: str, y_kind: str, *, y_min: float | None,
               y_max: float | None, with_zero: bool) -> _Plot:
        """The plot of ``points`` (``with_zero``: the y axis reaches 0, as stacked areas stand on it)."""
        x_low, x_high = min(p[0] for p in points), max(p[0] for p in points)
        y_values = [p[1] for p in points] + ([0.0] if with_zero else [])
        low = min(y_values) if y_min is None else min(y_min, min(y_values))
        high = max(y_values) if y_max is None else max(y_max, low)
        x_axis = axis_for(x_low, x_high, x_kind, count=6)
        # the x axis spans the data, not the round ticks around it: 320 steps end at step 319, not at 400
        x0, x1 = (x_low, x_high) if x_high > x_low else (x_axis.ticks[0], x_axis.ticks[-1])
        return cls(x_axis, axis_for(low, high, y_kind), x0, x1)

    def px(self, x: float) -> float:
        return _L + (x - self.x0) / ((self.x1 - self.x0) or 1.0) * (_W - _L - _R)

    def py(self, y: float) -> float:
        y0, y1 = self.y_axis.ticks[0], self.y_axis.ticks[-1]
        return _T + _PLOT_H - (y - y0) / ((y1 - y0) or 1.0) * _PLOT_H

    def axes(self, x_label: str) -> list[str]:
        """Grid lines with the y ticks, the x ticks inside the data range, the x label and the frame."""
        slack = 1e-9 * abs(self.x1 - self.x0)
        x_ticks = [t for t in self.x_axis.ticks if self.x0 - slack <= t <= self.x1 + slack]
        out = [f'<line class="grid" x1="{_L}" x2="{_W - _R}" y1="{self.py(tick):.1f}" y2="{self.py(tick):.1f}"/>'
               f'<text class="tick" x="{_L - 6}" y="{self.py(tick) + 4:.1f}" text-anchor="end">'
               f'{html.escape(self.y_axis.label(tick))}</text>' for tick in self.y_axis.ticks]
        out += [f'<text class="tick" x="{self.px(tick):.1f}" y="{_H - _B + 15}" text-anchor="middle">'
                f'{html.escape(self.x_axis.label(tick))}</text>' for tick in x_ticks]
        out.append(f'<text class="axis" x="{_L + (_W - _L - _R) / 2:.0f}" y="{_H - 4}" text-anchor="middle">'
                   f'{html.escape(x_label)}</text>')
        out.append(f'<rect class="frame" x="{_L}" y="{_T}" width="{_W - _L - _R}" height="{_PLOT_H}"/>')
        return out

    def vertical_lines(self, markers: Sequence[tuple[float, str]],
                       run_starts: Sequence[tuple[float, str]]) -> list[str]:
        """Events (dashed, labelled on hover) and run starts (labelled) inside the x range."""
        out = [f'<line class="marker" x1="{self.px(x):.1f}" x2="{self.px(x):.1f}" y1="{_T}" y2="{_T + _PLOT_H}">'
               f'<title>{html.escape(label)}</title></line>'
               for x, label in list(markers)[:MAX_MARKERS] if self.x0 <= x <= self.x1]
        out += [f'<line class="run-start" x1="{self.px(x):.1f}" x2="{self.px(x):.1f}" y1="{_T}" y2="{_T + _PLOT_H}"/>'
                f'<text class="run-label" x="{self.px(x) + 3:.1f}" y="{_T + 11}">{html.escape(label)}</text>'
                for x, label in list(run_starts)[:MAX_MARKERS] if self.x0 <= x <= self.x1]
        return out

    def areas(self, stacked_lines: list[tuple[Series, list, list, list]]) -> list[str]:
        """Each series filled between its base and its top."""
        out = []
        for s, xs, top, base in stacked_lines:
            for seg_x, seg_top, seg_base in _stack_segments(xs, top, base):
                upper = " L".join(f"{self.px(x):.1f},{self.py(y):.1f}" for x, y in zip(seg_x, seg_top))
                lower = " L".join(f"{self.px(x):.1f},{self.py(y):.1f}"
                                  for x, y in zip(reversed(seg_x), reversed(seg_base)))
                out.append(f'<path class="series area" d="M{upper} L{lower} Z" fill="{s.color}" '
                           f'stroke="{s.color}"><title>{html.escape(s.name)}</title></path>')
        return out

    def lines(self, lines: list[tuple[Series, list[float | None], list[float | None]]]) -> list[str]:
        """Each series as a line; the first series (rank 0) on top: where lines agree it shows."""
        out = []
        for s, xs, ys in reversed(lines):
            d = _path(xs, ys, self.px, self.py)
            if d:
                dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
                out.append(f'<path class="series" d="{d}" fill="none" stroke="{s.color}" '
                           f'stroke-width="{s.width}"{dash}><title>{html.escape(s.name)}</title></path>')
        return out


def _stack_segments(xs: list, top: list, base: list) -> list[tuple[list[float], list[float], list[float]]]:
    out: list[tuple[list[float], list[float], list[float]]] = [([], [], [])]
    for x, t, b in zip(xs, top, base):
        if x is None or t is None or b is None:
            if out[-1][0]:
                out.append(([], [], []))
            continue
        out[-1][0].append(x)
        out[-1][1].append(t)
        out[-1][2].append(b)
    return [seg for seg in out if seg[0]]


def _path(xs: list[float | None], ys: list[float | None], px: Callable[[float], float],
          py: Callable[[float], float]) -> str:
    parts: list[str] = []
    pen_down = False
    for x, y in zip(xs, ys):
        if x is None or y is None:
            pen_down = False
            continue
        parts.append(f"{'L' if pen_down else 'M'}{px(x):.1f},{py(y):.1f}")
        pen_down = True
    if len(parts) == 1:  # a single point: draw a short tick so it is visible
        parts.append("h0.1")
    return " ".join(parts)
