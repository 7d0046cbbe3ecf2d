"""Which installed model patches already match an architecture, so ``new-patch`` can say so.

A class-name match (score 2) is what ``compress()`` picks first; a second package matching
the same class ties with it, so the author should know before building one. A patch of the
same *name* from another distribution is worse: both installed is a name conflict that stops
every compression, so the scaffold refuses that name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import LayerwiseError
from .errors import ScaffoldError


@dataclass(frozen=True)
class InstalledPatch:
    """A registered model patch, who registered it, and how well it matches a model."""

    name: str
    distribution: str
    version: str
    #: :meth:`~layerwise.ModelPatch.match_score`: 2 by class name, 1 by model_type
    score: int

    @property
    def how(self) -> str:
        return {2: "by class name", 1: "by model_type"}.get(self.score, "not at all")

    def describe(self) -> str:
        return f"model patch {self.name!r} of {self.distribution} {self.version}".rstrip() + f" ({self.how})"


def installed_patches(model: torch.nn.Module) -> list[InstalledPatch]:
    """Every registered patch with its owner and its match score for ``model`` (best first)."""
    from layerwise.host.plugin_manager import get_host, registry

    patches = registry("model_patches")
    owners = {name: (info.distribution, info.version) for info in get_host().plugins.values()
              for name in info.registered.get("model_patches", [])}
    found = [InstalledPatch(name, *owners.get(name, (patches.owner(name), "")), patch.match_score(model))
             for name, patch in patches.items()]
    return sorted(found, key=lambda p: -p.score)


def covering(model: torch.nn.Module, distribution: str) -> tuple[list[InstalledPatch], str]:
    """The installed patches of other distributions matching ``model``, and a note when none can be listed."""
    try:
        return [p for p in installed_patches(model) if p.score and not _same(p.distribution, distribution)], ""
    except LayerwiseError as error:  # two installed plugins conflict: say it, and go on
        return [], f"cannot list the installed model patches: {error}"


def check_name_free(model: torch.nn.Module, name: str, distribution: str) -> None:
    """Refuse a patch name another installed distribution already registers (a conflict once both are installed)."""
    try:
        taken = [p for p in installed_patches(model) if p.name == name and not _same(p.distribution, distribution)]
    except LayerwiseError:  # the conflict is reported by covering()
        return
    if taken:
        covers = f", and it covers {type(model).__name__} {taken[0].how}" if taken[0].score else ""
        raise ScaffoldError(f"a model patch named {name!r} is already registered by {taken[0].distribution} "
                            f"{taken[0].version}{covers}; a second patch of that name would be a name conflict "
                            f"once both are installed, which stops compression: pass --name to choose another "
                            f"(e.g. --name {name}_custom)")


def _same(left: str, right: str) -> bool:
    from layerwise.host.plugin_manager import normalize_distribution

    return normalize_distribution(left) == normalize_distribution(right)
