"""Choosing a model's patch among the registered ones, and applying it once."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from layerwise.errors import UnknownNameError
from layerwise.host.model_patch import ModelPatch
from layerwise.host.plugin_manager import registry


def find_patch(model: torch.nn.Module, patches: Sequence[ModelPatch] | None = None) -> ModelPatch | None:
    """The registered patch that best matches ``model``, or ``None``."""
    if patches is None:
        patches = [p for _, p in registry("model_patches").items()]
    return _best([(p.match_score(model), p) for p in patches])


def find_patch_for_config(config: Mapping[str, Any], patches: Sequence[ModelPatch] | None = None) -> ModelPatch | None:
    """The registered patch that best matches a checkpoint's ``config.json`` (its ``architectures`` class names,
    then its ``model_type``: :meth:`ModelPatch.config_match_score`), or ``None``: for the runs that build no
    model (model-free), with the same ties as :func:`find_patch`."""
    if patches is None:
        patches = [p for _, p in registry("model_patches").items()]
    return _best([(p.config_match_score(config), p) for p in patches])


def _best(scored: list[tuple[int, ModelPatch]]) -> ModelPatch | None:
    """The first patch of the highest score above 0; a tie (two installed patches for one architecture) is
    warned about, naming each one's plugin, so the choice is never silent."""
    best = max((s for s, _ in scored), default=0)
    if not best:
        return None
    tied = [p for s, p in scored if s == best]
    if len(tied) > 1:
        from layerwise.common.user_warnings import warn_user

        owners = registry("model_patches")
        named = ", ".join(f"{p.name!r} ({_owner(owners, p.name)})" for p in tied)
        warn_user(f"model patches {named} match this model equally; using {tied[0].name!r} (registered first): "
                  f"choose one with CompressOptions.of(patch='<name>'), or uninstall the other plugin", PatchTieWarning)
    return tied[0]


class PatchTieWarning(UserWarning):
    """Two or more registered model patches match a model equally well."""


def _owner(patches: Any, name: str) -> str:
    try:
        return str(patches.owner(name))
    except Exception:  # noqa: BLE001 - a patch passed in, not registered: no owner to name
        return "not registered"


def resolve_patch(model: torch.nn.Module, patch: ModelPatch | str | bool | None = None) -> ModelPatch | None:
    """Turn the user's ``patch=`` argument into a patch.

    ``None``/``True``: pick automatically; ``False``: no patch; a name: that registered
    patch; a :class:`ModelPatch`: used as is.
    """
    return chosen_patch(patch, lambda: find_patch(model))


def chosen_patch(patch: ModelPatch | str | bool | None, automatic: Callable[[], ModelPatch | None]
                 ) -> ModelPatch | None:
    """The patch a ``patch=`` argument names, ``automatic()`` for ``None`` / ``True`` (the match for a model,
    or for a ``config.json`` where no model is built)."""
    if patch is None or patch is True:
        return automatic()
    if patch is False:
        return None
    if isinstance(patch, ModelPatch):
        return patch
    if isinstance(patch, str):
        return registry("model_patches").get(patch)
    raise UnknownNameError("model patch", repr(patch), [], hint="pass a name, a ModelPatch, True or False")


def apply_patch(model: torch.nn.Module, patch: ModelPatch | None) -> torch.nn.Module:
    """Apply ``patch`` to ``model`` once and remember it on the model.

    The patch is on the model (:func:`applied_patch`) while its ``apply`` runs, so that an ``apply`` reading the
    patch's own fields (the zoo's expert unfusing reads ``expert_projections``) reads those of the patch being
    applied, also of one copied with ``dataclasses.replace``; a failed ``apply`` leaves the model unmarked."""
    before = applied_patch(model)
    if patch is None or before is patch:
        return model
    model._layerwise_patch = patch  # type: ignore[attr-defined]
    if patch.apply is not None:
        try:
            patch.apply(model)
        except BaseException:
            model._layerwise_patch = before  # type: ignore[attr-defined]
            raise
    return model


def applied_patch(model: torch.nn.Module) -> ModelPatch | None:
    """The patch applied to ``model`` (or being applied: see :func:`apply_patch`)."""
    return getattr(model, "_layerwise_patch", None)


def use_patch(model: torch.nn.Module, patch: ModelPatch | str | bool | None = None) -> ModelPatch | None:
    """Resolve ``patch`` for ``model`` (``None``: the one already applied, else the registered match),
    apply it, and return it: what ``compress()`` and ``trace()`` both do with their ``patch=``."""
    chosen = applied_patch(model) if patch is None else None
    chosen = chosen or resolve_patch(model, patch)
    apply_patch(model, chosen)
    return chosen
