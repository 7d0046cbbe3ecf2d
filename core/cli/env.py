"""``layerwise env``: the versions a bug report needs, and whether they were tested.

Cheap on purpose: plugin distributions are read from entry-point metadata, nothing is
imported but torch and transformers, so it works even when a plugin is broken.
"""

from __future__ import annotations

import argparse
import json
from importlib.metadata import entry_points
from typing import Any

from layerwise.host.plugin_manager import GROUP, distribution_of
from layerwise.host.versions import TESTED_TRANSFORMERS, environment


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="print layerwise, torch, transformers and plugin versions for bug reports",
                       description="Print the versions of layerwise and the libraries whose internals it reads, "
                                   "the transformers range it was tested on, the accelerator torch sees, and "
                                   "the distributions that provide layerwise plugins.")
    p.add_argument("--json", action="store_true", help="print the same as one JSON object")
    p.set_defaults(func=run)


def plugin_distributions() -> list[str]:
    """``name version`` of every distribution with an entry point in the plugin group."""
    found = {distribution_of(ep) for ep in entry_points(group=GROUP)}
    return [f"{name} {version}" for name, version in sorted(found)]


def collect() -> dict[str, Any]:
    report = environment()
    report["plugin_distributions"] = plugin_distributions()
    return report


def format_report(report: dict[str, Any]) -> str:
    versions = report["versions"]
    tested = report["transformers_tested"]
    width = max(len(name) for name in versions) + 2
    lines = []
    for name, version in versions.items():
        note = ""
        if name == "transformers" and version is not None:
            note = (f"  (in the tested range, {TESTED_TRANSFORMERS})" if tested["running_is_tested"] else
                    f"  (NOT in the tested range, {TESTED_TRANSFORMERS}: check a model with "
                    f"`layerwise trace --model <folder> --verify`)")
        lines.append(f"{name:<{width}}{version or 'not installed'}{note}")
    lines.append(f"{'python':<{width}}{report['python']} ({report['platform']})")
    lines.append(f"{'accelerator':<{width}}{report['accelerator']}")
    lines.append(f"{'plugins from':<{width}}{', '.join(report['plugin_distributions']) or '(none)'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
