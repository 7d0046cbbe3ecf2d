"""Per-layer loss as an SVG bar chart: hand-written SVG text, no plotting library.

One vertical bar per layer with a loss, in model order; each bar carries a ``<title>``
(the layer's name and loss) that browsers show as a tooltip. Names are written under the
bars when they fit (up to :data:`NAMED_BARS` bars), else each block's first bar is labelled.
Losses spanning :data:`LOG_SPAN` or more (max / smallest positive) are drawn on a log scale
unless a scale is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape as _html_escape
from typing import Literal

from layerwise.reports.text import Record, block_of, format_loss, loss_of


def escape(text: str) -> str:
    """``&``, ``<`` and ``>`` as entities (``html``'s escape; ``xml.sax.saxutils`` imports ``urllib.request``,
    ~30-60 ms of every CLI command's start, since ``report``'s parser reads this module's scales)."""
    return _html_escape(text, quote=False)


Scale = Literal["auto", "linear", "log"]
SCALES: tuple[str, ...] = ("auto", "linear", "log")
#: ``auto`` picks the log scale when the largest loss is this many times the smallest
LOG_SPAN = 100.0
#: at most this many bars get their own name label
NAMED_BARS = 64
_BAR, _GAP, _PLOT_HEIGHT, _LEFT, _TOP, _CHAR = 14, 3, 260, 78, 44, 6.2


def choose_scale(losses: Sequence[float], scale: Scale = "auto") -> Literal["linear", "log"]:
    """``linear`` or ``log``: what was asked, or for ``auto`` log when the losses span two decades."""
    if scale != "auto":
        return scale
    positive = [v for v in losses if v > 0]
    return "log" if positive and max(positive) / min(positive) >= LOG_SPAN else "linear"


def bar_heights(losses: Sequence[float], scale: Literal["linear", "log"],
                height: float = _PLOT_HEIGHT) -> tuple[list[float], float, float]:
    """Pixel heights of the bars, and the axis' low and high values (log: whole decades)."""
    top = max(losses, default=0.0)
    if top <= 0:
        return [0.0 for _ in losses], 0.0, 0.0
    if scale == "linear":
        return [max(0.0, v) / top * height for v in losses], 0.0, top
    positive = [v for v in losses if v > 0]
    low, high = math.floor(math.log10(min(positive))), math.ceil(math.log10(top))
    high = max(high, low + 1)
    return ([(math.log10(v) - low) / (high - low) * height if v > 0 else 0.0 for v in losses],
            10.0 ** low, 10.0 ** high)


def loss_svg(records: Sequence[Record], *, scale: Scale = "auto", title: str = "per-layer loss") -> str:
    """The SVG document (text) for the records that carry a numeric loss."""
    layers = [(str(r.get("name", "?")), loss) for r in records if (loss := loss_of(r)) is not None]
    used = choose_scale([loss for _, loss in layers], scale)
    heights, low, high = bar_heights([loss for _, loss in layers], used)
    labels = _labels([name for name, _ in layers])
    label_room = min(300.0, max((len(text) for text in labels.values()), default=0) * _CHAR + 12)
    heading = f"{title} ({used} scale, {len(layers)} layers)"
    width = max(_LEFT + max(1, len(layers)) * (_BAR + _GAP) + 20, _LEFT + len(heading) * _CHAR * 1.3)
    base = _TOP + _PLOT_HEIGHT
    total_height = base + label_room + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{total_height:.0f}" '
           f'viewBox="0 0 {width:.0f} {total_height:.0f}" font-family="sans-serif" font-size="11">',
           "<style>.bar{fill:#4472c4}.bar:hover{fill:#c0504d}.axis{stroke:#333}.grid{stroke:#ddd}</style>",
           f'<text x="{_LEFT}" y="20" font-size="14">{escape(heading)}</text>']
    out += _axis(low, high, used, width, base)
    for index, ((name, loss), bar_height) in enumerate(zip(layers, heights)):
        x = _LEFT + _GAP + index * (_BAR + _GAP)
        out.append(f'<rect class="bar" x="{x:.1f}" y="{base - bar_height:.2f}" width="{_BAR}" '
                   f'height="{bar_height:.2f}" data-loss="{loss!r}"><title>{escape(name)}: '
                   f'{format_loss(loss)}</title></rect>')
        if index in labels:
            cx = x + _BAR / 2 + 4
            out.append(f'<text x="{cx:.1f}" y="{base + 6}" text-anchor="end" '
                       f'transform="rotate(-90 {cx:.1f} {base + 6})">{escape(labels[index])}</text>')
    missing = sum(1 for r in records if "loss" in r and loss_of(r) is None)
    if missing:
        out.append(f'<text x="{_LEFT}" y="{total_height - 10:.0f}">{missing} layer(s) without a loss '
                   f'(rounded to nearest) are not drawn</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _labels(names: list[str]) -> dict[int, str]:
    """Bar index -> label: every name when few, else the first bar of each block."""
    if len(names) <= NAMED_BARS:
        return dict(enumerate(names))
    labels: dict[int, str] = {}
    previous = None
    for index, name in enumerate(names):
        block = block_of(name)
        if block != previous:
            stack, number = block
            labels[index] = stack if number is None else f"{stack}.{number}"
            previous = block
    return labels


def _axis(low: float, high: float, scale: str, width: float, base: float) -> list[str]:
    lines = [f'<line class="axis" x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{base}"/>',
             f'<line class="axis" x1="{_LEFT}" y1="{base}" x2="{width - 10:.0f}" y2="{base}"/>']
    if high <= 0:
        return lines
    if scale == "log":
        decades = range(round(math.log10(low)), round(math.log10(high)) + 1)
        ticks = [(10.0 ** d, (d - math.log10(low)) / (math.log10(high) - math.log10(low))) for d in decades]
    else:
        ticks = [(high * k / 4, k / 4) for k in range(5)]
    for value, fraction in ticks:
        y = base - fraction * _PLOT_HEIGHT
        lines.append(f'<line class="grid" x1="{_LEFT}" y1="{y:.1f}" x2="{width - 10:.0f}" y2="{y:.1f}"/>')
        lines.append(f'<text x="{_LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">{format_loss(value)}</text>')
    return lines
