"""The KL divergence of a report card as an SVG picture: hand-written SVG text, no plotting library.

Two panels, one above the other: a bar per evaluation window (the mean KL of its tokens; a window far
above the rest is text the compressed model handles worst), and a line over the positions in a window
(the mean KL at each position over the windows: whether the loss grows with the context). Every bar
and point carries a ``<title>`` that browsers show as a tooltip. Reads the saved (dict) form of a
:class:`~layerwise.reports.quality.QualityReport`, so no torch is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from xml.sax.saxutils import escape

from layerwise.reports.quality_text import as_document

_WIDTH, _PANEL, _LEFT, _TOP, _GAP = 720, 180, 78, 60, 70


def kl_svg(quality: Any, title: str = "KL divergence from the original") -> str:
    """The SVG document (text); a short note instead of panels when the card has no token metrics."""
    tokens = as_document(quality).get("tokens") or {}
    windows = [float(v) for v in tokens.get("kl_per_window") or []]
    positions = [float(v) for v in tokens.get("kl_per_position") or []]
    height = _TOP + 2 * _PANEL + _GAP + 50
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
           f'viewBox="0 0 {_WIDTH} {height}" font-family="sans-serif" font-size="11">',
           "<style>.bar{fill:#4472c4}.bar:hover{fill:#c0504d}.line{fill:none;stroke:#4472c4;stroke-width:1.5}"
           ".axis{stroke:#333}.grid{stroke:#ddd}</style>",
           f'<text x="{_LEFT}" y="20" font-size="14">{escape(title)} (nats per token)</text>']
    if not windows:
        out += [f'<text x="{_LEFT}" y="{_TOP + 20}">no token metrics: this card compares embeddings only</text>',
                "</svg>"]
        return "\n".join(out) + "\n"
    out += _window_panel(windows, _TOP)
    out += _position_panel(positions, _TOP + _PANEL + _GAP)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _window_panel(values: Sequence[float], top: float) -> list[str]:
    base = top + _PANEL
    high = max(max(values), 1e-12)
    span = _WIDTH - _LEFT - 20
    step = span / len(values)
    out = _axes(top, base, high, f"mean KL per window ({len(values)} windows)")
    for index, value in enumerate(values):
        height = max(value, 0.0) / high * _PANEL
        out.append(f'<rect class="bar" x="{_LEFT + index * step:.2f}" y="{base - height:.2f}" '
                   f'width="{max(step * 0.85, 0.5):.2f}" height="{height:.2f}" data-kl="{value!r}">'
                   f'<title>window {index}: {value:.3e}</title></rect>')
    out.append(f'<text x="{_LEFT + span / 2:.0f}" y="{base + 16}" text-anchor="middle">window</text>')
    return out


def _position_panel(values: Sequence[float], top: float) -> list[str]:
    base = top + _PANEL
    scored = [(position, value) for position, value in enumerate(values) if value > 0]
    high = max((value for _, value in scored), default=1e-12)
    span = _WIDTH - _LEFT - 20
    last = max(len(values) - 1, 1)
    out = _axes(top, base, high, "mean KL by position in the window (over the windows)")
    points = [(_LEFT + position / last * span, base - value / high * _PANEL) for position, value in scored]
    if points:
        out.append('<polyline class="line" points="' + " ".join(f"{x:.1f},{y:.1f}" for x, y in points) + '"/>')
    for (x, y), (position, value) in zip(points, scored):
        out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="1.5" fill="#4472c4"><title>position {position}: '
                   f"{value:.3e}</title></circle>")
    out.append(f'<text x="{_LEFT + span / 2:.0f}" y="{base + 16}" text-anchor="middle">position (token) '
               f"0-{len(values) - 1}</text>")
    return out


def _axes(top: float, base: float, high: float, heading: str) -> list[str]:
    out = [f'<text x="{_LEFT}" y="{top - 8:.0f}">{escape(heading)}</text>',
           f'<line class="axis" x1="{_LEFT}" y1="{top}" x2="{_LEFT}" y2="{base}"/>',
           f'<line class="axis" x1="{_LEFT}" y1="{base}" x2="{_WIDTH - 10}" y2="{base}"/>']
    for k in range(5):
        y = base - k / 4 * _PANEL
        out.append(f'<line class="grid" x1="{_LEFT}" y1="{y:.1f}" x2="{_WIDTH - 10}" y2="{y:.1f}"/>')
        out.append(f'<text x="{_LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">{high * k / 4:.2e}</text>')
    return out
