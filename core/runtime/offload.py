"""Moving the modules of one piece of the model to the execution device and back.

During calibration the execution device (the GPU where there is one) holds only
the modules of the piece being calibrated; every other weight rests where it was
loaded (its *home* device, usually CPU). :meth:`ModuleOffloader.onloaded` moves a
set of modules' parameters and buffers to the execution device for the duration
of a ``with`` block and sends them home afterwards -- including whatever a
modifier changed or added meanwhile (a quantized weight, ``weight_scale``).

Parameters keep their identity (``param.data`` is swapped), so hooks and
references that modifiers hold stay valid. A tensor two modules share (tied embeddings, BERT's
decoder bias) goes home to where it rested before the first of them moved it. When home and execution device are
the same (the CPU-only case) nothing moves.

``protected`` names modules that belong to *other* pieces (the sequential
targets): onloading an ancestor of them (the whole model, to capture the first
target's inputs) moves everything except them.

A name may also be one parameter or buffer (``embeddings.token_type_ids``): then only that
tensor moves, not its owner's other tensors nor its submodules (a piece that reads a buffer of a
container whose layers other pieces run).

With a ``source`` (:class:`~layerwise.model_io.streaming.WeightStream`) the weights rest on disk: an
unloaded parameter is read from the checkpoint when its piece is onloaded, and
:meth:`ModuleOffloader.retire` hands modules no later piece runs to the source, which writes
them; on leaving the block they are unloaded again. With ``keep_loaded`` a loaded weight whose
module is not retired yet (a later piece runs it too, perhaps after a modifier changed it)
stays in CPU memory until it is; without, it is unloaded on leaving the block (a replay that
changes nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from layerwise.runtime.devices import canonical
from layerwise.runtime.placeholders import is_unloaded, unload

__all__ = ["ModuleOffloader"]

Move = Callable[[torch.Tensor, torch.device], torch.Tensor]


def _default_move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device)


class ModuleOffloader:
    """Onloads module sets of ``model`` to ``execution_device`` around each piece."""

    def __init__(self, model: torch.nn.Module, execution_device: torch.device | str | None,
                 protected: Iterable[str] = (), move: Move = _default_move, source: Any = None,
                 keep_loaded: bool = False) -> None:
        self.model = model
        self.source = source
        self.keep_loaded = keep_loaded
        self.execution_device = canonical(execution_device)
        self.protected = set(protected)
        self._move = move
        self._modules = dict(model.named_modules(remove_duplicate=False))

    # -- which tensors --------------------------------------------------------------
    def _owners(self, names: Iterable[str]) -> list[tuple[str, torch.nn.Module]]:
        """Modules whose *direct* tensors belong to ``names`` (subtrees, minus protected ones)."""
        return [(name, module) for name, module, _ in self._selection(names)]

    def _selection(self, names: Iterable[str]) -> list[tuple[str, torch.nn.Module, set[str] | None]]:
        """(name, module, keys) per module with direct tensors in ``names``: ``keys`` ``None`` for all of them,
        else the parameter and buffer names one by one (a name that is a tensor, not a module)."""
        roots = list(dict.fromkeys(names))
        out: dict[int, tuple[str, torch.nn.Module, set[str] | None]] = {}
        single: dict[int, tuple[str, torch.nn.Module, set[str]]] = {}
        for root in roots:
            if root not in self._modules:
                owner, _, key = root.rpartition(".")
                module = self._modules.get(owner)
                if module is None or (key not in module._parameters and key not in module._buffers):
                    raise KeyError(f"no module, parameter or buffer named {root!r} in {type(self.model).__name__}")
                single.setdefault(id(module), (owner, module, set()))[2].add(key)
                continue
            for name, module in self._modules[root].named_modules(prefix=root):
                if name != root and self._is_protected(name, root):
                    continue
                out.setdefault(id(module), (name, module, None))
        for key, entry in single.items():
            out.setdefault(key, entry)  # a module moved whole already holds the tensor
        return list(out.values())

    def _is_protected(self, name: str, root: str) -> bool:
        """Is ``name`` inside a protected module that is not ``root`` itself (nor around it)?"""
        for p in self.protected:
            inside_p = name == p or name.startswith(p + ".") or p == ""
            root_inside_p = root == p or root.startswith(p + ".") or p == ""
            if inside_p and not root_inside_p:
                return True
        return False

    # -- moving ---------------------------------------------------------------------
    def _move_direct(self, module: torch.nn.Module, device: torch.device,
                     homes: dict[tuple[int, str, str], torch.device] | None, keys: set[str] | None = None) -> None:
        for kind, table in (("p", module._parameters), ("b", module._buffers)):
            for key, tensor in list(table.items()):
                if tensor is None or (keys is not None and key not in keys):
                    continue
                if self.source is not None and is_unloaded(tensor):
                    if homes is not None:
                        homes.setdefault((id(module), kind, key), _ON_DISK)
                    _replace(table, key, tensor, self.source.load(tensor, device))
                    continue
                if homes is not None:  # onloading: remember where it lives (a tied tensor: where it lived first)
                    homes.setdefault((id(module), kind, key), homes.setdefault((id(tensor), "", ""), tensor.device))
                if tensor.device == device:
                    continue
                _replace(table, key, tensor, self._move(tensor.data if kind == "p" else tensor, device))

    @contextlib.contextmanager
    def onloaded(self, names: Iterable[str]) -> Iterator[None]:
        """Inside the block, the tensors of modules ``names`` are on the execution device."""
        device = self.execution_device
        if device is None and self.source is not None:
            device = torch.device("cpu")
        if device is None:
            yield
            return
        owners = self._selection(names)
        homes: dict[tuple[int, str, str], torch.device] = {}
        try:
            for _, module, keys in owners:
                self._move_direct(module, device, homes, keys)
            yield
        finally:
            self._send_home(owners, homes, device)

    def _send_home(self, owners: list[tuple[str, torch.nn.Module, set[str] | None]],
                   homes: dict[tuple[int, str, str], torch.device], device: torch.device) -> None:
        fallback = next(iter(homes.values()), None)
        for name, module, keys in owners:
            retired = self.source is not None and self.source.is_retired(name)
            for kind, table in (("p", module._parameters), ("b", module._buffers)):
                for key, tensor in list(table.items()):
                    if tensor is None or (keys is not None and key not in keys):
                        continue
                    # tensors a modifier added meanwhile go where their neighbours live
                    home = homes.get((id(module), kind, key), fallback)
                    if home == _ON_DISK:
                        if retired or not self.keep_loaded:  # its values are (still) on disk
                            self.source.release(tensor)  # the pages read (or changed) go back to the system
                            unload(tensor)
                            continue
                        home = torch.device("cpu")  # a later piece runs it: keep what was loaded (or changed)
                    if home is None or tensor.device == home:
                        continue
                    _replace(table, key, tensor, self._move(tensor.data if kind == "p" else tensor, home))

    def retire(self, names: Iterable[str]) -> None:
        """Hand modules ``names`` (their subtrees, minus protected ones) to the source to be written: no
        later piece runs them. Without a source (weights in memory) nothing happens."""
        if self.source is not None:
            self.source.retire(self._owners(names))

    def nbytes(self, names: Iterable[str]) -> int:
        """Bytes of the tensors :meth:`onloaded` moves for ``names`` (unloaded ones counted by their shape)."""
        seen: set[int] = set()
        total = 0
        for _, module, keys in self._selection(names):
            for table in (module._parameters, module._buffers):
                for key, tensor in table.items():
                    if tensor is None or (keys is not None and key not in keys) or id(tensor) in seen:
                        continue
                    seen.add(id(tensor))
                    total += tensor.numel() * tensor.element_size()
        return total

    def is_noop(self) -> bool:
        """True when every tensor already rests on the execution device."""
        if self.execution_device is None:
            return True
        return all(t.device == self.execution_device
                   for t in list(self.model.parameters()) + list(self.model.buffers()))


#: the "home" of a weight read from the checkpoint: it is unloaded again once written
_ON_DISK = torch.device("meta")


def _replace(table: dict, key: str, old: torch.Tensor, new: torch.Tensor) -> None:
    """Put ``new`` in ``table[key]``, keeping the tensor object where the tensor types allow it.

    cpu <-> cuda: ``old.data`` is swapped in place, so every holder of the tensor (a
    modifier's reference, a traced subgraph's ``get_attr`` of a parameter or buffer)
    sees the moved data. Otherwise (e.g. meta) a new tensor replaces it, as
    ``nn.Module._apply`` does.
    """
    if torch._has_compatible_shallow_copy_type(old, new):
        old.data = new
    elif isinstance(old, nn.Parameter):
        table[key] = nn.Parameter(new, requires_grad=old.requires_grad)
    else:
        table[key] = new
