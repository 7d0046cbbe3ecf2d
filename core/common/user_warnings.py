"""Warnings that point at the user's line, printed once.

A warning raised deep inside a pipeline (in a forward hook torch calls, in a modifier)
would by default name a torch or layerwise file the user never wrote. ``warn_user`` names
the line that called into layerwise instead: the caller of the outermost layerwise frame
(the user's ``compress(...)``). Warnings go through ``warnings`` only, never also through
``logging`` at WARNING level, so that each is printed once.
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType

#: the import names of layerwise's own code (core, plugins, model_zoo all live under it)
_PACKAGE = "layerwise"
#: modules whose frames only wrap a call (decorators, context managers), never the user's line
_WRAPPERS = ("torch.", "contextlib", "functools")


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the line that called into layerwise."""
    warnings.warn(message, category, stacklevel=user_stacklevel())


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the calling function name the user's line.

    Level 1 is the function calling this one. The answer is the first frame outside the outermost
    layerwise frame that is not a torch wrapper (``@torch.no_grad()`` puts torch's frame between a
    decorated layerwise method and the line that called it).
    """
    frames: list[FrameType] = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    ours = [index for index, f in enumerate(frames) if _is_layerwise(f)]
    caller = (ours[-1] if ours else 0) + 1  # frames[index] is at stacklevel index + 1
    user = caller
    while user < len(frames) and _is_wrapper(frames[user]):
        user += 1
    return (user if user < len(frames) else caller) + 1


def _module_name(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))


def _is_layerwise(frame: FrameType) -> bool:
    name = _module_name(frame)
    return name == _PACKAGE or name.startswith(_PACKAGE + ".")


def _is_wrapper(frame: FrameType) -> bool:
    return _module_name(frame).startswith(_WRAPPERS)


class AlgorithmFallbackWarning(RuntimeWarning):
    """An algorithm fell back to a simpler one for some layers (GPTQ to round-to-nearest, ...).

    Plugins subclass it for their own fallbacks, so a check (the plugin kit) can catch them all.
    """
