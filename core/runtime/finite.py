"""Finite or fail: NaN and inf are found where they enter, never saved.

Three checks, one contract -- a compressed checkpoint holds only finite numbers, or
nothing is written:

* **before calibration** (:func:`check_weights`): every floating parameter of the model
  is checked, not only the weights the recipe compresses, because a bad norm or embedding
  poisons every activation just the same. A non-finite parameter is a
  :class:`~layerwise.errors.NonFiniteError` naming it; with ``non_finite="skip"`` the
  modules holding one are left uncompressed (their weights untouched) and listed in the
  report. Buffers are not checked: attention masks hold ``-inf`` by design.
* **during calibration**: a calibration sample whose activations become non-finite is
  dropped (by the sequential pipeline, and by GPTQ's Hessian hooks), with a warning naming
  it; no sample left is a ``NonFiniteError``.
* **when saving** (:func:`check_saved`): every tensor about to be written is checked before
  the output folder is renamed into place; tensors of modules skipped on purpose are exempt.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from layerwise.common.user_warnings import warn_user
from layerwise.errors import InvalidArgumentError, NonFiniteError

#: what ``compress(non_finite=...)`` accepts: fail (the default), or leave those modules uncompressed
NON_FINITE_MODES = ("error", "skip")
#: set on a module left uncompressed because of a non-finite parameter: the saver lets its tensors through
SKIPPED_ATTR = "_layerwise_non_finite_skipped"
#: how many names an error lists before counting the rest
SHOWN = 5


class NonFiniteSampleWarning(RuntimeWarning):
    """NaN or inf met and worked around: a calibration sample dropped, or a module left uncompressed."""


def is_finite(tensor: Any) -> bool:
    """True for a tensor without NaN/inf (integer and meta tensors, and non-tensors, count as finite)."""
    if (not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta" or not tensor.is_floating_point()
            or tensor.numel() == 0):
        return True
    if tensor.dtype == torch.float8_e4m3fn:  # no inf; NaN is the one code with every exponent and mantissa bit set
        return int(tensor.view(torch.uint8).bitwise_and(0x7F).max()) != 0x7F
    if tensor.element_size() == 1:  # other float8 have no min/max kernels on CPU; their values are few
        return bool(torch.isfinite(tensor.to(torch.float16)).all())
    # min and max in one pass, no tensor-sized mask: NaN propagates into both, inf shows in one
    # (10x faster than isfinite().all(): it runs on every activation the pipeline caches)
    # (read back as Python floats: three more tensor ops on the two scalars cost 3x the pass itself on
    # a short sample's activation, and this runs ~10,000 times in a MiniLM calibration)
    low, high = torch.aminmax(tensor)
    return math.isfinite(low.item()) and math.isfinite(high.item())


def all_finite(value: Any) -> bool:
    """Every tensor in ``value`` (a tensor, or nested dicts/lists/tuples of them) is finite."""
    if isinstance(value, Mapping):
        return all(all_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(all_finite(v) for v in value)
    return is_finite(value)


def listed(names: list[str]) -> str:
    """The first few names, and how many in all."""
    shown = ", ".join(map(repr, names[:SHOWN]))
    return shown + (f", ... ({len(names)} in all)" if len(names) > SHOWN else "")


@torch.no_grad()
def non_finite_parameters(model: torch.nn.Module) -> list[str]:
    """Qualified names of the model's floating parameters holding a NaN or inf (model order)."""
    return [name for name, param in model.named_parameters() if not is_finite(param)]


def check_mode(mode: str) -> None:
    """``compress(non_finite=...)`` is one of :data:`NON_FINITE_MODES` (checked before the model loads)."""
    if mode not in NON_FINITE_MODES:
        raise InvalidArgumentError(f"non_finite must be one of {', '.join(NON_FINITE_MODES)}, got {mode!r}")


def check_weights(model: torch.nn.Module, mode: str = "error", bad: list[str] | None = None) -> list[str]:
    """Fail on non-finite parameters, or (``mode="skip"``) mark their modules and return their names.

    ``bad``: the non-finite parameters when the caller found them (weights streamed from disk).
    """
    check_mode(mode)
    bad = non_finite_parameters(model) if bad is None else bad
    if not bad:
        return []
    if mode == "error":
        raise NonFiniteError(
            f"the model has {len(bad)} parameter(s) holding NaN or inf: {listed(bad)}; the checkpoint is "
            f"damaged (or was saved after a diverged step): load a good copy, or pass non_finite='skip' "
            f"(CLI: --skip-non-finite) to leave those modules uncompressed")
    modules = list(dict.fromkeys(name.rpartition(".")[0] for name in bad))
    for name in modules:
        setattr(model.get_submodule(name), SKIPPED_ATTR, True)
    warn_user(f"{len(modules)} module(s) with NaN or inf parameters left uncompressed: {listed(modules)}",
              NonFiniteSampleWarning)
    return modules


def skipped_prefixes(model: torch.nn.Module) -> list[str]:
    """State-dict prefixes of the modules :func:`check_weights` skipped."""
    return [f"{name}." if name else "" for name, m in model.named_modules() if getattr(m, SKIPPED_ATTR, False)]


def check_saved(tensors: Mapping[str, torch.Tensor], exempt: Iterable[str] = ()) -> None:
    """Every tensor about to be saved is finite (except under ``exempt`` prefixes); else nothing is written."""
    exempt = tuple(exempt)
    bad = [name for name, tensor in tensors.items()
           if not (exempt and name.startswith(exempt)) and not is_finite(tensor)]
    if bad:
        raise NonFiniteError(
            f"{len(bad)} tensor(s) to be saved hold NaN or inf: {listed(bad)}; nothing was written. "
            f"Compression produced them (a non-finite weight or calibration input layerwise did not catch): "
            f"please report it, and leave those modules out with ignore= (CLI: --ignore) meanwhile")


def drop_if_non_finite(index: int, outputs: Any, where: str, dropped: set[int], total: int) -> bool:
    """Drop calibration sample ``index`` (warning) when ``outputs`` hold NaN/inf; error when none is left.

    Returns whether it was dropped; ``where`` names the piece of the model that produced them.
    """
    if all_finite(outputs):
        return False
    dropped.add(index)
    if len(dropped) >= total:
        raise NonFiniteError(
            f"every calibration sample ({total}) became NaN or inf in {where}; the model's forward is not finite "
            f"on this data: check its weights (a non-finite one upstream), or load it in bfloat16/float32 if "
            f"float16 overflows")
    warn_user(f"calibration sample {index}: its activations became NaN or inf in {where}; it is dropped "
              f"from the rest of the calibration ({total - len(dropped)} of {total} samples left)",
              NonFiniteSampleWarning)
    return True
