"""``layerwise plugins``: every installed plugin, what it registered, and which are broken and why.

Exit status: 0, also when some plugins are broken (they are listed, and compression runs
without them); 1 when two plugins register the same name (compression refuses to start
until one is disabled or uninstalled), and with ``--strict`` (or ``LAYERWISE_STRICT_PLUGINS=1``)
also when any plugin is broken. ``--json`` prints the same report as one JSON object whose
keys are stable: ``group``, ``summary``, ``plugins`` (each with ``name``, ``distribution``,
``version``, ``entry_point``, ``status``, ``broken``, ``disabled``, ``warnings``,
``registered`` -- every kind, possibly empty -- and ``model_patches``, each with ``name``,
``architectures``, ``model_types`` and ``verified_transformers``), ``conflicts``, ``schemes`` (each scheme name
-> what it quantizes and how) and ``recipe_presets`` (``algorithms``: prefix -> the modifier that declares it,
``chains``: preset -> its modifiers).

``--check [NAME ...]`` runs the plugin kit on the installed model patches instead and prints the
support matrix (:mod:`layerwise.testing.support_matrix`); exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

from layerwise.host.plugin_manager import (
    DISABLE_ENV,
    GROUP,
    KINDS,
    STRICT_ENV,
    PluginHost,
    normalize_distribution,
    strict_from_env,
)
from layerwise.host.versions import describe_span

#: how the text report names each kind
TITLES = {"pipelines": "pipelines", "modifiers": "modifiers", "model_patches": "model patches",
          "observers": "observers", "datasets": "datasets", "savers": "savers"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plugins", help="list installed plugins, what they register, and which are broken",
        description="List every plugin of the 'layerwise' entry-point group: its distribution and version, "
                    "what it registered (pipelines, modifiers, model patches with the architectures and "
                    "model types they match, observers, datasets, savers), and which plugins are broken and why.",
        epilog=f"Exit status 0 even with broken plugins (they are skipped); 1 on a name conflict between plugins, "
               f"and with --strict or {STRICT_ENV}=1 also when a plugin is broken. "
               f"{DISABLE_ENV}=a,b blocks plugins by entry-point or distribution name.")
    p.add_argument("--json", action="store_true", help="print the report as JSON (stable keys)")
    p.add_argument("--strict", action="store_true", help="exit with status 1 when any plugin is broken")
    p.add_argument("--check", nargs="*", metavar="NAME",
                   help="run the plugin kit (layerwise.testing) on every installed model patch, or those named "
                        "(patch or distribution), on the patches' own tiny models, and print the support matrix; "
                        "exit 1 when a check fails")
    p.set_defaults(func=run)


def collect(host: PluginHost | None = None) -> dict[str, Any]:
    """The report ``layerwise plugins`` prints, as plain data (what ``--json`` shows).

    ``host`` defaults to a fresh one that loads every installed entry point.
    """
    with warnings.catch_warnings():  # the report lists broken plugins itself
        warnings.filterwarnings("ignore", message="layerwise plugin", category=RuntimeWarning)
        host = host or PluginHost(strict=False)
        _, conflicts = host.survey()
    plugins = []
    for info in sorted(host.plugins.values(), key=lambda i: (normalize_distribution(i.distribution), i.name)):
        entry = info.as_dict()
        entry["registered"] = {kind: list(info.registered.get(kind, [])) for kind in KINDS}
        entry["model_patches"] = [
            {"name": name, "architectures": list(patch.architectures), "model_types": list(patch.model_types),
             "verified_transformers": list(patch.verified_transformers)}
            for name, patch in info.objects.get("model_patches", {}).items()
        ]
        plugins.append(entry)
    statuses = [p["status"] for p in plugins]
    return {
        "group": GROUP,
        "summary": {"plugins": len(plugins), "ok": statuses.count("ok"), "broken": statuses.count("broken"),
                    "disabled": statuses.count("disabled"), "conflicts": len(conflicts)},
        "plugins": plugins,
        "conflicts": conflicts,
        **({} if conflicts else _schemes_and_presets()),
    }


def _schemes_and_presets() -> dict[str, Any]:
    """The named schemes (what ``--recipe NAME`` and a modifier's ``scheme: NAME`` take) and the recipe presets
    the registered modifiers add: ``<ALGORITHM>_<SCHEME>`` and chains of modifiers."""
    from layerwise.algorithms.quantization.presets import PRESETS
    from layerwise.host.recipe import algorithm_presets, chained_presets
    from layerwise.planning.plan import describe_scheme

    return {"schemes": {name: describe_scheme(scheme.weights, scheme.input_activations)
                        for name, scheme in PRESETS.items()},
            "recipe_presets": {"algorithms": algorithm_presets(),
                               "chains": {name: [modifier for modifier, _ in chain]
                                          for name, chain in chained_presets().items()}}}


def format_report(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [(f"{s['plugins']} layerwise plugins (entry-point group {report['group']!r}): "
             f"{s['ok']} ok, {s['broken']} broken, {s['disabled']} disabled")]
    distribution = None
    name_width = max((len(p["name"]) for p in report["plugins"]), default=0)
    for plugin in report["plugins"]:
        if (plugin["distribution"], plugin["version"]) != distribution:
            distribution = plugin["distribution"], plugin["version"]
            lines += ["", " ".join(filter(None, distribution))]
        status = {"ok": "", "broken": "  BROKEN (skipped)",
                  "disabled": f"  disabled ({DISABLE_ENV})"}[plugin["status"]]
        lines.append(f"  {plugin['name']:<{name_width}}  {plugin['entry_point'] or '(registered directly)'}{status}")
        if plugin["broken"]:
            lines.append(f"    error: {plugin['broken']}")
        for warning in plugin["warnings"]:
            lines.append(f"    warning: {warning}")
        for kind in KINDS:
            names = plugin["registered"][kind]
            if not names or kind == "model_patches":
                continue
            lines.append(f"    {TITLES[kind]}: {', '.join(names)}")
        if plugin["model_patches"]:
            lines.append(f"    {TITLES['model_patches']}:")
            width = max(len(p["name"]) for p in plugin["model_patches"])
            for patch in plugin["model_patches"]:
                matches = [f"architectures {', '.join(patch['architectures'])}" if patch["architectures"] else "",
                           f"model_types {', '.join(patch['model_types'])}" if patch["model_types"] else ""]
                span = tuple(patch["verified_transformers"])
                verified = f"verified on transformers {describe_span(span)}" if span else "verified on: not stated"
                lines.append(f"      {patch['name']:<{width}}  {'; '.join(filter(None, matches)) or 'matches nothing'}"
                             f"; {verified}")
        if plugin["status"] == "ok" and not any(plugin["registered"].values()):
            lines.append("    (registered nothing)")
    if report.get("schemes"):
        width = max(len(name) for name in report["schemes"])
        lines += ["", "schemes (--recipe NAME: round-to-nearest; or scheme: NAME in a modifier):"]
        lines += [f"  {name:<{width}}  {text}" for name, text in report["schemes"].items()]
        presets = report["recipe_presets"]
        algorithms = ", ".join(f"{prefix} ({modifier})" for prefix, modifier in presets["algorithms"].items())
        example = "GPTQ" if "GPTQ" in presets["algorithms"] else next(iter(presets["algorithms"]), "")
        lines += ["", f"recipe presets: <ALGORITHM>_<SCHEME> for {algorithms}"
                      + (f"; e.g. {example}_W4A16" if example else "")]
        lines += [f"  {name}: {' then '.join(modifiers)}" for name, modifiers in presets["chains"].items()]
    broken = [p for p in report["plugins"] if p["status"] == "broken"]
    if broken:
        lines += ["", (f"{len(broken)} broken plugin(s), skipped; the others work "
                      f"({STRICT_ENV}=1 makes this an error, {DISABLE_ENV}=<name> silences it):")]
        lines += [f"  {p['name']} ({p['distribution']} {p['version']}): {p['broken']}" for p in broken]
    if report["conflicts"]:
        lines += ["", (f"{len(report['conflicts'])} name conflict(s); compression refuses to start until one side "
                      f"is disabled ({DISABLE_ENV}=<name>) or uninstalled:")]
        lines += [f"  {conflict}" for conflict in report["conflicts"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.check is not None:
        return run_check(args.check, as_json=args.json)
    report = collect()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if report["conflicts"]:
        return 1
    if report["summary"]["broken"] and (args.strict or strict_from_env()):
        return 1
    return 0


def run_check(names: list[str], as_json: bool = False) -> int:
    """``layerwise plugins --check [NAME ...]``: the support matrix; 1 when any check fails."""
    from layerwise.testing.support_matrix import as_json as matrix_json
    from layerwise.testing.support_matrix import check_patches, format_matrix

    rows = check_patches(names)
    print(json.dumps(matrix_json(rows), indent=2, ensure_ascii=False) if as_json else format_matrix(rows))
    return 0 if all(row.passed for row in rows) else 1
