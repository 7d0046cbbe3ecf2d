"""Per-layer error as text: a bar chart that fits a terminal, the worst layers, and a table.

A run's per-layer records (``CompressionReport.layer_log``; GPTQ writes ``name``, ``loss``,
``seconds``, ``samples``) can number in the hundreds. The chart stays short whatever the model:

- up to ``max_rows`` layers: one row per layer;
- more: one row per block -- the name up to its first numeric part (``model.layers.3``), whose
  value is the sum of its layers' losses;
- more blocks than rows: consecutive blocks of one stack share a row (``model.layers.0-4``).

The worst individual layers are always named below the bars, so aggregation never hides them.
Bars are drawn with eighth blocks (``▏``..``█``), or ``#`` where the stream cannot print those.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

#: eighths of a cell, from one eighth to a full block
EIGHTHS = "▏▎▍▌▋▊▉█"
#: rows of bars in the compress summary (the chart adds a title and a 'worst' line)
DEFAULT_ROWS = 16
#: cells of the longest bar
DEFAULT_WIDTH = 24
#: labels longer than this are shortened from the left (the end of a name says most)
LABEL_WIDTH = 34

Record = dict[str, Any]


@dataclass(frozen=True)
class ChartRow:
    """One bar: its label, its value, and how many layers it sums."""

    label: str
    value: float
    layers: int


def supports_blocks(stream: TextIO) -> bool:
    """Whether ``stream`` can print the eighth-block characters (else charts fall back to ASCII)."""
    encoding = getattr(stream, "encoding", None)
    if not encoding:
        return False
    try:
        (EIGHTHS + "…").encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def block_of(name: str) -> tuple[str, int | None]:
    """``(stack, index)`` of the block holding layer ``name``: ``model.layers.3.mlp.up_proj`` -> ``('model.layers', 3)``.

    A name with no numeric part is its own block: ``('lm_head', None)``.
    """
    parts = name.split(".")
    for position, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:position]), int(part)
    return name, None


def chart_rows(records: Sequence[Record], max_rows: int = DEFAULT_ROWS) -> tuple[list[ChartRow], str]:
    """The bars for ``records`` (those with a loss), in model order, and what one row stands for."""
    layers = [(str(r.get("name", "?")), loss) for r in records if (loss := loss_of(r)) is not None]
    if len(layers) <= max_rows:
        return [ChartRow(name, loss, 1) for name, loss in layers], "layer"
    blocks: dict[tuple[str, int | None], list[float]] = {}
    for name, loss in layers:
        blocks.setdefault(block_of(name), []).append(loss)
    keys = list(blocks)
    per_row = 1
    while True:
        groups = _group_consecutive(keys, per_row)
        if len(groups) <= max_rows or per_row >= len(keys):
            break
        per_row += 1
    rows = [ChartRow(_group_label(group), sum(sum(blocks[k]) for k in group), sum(len(blocks[k]) for k in group))
            for group in groups]
    return rows, "block" if per_row == 1 else f"{per_row} blocks"


def _group_consecutive(keys: list[tuple[str, int | None]], size: int) -> list[list[tuple[str, int | None]]]:
    """Runs of up to ``size`` consecutive numbered blocks of one stack; unnumbered blocks stand alone."""
    groups: list[list[tuple[str, int | None]]] = []
    for key in keys:
        last = groups[-1] if groups else None
        if (last and len(last) < size and key[1] is not None and last[-1][1] is not None
                and last[-1][0] == key[0]):
            last.append(key)
        else:
            groups.append([key])
    return groups


def _group_label(group: list[tuple[str, int | None]]) -> str:
    stack, first = group[0]
    if first is None:
        return stack
    last = group[-1][1]
    return f"{stack}.{first}" if last == first else f"{stack}.{first}-{last}"


def bar(value: float, top: float, width: int = DEFAULT_WIDTH, ascii_only: bool = False) -> str:
    """A bar of ``value / top * width`` cells; anything above zero shows at least a sliver."""
    if top <= 0 or value <= 0:
        return ""
    if ascii_only:
        return "#" * max(1, round(value / top * width))
    eighths = max(1, round(value / top * width * 8))
    full, rest = divmod(eighths, 8)
    return EIGHTHS[-1] * full + (EIGHTHS[rest - 1] if rest else "")


def worst_layers(records: Sequence[Record], count: int = 3) -> list[tuple[str, float]]:
    """The ``count`` layers with the highest loss, highest first (ties keep model order)."""
    layers = [(str(r.get("name", "?")), loss) for r in records if (loss := loss_of(r)) is not None]
    return sorted(layers, key=lambda item: -item[1])[:count]


def format_loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2e}"


def loss_chart(records: Sequence[Record], *, max_rows: int = DEFAULT_ROWS, width: int = DEFAULT_WIDTH,
               ascii_only: bool = False, worst: int = 3) -> list[str]:
    """The chart's lines: a title, one bar per row, the ``worst`` layers (one a line, worst
    first), and any layer without a loss. Empty when no record has a loss.
    """
    rows, unit = chart_rows(records, max_rows)
    if not rows:
        return []
    modifiers = sorted({str(r["modifier"]) for r in records if r.get("modifier")})
    title = f"{'/'.join(modifiers) or 'per-layer'} loss per {unit}"
    if unit != "layer":
        title += f" (sum over its layers; {sum(row.layers for row in rows)} layers)"
    lines = [title + ":"]
    label_width = min(LABEL_WIDTH, max(len(row.label) for row in rows))
    top = max(row.value for row in rows)
    for row in rows:
        label = _shorten(row.label, label_width, ascii_only)
        lines.append(f"  {label:<{label_width}}  {bar(row.value, top, width, ascii_only):<{width}}  "
                     f"{format_loss(row.value)}")
    named = worst_layers(records, worst)
    name_width = max(len(name) for name, _ in named)
    for position, (name, loss) in enumerate(named):
        lead = "worst:" if position == 0 else ""
        lines.append(f"  {lead:<7}{name:<{name_width}}  {format_loss(loss)}")
    missing = [str(r.get("name", "?")) for r in records if "loss" in r and loss_of(r) is None]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        lines.append(f"  no loss (rounded to nearest): {shown}")
    return lines


def _shorten(label: str, width: int, ascii_only: bool) -> str:
    if len(label) <= width:
        return label
    ellipsis = "..." if ascii_only else "…"
    return ellipsis + label[len(label) - width + len(ellipsis):]


def layer_table(records: Sequence[Record], top: int | None = None) -> list[str]:
    """One line per layer (layer, method, loss, seconds, tokens): all in model order, or the ``top`` worst.

    ``tokens`` are the calibration tokens the layer's statistics were gathered on (summaries written
    before 0.1.0 called them ``samples``).
    """
    rows = list(records)
    if top is not None:
        rows = sorted(rows, key=lambda r: -(loss_of(r) if loss_of(r) is not None else -math.inf))[:top]
    if not rows:
        return []
    width = max(len("layer"), *(len(str(r.get("name", "?"))) for r in rows))
    lines = [f"{'layer':<{width}}  {'method':<6}  {'loss':>9}  {'time':>8}  {'tokens':>7}"]
    for r in rows:
        seconds = r.get("seconds")
        time_text = f"{seconds:.3f} s" if isinstance(seconds, (int, float)) else "n/a"
        lines.append(f"{r.get('name', '?')!s:<{width}}  {r.get('method', '')!s:<6}  "
                     f"{format_loss(loss_of(r)):>9}  {time_text:>8}  {r.get('tokens', r.get('samples', ''))!s:>7}")
    return lines


def loss_of(record: Record) -> float | None:
    """The record's loss as a float, or ``None`` when it has none (or NaN, inf, a non-number)."""
    value = record.get("loss")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def size_text(bytes_before: int, bytes_after: int) -> str:
    """``52.5 MiB -> 29.7 MiB (1.77x smaller)``."""
    ratio = bytes_before / max(bytes_after, 1)
    return f"{bytes_before / 2**20:.1f} MiB -> {bytes_after / 2**20:.1f} MiB ({ratio:.2f}x smaller)"


def run_notes(fallbacks: Sequence[str], guards_retraced: Sequence[str], always: bool = False) -> list[str]:
    """Lines for the pipelines that fell back and the trace guards that made a re-trace.

    Nothing when both are empty, unless ``always`` (the saved report says 'none').
    """
    lines = []
    for title, items in (("fallbacks:", fallbacks), ("guards re-traced:", guards_retraced)):
        if items or always:
            lines.append(f"{title:<20}{items[0] if items else 'none'}")
            lines.extend(f"{'':<20}{item}" for item in items[1:])
    return lines


def time_text(seconds: float, accounting: Mapping[str, Mapping[str, Any]]) -> str:
    """``41.3 s (forward 20.1 s, GPTQ Hessians 4.2 s at 171 GFLOP/s, ..., other 5.0 s)``.

    Where the time went, from the run's accounting; just the seconds when nothing was timed.
    """
    timed = [(phase, work) for phase, work in accounting.items() if work.get("seconds")]
    if not timed:
        return f"{seconds:.1f} s"
    parts = []
    for phase, work in timed:
        rate = work.get("gflops_per_second")
        parts.append(f"{phase} {work['seconds']:.1f} s" + (f" at {rate:.0f} GFLOP/s" if rate else ""))
    other = seconds - sum(work["seconds"] for _, work in timed)
    return f"{seconds:.1f} s ({', '.join(parts)}, other {max(other, 0.0):.1f} s)"


def skipped_lines(skipped_non_finite: Sequence[str]) -> list[str]:
    """The modules left uncompressed for NaN/inf weights (``non_finite="skip"``); nothing when none."""
    if not skipped_non_finite:
        return []
    return [f"{'left uncompressed:':<20}{len(skipped_non_finite)} with NaN/inf weights "
            f"({', '.join(skipped_non_finite)})"]


def memory_text(report: Any) -> str:
    """``weights stream (...), peak RSS 1.52 GiB`` (and the GPU's peak allocation when one ran)."""
    parts = [f"weights {report.weights}", f"activations {report.activations}",
             f"peak RSS {report.peak_rss_bytes / 2**30:.2f} GiB"]
    if report.peak_gpu_bytes is not None:
        parts.append(f"peak GPU {report.peak_gpu_bytes / 2**30:.2f} GiB")
    if getattr(report, "cache_peak_bytes", 0):
        parts.append(f"cached activations at most {report.cache_peak_bytes / 2**30:.2f} GiB")
    return ", ".join(parts)


def summary_text(report: Any, ascii_only: bool = True) -> str:
    """The run summary ``layerwise compress`` prints (and ``str(model.layerwise_report)`` gives)."""
    lines = [f"pipeline:           {report.pipeline}", *run_notes(report.fallbacks, report.guards_retraced),
             f"modifiers:          {', '.join(report.modifiers)}"]
    if getattr(report, "ranks", 1) > 1:
        lines.insert(0, f"ranks:              {report.ranks} (data-parallel; rank 0 wrote the output)")
    if report.targets_found and report.pipeline in ("sequential", "layer_sequential"):
        lines.append(f"targets:            {report.targets_found}")
    if report.pieces:
        lines.append(f"pieces:             {report.pieces}")
    if getattr(report, "placement", ""):
        lines.append(f"placement:          {report.placement}")
    if getattr(report, "resumed_from_piece", None):
        where = ("after the last piece (only the output was written again)"
                 if getattr(report, "resumed_after_last_piece", False) else f"from piece {report.resumed_from_piece}")
        lines.append(f"resumed:            {where} (an interrupted run's checkpoint; "
                     f"time and size count the whole run)")
    lines.append(f"modules compressed: {len(report.compressed_modules)}")
    lines += [f"{'note:':<20}{note}" for note in getattr(report, "notes", ())]
    lines += skipped_lines(report.skipped_non_finite)
    lines += [f"calibration:        {report.calibration_samples} samples",
              f"time:               {time_text(report.seconds, report.accounting)}",
              f"size:               {size_text(report.bytes_before, report.bytes_after)}",
              f"memory:             {memory_text(report)}"]
    if report.output_dir:
        lines.append(f"saved to:           {report.output_dir}  (details: layerwise report {report.output_dir})")
    chart = loss_chart(report.layer_log, ascii_only=ascii_only)
    if chart:
        lines += ["", *chart]
    return "\n".join(lines)
