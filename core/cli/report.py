"""``layerwise report OUT_DIR``: read a run's saved summary and show it.

Prints a header (model, recipe, pipeline, fallbacks, guards re-traced, time, size), the
per-layer table and the loss chart, and the report card when the folder was evaluated; ``--json`` prints the saved summary as it is, ``--svg FILE``
also writes the per-layer loss as an SVG bar chart, to a new file only (never over one). A folder without a readable summary is a
:class:`~layerwise.reports.run_summary.SummaryError` (exit status 2, one line that says the fix).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from layerwise.reports.run_summary import SUMMARY_FILE, RunSummary, read_summary
from layerwise.reports.text import (
    layer_table,
    loss_chart,
    memory_text,
    run_notes,
    size_text,
    skipped_lines,
    supports_blocks,
    time_text,
)

if TYPE_CHECKING:
    from layerwise.reports.svg import Scale


def add_parser(sub: argparse._SubParsersAction) -> None:
    from layerwise.reports.svg import SCALES

    p = sub.add_parser("report", help="show the saved summary of a compress run: per-layer loss, time, pipeline",
                       description=f"Show the run summary ({SUMMARY_FILE}) that `layerwise compress --output-dir` "
                                   f"saves: the model, recipe and pipeline (with any fallbacks), time and size, "
                                   f"a per-layer table and a chart of the per-layer loss.")
    p.add_argument("output_dir", metavar="OUT_DIR", help="the output folder of a compress run")
    p.add_argument("--json", action="store_true", help="print the saved summary as JSON, unchanged")
    p.add_argument("--svg", metavar="FILE", help="also write the per-layer loss as an SVG bar chart")
    p.add_argument("--scale", choices=SCALES, default="auto",
                   help="SVG loss axis (default auto: log when losses span two decades or more)")
    p.add_argument("--top", type=int, metavar="N", help="list only the N layers with the highest loss")
    p.add_argument("--ascii", action="store_true", help="draw the chart with '#' instead of block characters")
    p.set_defaults(func=run)


def header_lines(summary: RunSummary) -> list[str]:
    """The run at a glance: what was compressed, how, with what, and what it gave."""
    report = summary.report
    versions = summary.environment.get("versions") or {}
    libraries = ", ".join(f"{name} {versions[name]}" for name in ("torch", "transformers") if versions.get(name))
    lines = [f"{'model:':<20}{report.model or 'unknown'}",
             f"{'modifiers:':<20}{', '.join(report.modifiers) or 'none'}",
             f"{'pipeline:':<20}{report.pipeline}",
             *run_notes(report.fallbacks, report.guards_retraced, always=True),
             f"{'targets:':<20}{report.targets_found or ', '.join(report.sequential_targets) or 'none'}",
             *([f"{'pieces:':<20}{report.pieces}"] if report.pieces else []),
             f"{'modules compressed:':<20}{len(report.compressed_modules)}",
             *skipped_lines(report.skipped_non_finite),
             f"{'calibration:':<20}{report.calibration_samples} samples",
             f"{'time:':<20}{time_text(report.seconds, report.accounting)} (up to saving)",
             f"{'size:':<20}{size_text(report.bytes_before, report.bytes_after)}",
             *([f"{'memory:':<20}{memory_text(report)}"] if report.peak_rss_bytes else []),
             f"{'versions:':<20}layerwise {summary.layerwise_version}" + (f", {libraries}" if libraries else "")]
    if report.recipe.strip():
        lines.append("recipe:")
        lines.extend(f"  {line}" for line in report.recipe.rstrip().splitlines())
    return lines


def run(args: argparse.Namespace) -> int:
    summary = read_summary(args.output_dir)
    if args.svg:  # first: a path that cannot be written is an error before any output
        _write_svg(summary, args.svg, args.scale)
    if args.json:
        assert summary.path is not None
        print(summary.path.read_text(encoding="utf-8"), end="")
    else:
        print(f"run summary: {summary.path}")
        print("\n".join(header_lines(summary)))
        records = summary.report.layer_log
        table = layer_table(records, top=args.top)
        if table:
            print()
            print("\n".join(table))
        chart = loss_chart(records, ascii_only=args.ascii or not supports_blocks(sys.stdout))
        if chart:
            print()
            print("\n".join(chart))
        elif not records:
            print("\nno per-layer log: the modifiers of this recipe record none (round-to-nearest needs no data)")
        _print_quality(summary, ascii_only=args.ascii or not supports_blocks(sys.stdout))
    if args.svg:
        # after --json, stdout holds only the JSON
        print(f"SVG chart written to {args.svg}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _print_quality(summary: RunSummary, ascii_only: bool) -> None:
    """The report card, when the folder was evaluated (``layerwise eval`` / ``compress --eval``)."""
    quality = summary.report.quality
    if not quality:
        print(f"\nno report card: `layerwise eval ORIGINAL {summary.path.parent if summary.path else 'OUT_DIR'} "
              f"--dataset FILE` measures what the compression lost")
        return
    from layerwise.reports.quality_text import kl_charts, quality_lines

    print("\nreport card (layerwise eval):")
    print("\n".join(quality_lines(quality)))
    charts = kl_charts(quality, ascii_only=ascii_only)
    if charts:
        print()
        print("\n".join(charts))


def _write_svg(summary: RunSummary, path: str, scale: Scale) -> None:
    """The loss chart into a new file: never over one, the folder's own files included (its weights, its summary)."""
    from layerwise.model_io.output_file import write_output_file
    from layerwise.reports.svg import loss_svg

    title = f"{'/'.join(summary.report.modifiers) or 'per-layer'} loss, {summary.report.model or 'model'}"
    write_output_file(Path(path).expanduser(), loss_svg(summary.report.layer_log, scale=scale, title=title),
                      "the SVG chart")  # checked there first: never over a file
