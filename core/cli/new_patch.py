"""``layerwise new-patch ARCHITECTURE``: generate a model-patch package and run the plugin kit on it.

Wire-up: ``add_parser(subparsers)`` registers the subcommand, ``run(args)`` executes it.
Exit status: 0 written (and the kit passed, unless ``--no-check``); 1 written, but the kit
failed (its message names the fix); 2 nothing written (bad input: the error says why).
"""

from __future__ import annotations

import argparse
from typing import Any

from layerwise.scaffold import Generated, generate, run_kit
from layerwise.scaffold.coverage import InstalledPatch
from layerwise.testing.patches import STEPS


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``new-patch`` on an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "new-patch", help="generate a third-party model-patch package for an architecture",
        description="Generate a ready third-party package with a model patch for ARCHITECTURE: the patch (targets "
                    "and ignore list found on a tiny model built from the config class), sample inputs, a tiny "
                    "model builder, tests and a pyproject with the 'layerwise' entry point. Then run layerwise's "
                    "plugin kit on it.",
        epilog="Exit status 0 when written and the kit passed, 1 when written but the kit failed (the message "
               "names the fix), 2 when nothing was written.")
    parser.add_argument("architecture", metavar="ARCHITECTURE",
                        help="a transformers model class, as config.json lists it under \"architectures\" "
                             "(e.g. MistralForCausalLM)")
    parser.add_argument("--output-dir", help="where to write the package (default: ./layerwise-<name>)")
    parser.add_argument("--name", help="the patch's name (default: the config's model_type); the package is "
                                       "layerwise-<name>, its module layerwise_<name>")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output folder holding a layerwise plugin package")
    parser.add_argument("--overwrite-any", action="store_true",
                        help="replace an existing output folder whatever it holds")
    parser.add_argument("--no-check", action="store_true", help="write the package without running the plugin kit")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    generated = generate(args.architecture, args.output_dir, name=args.name, overwrite="any" if args.overwrite_any else args.overwrite)
    plan = generated.plan
    print(f"{plan.architecture} ({plan.config_class}, model_type {plan.model_type!r}): tiny model with {', '.join(plan.blocks)}")
    for line in _notes(generated):
        print(f"note: {line}")
    print(f"wrote {plan.distribution} to {generated.path}")
    for file in generated.files:
        print(f"  {file}")
    print(f"  targets: {', '.join(plan.sequential_targets)}; ignore: {', '.join(plan.ignore) or 'nothing'}")
    if args.no_check:
        print("plugin kit: skipped (--no-check); its tests run it: python -m pytest -q tests")
        status = 0
    else:
        status = _check(generated)
    if status == 0:
        print(f"next: cd {generated.path} && pip install -e '.[test]' && python -m pytest -q tests")
    return status


def _check(generated: Generated) -> int:
    plan = generated.plan
    print(f"plugin kit: check_model_patch on {plan.builder}() ...", flush=True)
    result = run_kit(generated.path, plan.module)
    models = ", ".join(f"{m}()" for m in result.models)
    if result.passed:
        print(f"plugin kit: passed on {models} in {result.seconds:.1f} s ({', '.join(STEPS)})")
        return 0
    print(f"plugin kit: FAILED on {models} after {result.seconds:.1f} s")
    print(f"  {result.error}")
    print(f"the package was written to {generated.path}, but it needs the fix the message names (usually in "
          f"src/{plan.module}/__init__.py) before it passes; then run: python -m pytest -q tests")
    return 1


def _notes(generated: Generated) -> list[str]:
    return [*generated.notes, *(_covered(generated.plan.architecture, p) for p in generated.covered_by)]


def _covered(architecture: str, patch: InstalledPatch) -> str:
    if patch.score == 2:
        return (f"{architecture} is already covered by the installed {patch.describe()}; with this package "
                f"installed too, both match by class name and layerwise picks one of them")
    return (f"{architecture} is already covered by the installed {patch.describe()}; this package names the "
            f"class, so layerwise will pick it instead once it is installed")
