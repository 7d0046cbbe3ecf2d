"""The saver contract: an output format a plugin registers, and what ``compress()`` asks of it.

A saver is registered as an instance (``register("my-format", MyFormatSaver())``); a plain function
``fn(model, output_dir, *, tokenizer, recipe, extra_files, overwrite)`` is accepted too and wrapped
in :class:`FunctionSaver`. ``compress()`` calls, in this order:

1. :meth:`Saver.saved_bytes` for the report's size after compression (with or without an output);
2. with weights streamed from disk (``weights="stream"``, only when :attr:`Saver.streams`):
   :meth:`Saver.encode_module` for each module as its piece finishes (its tensors go to the output
   folder at once), then :meth:`Saver.save_streamed` to complete the folder;
3. otherwise :meth:`Saver.save` with the whole model.

Every write goes through :func:`layerwise.plugin.saving.atomic_output_dir`: the folder appears whole
or not at all, an existing one is replaced only as ``overwrite`` allows, an input is never
written over. ``layerwise.testing.check_saver`` checks a saver against this contract.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch


class Saver(ABC):
    """An output format: writes a compressed model to a folder."""

    #: whether it can write a run whose weights stream from disk (``encode_module`` + ``save_streamed``)
    streams: ClassVar[bool] = False

    @abstractmethod
    def save(self, model: torch.nn.Module, output_dir: str | os.PathLike, *, tokenizer: Any = None,
             recipe: str | None = None, extra_files: dict[str, str | bytes] | None = None,
             overwrite: bool | str = False) -> Path:
        """Write ``model`` (compressed in place) to ``output_dir`` with the tokenizer, ``recipe.yaml`` and
        every extra file (path relative to the folder -> content); return the folder."""

    def saved_bytes(self, model: torch.nn.Module) -> int:
        """The bytes the model's tensors take in this format (the report's size after compression).

        The default counts them as they are in memory, each shared tensor once.
        """
        from layerwise.runtime.sizes import parameter_bytes

        return parameter_bytes(model)

    def encode_module(self, name: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The tensors to write for one finished module (streamed runs; names relative to the model)."""
        raise NotImplementedError(f"{type(self).__name__} cannot write a streamed run (streams = False)")

    def save_streamed(self, model: torch.nn.Module, stream: Any, output_dir: str | os.PathLike, *,
                      tokenizer: Any = None, recipe: str | None = None,
                      extra_files: dict[str, str | bytes] | None = None, overwrite: bool | str = False) -> Path:
        """Complete a streamed run's folder (its pieces' tensors are written already); return the folder."""
        raise NotImplementedError(f"{type(self).__name__} cannot write a streamed run (streams = False)")

    def quantization_config(self, model: torch.nn.Module, modules: dict[str, torch.nn.Module],
                            extra_ignore: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
        """The ``quantization_config`` of config.json for ``modules`` (quantized, by name) of ``model``, with
        ``extra_ignore`` entries added: what a model-free run (no model, no ``save``) asks of a saver."""
        raise NotImplementedError(f"{type(self).__name__} cannot write a model-free run (no quantization_config)")

    def __call__(self, model: torch.nn.Module, output_dir: str | os.PathLike, **options: Any) -> Path:
        """``saver(model, folder, ...)`` is ``saver.save(model, folder, ...)``."""
        return self.save(model, output_dir, **options)


class FunctionSaver(Saver):
    """A saver written as one function (the simple form a plugin may register)."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.__name__ = getattr(function, "__name__", type(function).__name__)

    def save(self, model: torch.nn.Module, output_dir: str | os.PathLike, **options: Any) -> Path:
        self.function(model, output_dir, **options)
        return Path(output_dir)

    def __repr__(self) -> str:
        return f"FunctionSaver({self.__name__})"


def as_saver(registered: Any) -> Saver:
    """What a plugin registered, as a :class:`Saver` (an instance, a subclass to instantiate, or a function)."""
    if isinstance(registered, Saver):
        return registered
    if isinstance(registered, type) and issubclass(registered, Saver):
        return registered()
    if callable(registered):
        return FunctionSaver(registered)
    raise TypeError(f"register() for savers takes a Saver (or a function saving a model to a folder), "
                    f"got {registered!r}")
