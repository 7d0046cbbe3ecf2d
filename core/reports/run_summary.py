"""``layerwise_summary.json``: a run's report, saved with the model so it can be read later.

``compress()`` writes it into the output folder through the saver's atomic write, so a
folder has it exactly when the folder is complete. The file is one JSON object:

- ``summary_format`` (an integer, :data:`FORMAT_VERSION`) and ``layerwise_version``;
- ``environment``: what ``layerwise env --json`` prints (versions, Python, accelerator);
- every field of :class:`~layerwise.reports.run_report.CompressionReport` under its own name:
  ``model``, ``recipe`` (YAML), ``pipeline``, ``fallbacks``, ``guards_retraced``,
  ``sequential_targets``, ``modifiers``, ``compressed_modules``, ``calibration_samples``,
  ``bytes_before``, ``bytes_after``, ``layer_log`` (the per-layer records, e.g. GPTQ's
  ``name``, ``method``, ``loss``, ``seconds``, ``tokens``: calibration tokens) and ``seconds``, which counts
  the run up to the start of saving (the file is written while saving);
- optional, absent from older files: ``calibration_data`` (``description``, ``sha256``) and
  ``quality``, the report card of ``layerwise eval`` / ``compress --eval``
  (:class:`~layerwise.reports.quality.QualityReport` as a dict), added by :func:`record_quality`.

:func:`read_summary` reads it back into a :class:`RunSummary`; unknown keys (a newer
layerwise) are ignored, missing ones are an error that says which.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerwise.errors import LayerwiseError
from layerwise.reports.run_report import CompressionReport

SUMMARY_FILE = "layerwise_summary.json"
#: bumped when a key changes meaning; readers accept this version and older ones
FORMAT_VERSION = 1


class SummaryError(LayerwiseError):
    """A saved run summary that is missing, unreadable or not a layerwise summary."""


@dataclass(frozen=True)
class RunSummary:
    """A saved run: its report, the environment it ran in, and where it was read from."""

    report: CompressionReport
    environment: dict[str, Any]
    layerwise_version: str
    path: Path | None = None


def summary_json(report: CompressionReport, environment: dict[str, Any] | None = None) -> str:
    """The file's text for ``report``; ``environment`` defaults to the running one."""
    from layerwise import __version__
    from layerwise.host.versions import environment as current_environment

    document = {"summary_format": FORMAT_VERSION, "layerwise_version": __version__,
                "environment": environment if environment is not None else current_environment(),
                **dataclasses.asdict(report)}
    return json.dumps(document, indent=1, default=str) + "\n"


def read_summary(folder: str | os.PathLike) -> RunSummary:
    """The summary saved in ``folder`` (an output folder of ``compress()``); raises :class:`SummaryError`."""
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise SummaryError(f"folder '{folder}' does not exist; pass the output folder of a "
                           f"`layerwise compress --output-dir ...` run")
    if not folder.is_dir():
        raise SummaryError(f"'{folder}' is a file, not a folder; pass the output folder of a "
                           f"`layerwise compress --output-dir ...` run")
    path = folder / SUMMARY_FILE
    if not path.is_file():
        hint = ("it holds a saved model, written by a layerwise older than the run summary or by another tool"
                if (folder / "config.json").is_file() else "it is not a layerwise output folder")
        raise SummaryError(f"no {SUMMARY_FILE} in '{folder}': {hint}. Compress the model again with "
                           f"`layerwise compress --output-dir ...` to get a report")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SummaryError(f"'{path}' is not valid JSON ({exc}); the file was damaged after it was written: "
                           f"compress the model again, or restore the file from a copy") from None
    return summary_from_document(document, path)


def record_quality(folder: str | os.PathLike, quality: dict[str, Any]) -> Path:
    """Put ``quality`` into the summary saved in ``folder`` (replacing an earlier one); returns its path.

    The file is rewritten whole through a temporary file and a rename: a reader sees the old or
    the new summary, never half of one. Every other key stays as it was.
    """
    summary = read_summary(folder)  # a folder without a readable summary is a SummaryError
    assert summary.path is not None
    document = json.loads(summary.path.read_text(encoding="utf-8"))
    document["quality"] = quality
    temporary = summary.path.with_name(f".{SUMMARY_FILE}.{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(document, indent=1, default=str) + "\n", encoding="utf-8")
        os.replace(temporary, summary.path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise SummaryError(f"cannot update '{summary.path}': {exc.strerror or exc}; make the folder writable, "
                           f"or pass --no-record to leave it as it is") from None
    return summary.path


def summary_from_document(document: Any, path: Path | None = None) -> RunSummary:
    """A :class:`RunSummary` from the parsed JSON; ``path`` only names the file in errors."""
    where = f"'{path}'" if path else "the summary"
    if not isinstance(document, dict) or not isinstance(document.get("summary_format"), int):
        raise SummaryError(f"{where} is not a layerwise run summary (no 'summary_format' key); "
                           f"pass the output folder of a `layerwise compress --output-dir ...` run")
    if document["summary_format"] > FORMAT_VERSION:
        raise SummaryError(f"{where} has summary format {document['summary_format']}, newer than this "
                           f"layerwise reads ({FORMAT_VERSION}); upgrade layerwise")
    fields = {f.name: f for f in dataclasses.fields(CompressionReport)}
    required = [name for name, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in document]
    if missing:
        raise SummaryError(f"{where} lacks {', '.join(missing)}: it was cut short or edited; "
                           f"compress the model again to rewrite it")
    report = CompressionReport(**{name: document[name] for name in fields if name in document})
    return RunSummary(report=report, environment=dict(document.get("environment") or {}),
                      layerwise_version=str(document.get("layerwise_version", "unknown")), path=path)
