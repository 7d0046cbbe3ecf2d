"""The support matrix: the plugin kit run on every installed model patch, one row per tiny model.

``layerwise plugins --check`` prints it; GUIDE.md pastes it (``docs/refresh_guide.py``). Each
patch brings its own tiny models (``ModelPatch.tiny_models``) and sample inputs, so a third-party
patch is checked exactly as the zoo's are; a patch without tiny models is listed as unchecked.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from layerwise.common.quiet import without_progress_bars
from layerwise.host.model_patch import ModelPatch
from layerwise.host.plugin_manager import PluginHost

#: the matrix's check columns, in the order the kit runs them
COLUMNS = ("ignore", "targets", "opaque", "mappings", "rotation", "trace", "RTN", "GPTQ", "reload")
MARKS = {"passed": "✔", "failed": "✘", "skipped": "·", "": "·"}


@dataclass
class MatrixRow:
    """One tiny model of one patch through the kit."""

    patch: str
    distribution: str
    version: str
    model: str                 # the tiny-model builder's name
    architecture: str = ""     # the built model's class
    modalities: list[str] = field(default_factory=list)
    transformers: str = ""
    checks: dict[str, str] = field(default_factory=dict)  # column -> passed | failed | skipped
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures and bool(self.checks) and all(v == "passed" for v in self.checks.values())


def installed_patches(host: PluginHost | None = None) -> list[tuple[ModelPatch, str, str]]:
    """Every registered model patch with the distribution and version that registered it."""
    with warnings.catch_warnings():  # broken plugins are `layerwise plugins`' business
        warnings.simplefilter("ignore", RuntimeWarning)
        host = host or PluginHost(strict=False)
        host.survey()  # fills each plugin's registered objects
    found = []
    for info in host.plugins.values():
        for patch in info.objects.get("model_patches", {}).values():
            found.append((patch, info.distribution or "", info.version or ""))
    return sorted(found, key=lambda item: item[0].name)


def check_patches(names: Sequence[str] = (), host: PluginHost | None = None) -> list[MatrixRow]:
    """Run the kit on the installed patches named (by patch, plugin distribution; all when empty)."""
    import transformers

    patches = installed_patches(host)
    wanted = set(names)
    if wanted:
        known = {n for patch, dist, _ in patches for n in (patch.name, dist)}
        if wanted - known:
            from layerwise.errors import UnknownNameError

            raise UnknownNameError("model patch", min(wanted - known), sorted(known))
        patches = [item for item in patches if wanted & {item[0].name, item[1]}]
    rows = []
    for patch, distribution, version in patches:
        if not patch.tiny_models:
            rows.append(MatrixRow(patch.name, distribution, version, "(none)", transformers=transformers.__version__,
                                  failures=["the patch lists no tiny_models, so nothing can be checked: give it "
                                            "builders of seeded tiny models (GUIDE.md, 'Checking a patch')"]))
        for build in patch.tiny_models:
            rows.append(_check_one(patch, build, distribution, version, transformers.__version__))
    return rows


def _check_one(patch: ModelPatch, build: Any, distribution: str, version: str, transformers_version: str) -> MatrixRow:
    from layerwise.testing.patches import patch_report

    row = MatrixRow(patch.name, distribution, version, getattr(build, "__name__", repr(build)),
                    transformers=transformers_version)
    start = time.perf_counter()
    try:
        model = build()
    except Exception as error:  # noqa: BLE001 - a broken builder is a row of the matrix, not a crash
        row.failures.append(f"building the tiny model failed: {type(error).__name__}: {error}")
        return row
    row.architecture = type(model).__name__
    with warnings.catch_warnings(), without_progress_bars(bars_only=False):
        warnings.simplefilter("ignore")
        results = patch_report(patch, model)
    for result in results:
        column = _column(result.step)
        if column == "trace" and result.step.startswith("trace ("):
            row.modalities.append(result.step[len("trace ("):-1])
        if row.checks.get(column) != "failed":
            row.checks[column] = result.status
        if result.status == "failed":
            row.failures.append(result.message)
    row.seconds = time.perf_counter() - start
    return row


def _column(step: str) -> str:
    first = step.split()[0]
    return {"opaque": "opaque", "sample": "trace"}.get(first, first)  # "mappings exact (x)": mappings


def format_matrix(rows: Sequence[MatrixRow], times: bool = True) -> str:
    """A text table (✔ passed, ✘ failed, · skipped), then each failure's message."""
    header = ["patch", "model", "architecture", "distribution", "modalities", *COLUMNS] + (["time"] if times else [])
    table = [header]
    for row in rows:
        cells = [row.patch, row.model, row.architecture or "-", " ".join(filter(None, (row.distribution, row.version))),
                 ",".join(row.modalities) or "-", *(MARKS[row.checks.get(c, "")] for c in COLUMNS)]
        table.append(cells + ([f"{row.seconds:.1f}s"] if times else []))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(r, widths)).rstrip() for r in table]
    passed = sum(row.passed for row in rows)
    transformers = rows[0].transformers if rows else "?"
    lines += ["", f"{passed} of {len(rows)} tiny models pass every check (transformers {transformers})"]
    for row in rows:
        for failure in row.failures:
            lines.append(f"✘ {row.patch} / {row.model}: {failure}")
    return "\n".join(lines)


def as_json(rows: Sequence[MatrixRow]) -> dict[str, Any]:
    """``--json``: the rows with stable keys, and a summary."""
    return {"columns": list(COLUMNS), "summary": {"models": len(rows), "passed": sum(r.passed for r in rows)},
            "rows": [{**asdict(row), "passed": row.passed} for row in rows]}
