"""``layerwise new-patch ARCHITECTURE``: a ready third-party model-patch package for an architecture.

A plugin author starts from a package that already passes layerwise's plugin kit, and
edits from there. The steps, one module each:

1. :mod:`.architecture` -- the transformers model class the name stands for;
2. :mod:`.tiny_config` -- its config class's defaults with the size fields shrunk;
3. :mod:`.plan` -- the tiny model, and what the patch says about it (targets, ignore, ...);
4. :mod:`.coverage` -- installed patches that already match it (a note) or take its name (an error);
5. :mod:`.render` and :mod:`.write` -- the files, written all at once or not at all;
6. :mod:`.check` -- the plugin kit, run on the written package before anything is installed.

:func:`generate` runs 1-5; the CLI (:mod:`.cli`) adds 6.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .check import KitResult, run_kit
from .coverage import InstalledPatch
from .errors import ScaffoldError
from .plan import PatchPlan, plan_patch

__all__ = ["Generated", "KitResult", "PatchPlan", "ScaffoldError", "generate", "plan_patch", "run_kit"]


@dataclass(frozen=True)
class Generated:
    """A written package: the plan it states, where it is, and what already covers the architecture."""

    plan: PatchPlan
    path: Path
    #: the files written, relative to ``path``
    files: tuple[str, ...]
    #: installed patches of other distributions that match the architecture too
    covered_by: tuple[InstalledPatch, ...] = ()
    #: things the user should know that are no error
    notes: tuple[str, ...] = ()


def generate(architecture: str, output_dir: str | os.PathLike | None = None, *, name: str | None = None,
             overwrite: bool | str = False) -> Generated:
    """Write the package for ``architecture`` into ``output_dir`` (default ``./layerwise-<slug>``).

    Raises :class:`ScaffoldError` for an architecture it cannot generate (naming why and the
    fix) and :class:`~layerwise.model_io.saving.OutputExistsError` for an existing folder without
    ``overwrite`` (``True`` replaces a plugin package, ``"any"`` any folder); nothing is written then.
    """
    from transformers import __version__ as transformers_version

    from .. import __version__ as layerwise_version
    from .coverage import check_name_free, covering
    from .plan import tiny_model
    from .render import render_package
    from .write import check_target, write_package

    if output_dir is not None:  # a folder that may not be written fails before any model is built
        check_target(output_dir, overwrite)
    plan = plan_patch(architecture, name)
    target = Path(output_dir) if output_dir is not None else Path.cwd() / plan.distribution
    check_target(target, overwrite)
    model = tiny_model(plan)
    check_name_free(model, plan.slug, plan.distribution)
    covered_by, note = covering(model, plan.distribution)
    tied = next((p for p in covered_by if p.score == 2), None)
    files = render_package(plan, layerwise_version=layerwise_version, transformers_version=transformers_version,
                           tied_with=f"the model patch {tied.name!r} of {tied.distribution}" if tied else "")
    path = write_package(files, target, overwrite)
    return Generated(plan, path, tuple(files), tuple(covered_by), (note,) if note else ())
