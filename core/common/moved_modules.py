"""Old module paths (before the layout by role, 0.1.0) keep importing, with a warning naming the new one.

Scripts written against ``layerwise.loading`` or ``layerwise.saving`` go on working for this minor
release series: importing an old name imports the module at its new place, registers it under
both names, and warns once (:class:`DeprecationWarning`). Plugins import ``layerwise.plugin``,
which these moves never touch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

#: old dotted name -> new dotted name
MOVED = {
    "layerwise.accounting": "layerwise.runtime.accounting",
    "layerwise.cache": "layerwise.runtime.cache",
    "layerwise.compressed_loading": "layerwise.model_io.compressed_loading",
    "layerwise.compression": "layerwise.verbs.compression",
    "layerwise.data": "layerwise.model_io.calibration_data",
    "layerwise.demo": "layerwise.verbs.demo",
    "layerwise.devices": "layerwise.runtime.devices",
    "layerwise.distributed": "layerwise.runtime.distributed",
    "layerwise.embedding_eval": "layerwise.reports.embedding_eval",
    "layerwise.env_cli": "layerwise.cli.env",
    "layerwise.finite": "layerwise.runtime.finite",
    "layerwise.heads": "layerwise.model_io.heads",
    "layerwise.heap": "layerwise.runtime.heap",
    "layerwise.hessian": "layerwise.algorithms.hessian",
    "layerwise.hookspecs": "layerwise.host.hookspecs",
    "layerwise.lifecycle": "layerwise.host.lifecycle",
    "layerwise.load_errors": "layerwise.model_io.load_errors",
    "layerwise.loading": "layerwise.model_io.loading",
    "layerwise.mapped_pages": "layerwise.common.mapped_pages",
    "layerwise.matching": "layerwise.common.matching",
    "layerwise.model_patch": "layerwise.host.model_patch",
    "layerwise.modifier": "layerwise.host.modifier",
    "layerwise.offload": "layerwise.runtime.offload",
    "layerwise.output_lock": "layerwise.model_io.output_lock",
    "layerwise.pipeline": "layerwise.host.pipeline",
    "layerwise.pipeline_selection": "layerwise.host.pipeline_selection",
    "layerwise.plugin_manager": "layerwise.host.plugin_manager",
    "layerwise.plugins_cli": "layerwise.cli.plugins",
    "layerwise.quantization": "layerwise.algorithms.quantization",
    "layerwise.quiet": "layerwise.common.quiet",
    "layerwise.recipe": "layerwise.host.recipe",
    "layerwise.registry": "layerwise.host.registry",
    "layerwise.report": "layerwise.reports.text",
    "layerwise.report_cli": "layerwise.cli.report",
    "layerwise.report_svg": "layerwise.reports.svg",
    "layerwise.resume": "layerwise.model_io.resume",
    "layerwise.run_summary": "layerwise.reports.run_summary",
    "layerwise.saving": "layerwise.model_io.saving",
    "layerwise.sparsity": "layerwise.algorithms.sparsity",
    "layerwise.state": "layerwise.host.state",
    "layerwise.streaming": "layerwise.model_io.streaming",
    "layerwise.support_matrix": "layerwise.testing.support_matrix",
    "layerwise.tracing.cli": "layerwise.cli.trace",
    "layerwise.scaffold.cli": "layerwise.cli.new_patch",
    "layerwise.user_warnings": "layerwise.common.user_warnings",
    "layerwise.versions": "layerwise.host.versions",
}


def new_name(old: str) -> str | None:
    """The new dotted name of ``old`` (a moved module or one inside a moved package), else ``None``."""
    for prefix, target in MOVED.items():
        if old == prefix or old.startswith(prefix + "."):
            return target + old[len(prefix):]
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.target}; import it from there (plugins: layerwise.plugin)",
                      DeprecationWarning, stacklevel=3)
        module = importlib.import_module(self.target)
        sys.modules[spec.name] = module
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module ran at its new place already."""


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of moved modules and hands out the modules at their new place."""

    def find_spec(self, fullname: str, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``import layerwise`` does)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())  # before the path finder, which would load a second copy
