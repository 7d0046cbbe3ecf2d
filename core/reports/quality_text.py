"""The report card as terminal text: the metrics, and the KL divergence per window and per position.

Works on the saved form of a :class:`~layerwise.reports.quality.QualityReport` (its ``to_dict()``, as
``layerwise_summary.json`` holds it), so ``layerwise report`` shows it without importing torch. The
charts use :mod:`layerwise.reports.text`'s bars (``#`` where the terminal cannot print blocks) and stay
at most ``max_rows`` rows long: consecutive windows (positions) share a row, which shows their mean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from layerwise.reports.text import DEFAULT_ROWS, DEFAULT_WIDTH, bar

Quality = Mapping[str, Any]


def as_document(quality: Any) -> dict[str, Any]:
    """The saved (dict) form of a ``QualityReport``, or the dict itself."""
    return quality.to_dict() if hasattr(quality, "to_dict") else dict(quality)


def quality_lines(quality: Any) -> list[str]:
    """The metrics, one per line, labelled like the compress summary."""
    q = as_document(quality)
    data = q.get("data") or {}
    lines = []
    if q.get("original") or q.get("compressed"):
        lines.append(_line("compared:", f"{q.get('original') or 'original'} -> {q.get('compressed') or 'compressed'}"))
    lines.append(_line("evaluated as:", f"{q.get('kind')} on {q.get('device')}, {q.get('placement')}, "
                                        f"{q.get('seconds', 0.0):.1f} s"))
    lines.append(_line("eval data:", f"{data.get('description')}, sha256 {data.get('sha256')}"))
    tokens = q.get("tokens")
    if tokens:
        lines.append(_line("windows:", window_text(data)))
        before, after = tokens["perplexity_original"], tokens["perplexity_compressed"]
        lines.append(_line("perplexity:", f"{before:.4f} original, {after:.4f} compressed "
                                          f"({(after / before - 1) * 100:+.2f} %)"))
        lines.append(_line("KL divergence:", f"mean {tokens['kl_mean']:.3e}, median {tokens['kl_median']:.3e}, "
                                             f"p99 {tokens['kl_p99']:.3e}, max {tokens['kl_max']:.3e} "
                                             f"(nats per token)"))
        lines.append(_line("top-1 agreement:", f"{tokens['top1_agreement']:.4f}"))
        lines.append(_line("top-5 agreement:", f"{tokens['top5_agreement']:.4f}"))
    embeddings = q.get("embeddings")
    if embeddings:
        lines.append(_line("embedding cosine:", f"{embeddings['mean_cosine']:.4f} (nearest-neighbour agreement "
                                                f"{embeddings['nearest_neighbour_agreement']:.3f}, "
                                                f"{embeddings['sentences']} texts)"))
    for task, runs in (q.get("tasks") or {}).items():
        lines.append(_line(f"task {task}:", task_text(runs)))
    return lines


def window_text(data: Mapping[str, Any]) -> str:
    """``128 windows of 512 tokens, stride 512: 65,408 tokens scored``."""
    return (f"{data.get('windows')} windows of {data.get('window_length')} tokens, stride {data.get('stride')}: "
            f"{data.get('tokens', 0):,} tokens scored")


def task_text(runs: Mapping[str, Mapping[str, float]]) -> str:
    """``acc 0.4512 -> 0.4498, acc_norm ...``: each metric of the original and the compressed model."""
    original, compressed = runs.get("original") or {}, runs.get("compressed") or {}
    metrics = [m for m in compressed if "stderr" not in m] or [m for m in original if "stderr" not in m]
    return ", ".join(f"{m} {_number(original.get(m))} -> {_number(compressed.get(m))}" for m in metrics) or "no metric"


def kl_charts(quality: Any, *, max_rows: int = DEFAULT_ROWS, width: int = DEFAULT_WIDTH,
              ascii_only: bool = False) -> list[str]:
    """Two bar charts: the mean KL per window, and per position in the window. Empty without token metrics."""
    tokens = as_document(quality).get("tokens")
    if not tokens:
        return []
    windows = list(tokens.get("kl_per_window") or [])
    positions = list(tokens.get("kl_per_position") or [])
    first = next((i for i, v in enumerate(positions) if v > 0), len(positions))  # unscored positions lead
    lines = chart(windows, "window", "KL divergence per window (mean over its tokens)", max_rows, width, ascii_only)
    lines += chart(positions[first:], "position", "KL divergence by position in the window (mean over windows)",
                   max_rows, width, ascii_only, offset=first)
    return lines


def chart(values: Sequence[float], unit: str, title: str, max_rows: int = DEFAULT_ROWS,
          width: int = DEFAULT_WIDTH, ascii_only: bool = False, offset: int = 0) -> list[str]:
    """``values`` as at most ``max_rows`` bars, consecutive values sharing a row (their mean)."""
    if not values:
        return []
    per_row = -(-len(values) // max_rows)
    rows = []
    for begin in range(0, len(values), per_row):
        group = values[begin:begin + per_row]
        end = begin + len(group) - 1
        label = f"{unit} {begin + offset}" if end == begin else f"{unit}s {begin + offset}-{end + offset}"
        rows.append((label, sum(group) / len(group)))
    top = max(value for _, value in rows)
    label_width = max(len(label) for label, _ in rows)
    lines = [f"{title}, {len(values)} {unit}s" + (f", {per_row} a row:" if per_row > 1 else ":")]
    lines += [f"  {label:<{label_width}}  {bar(value, top, width, ascii_only):<{width}}  {value:.2e}"
              for label, value in rows]
    return lines


def _line(label: str, text: str) -> str:
    return f"{label:<20}{text}"


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
