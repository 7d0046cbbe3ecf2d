"""Moving the modules of one piece of the model to the execution device and back.

During calibration the execution device (the GPU where there is one) holds only
the modules of the piece being calibrated; every other weight rests where it was
loaded (its *home* device, usually CPU). :meth:`ModuleOffloader.onloaded` moves a
set of modules' parameters and buffers to the execution device for the duration
of a ``with`` block and sends them home afterwards -- including whatever a
modifier changed or added meanwhile (a quantized weight, ``weight_scale``).

Parameters keep their identity (``param.data`` is swapped), so hooks and
references that modifiers hold stay valid. When home and execution device are
the same (the CPU-only case) nothing moves.

``protected`` names modules that belong to *other* pieces (the sequential
targets): onloading an ancestor of them (the whole model, to capture the first
target's inputs) moves everything except them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

__all__ = ["ModuleOffloader"]

Move = Callable[[torch.Tensor, torch.device], torch.Tensor]


def _default_move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device)


class ModuleOffloader:
    """Onloads module sets of ``model`` to ``execution_device`` around each piece."""

    def __init__(self, model: torch.nn.Module, execution_device: torch.device | str | None,
                 protected: Iterable[str] = (), move: Move = _default_move) -> None:
        self.model = model
        self.execution_device = torch.device(execution_device) if execution_device is not None else None
        self.protected = set(protected)
        self._move = move
        self._modules = dict(model.named_modules(remove_duplicate=False))

    # -- which tensors --------------------------------------------------------------
    def _owners(self, names: Iterable[str]) -> list[tuple[str, torch.nn.Module]]:
        """Modules whose *direct* tensors belong to ``names`` (subtrees, minus protected ones)."""
        roots = list(dict.fromkeys(names))
        out: dict[int, tuple[str, torch.nn.Module]] = {}
        for root in roots:
            if root not in self._modules:
                raise KeyError(f"no module named {root!r} in {type(self.model).__name__}")
            for name, module in self._modules[root].named_modules(prefix=root):
                if name != root and self._is_protected(name, root):
                    continue
                out.setdefault(id(module), (name, module))
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
                     homes: dict[tuple[int, str, str], torch.device] | None) -> None:
        for kind, table in (("p", module._parameters), ("b", module._buffers)):
            for key, tensor in list(table.items()):
                if tensor is None:
                    continue
                if homes is not None:  # onloading: remember where it lives
                    homes.setdefault((id(module), kind, key), tensor.device)
                if tensor.device == device:
                    continue
                _replace(table, key, tensor, self._move(tensor.data if kind == "p" else tensor, device))

    @contextlib.contextmanager
    def onloaded(self, names: Iterable[str]) -> Iterator[None]:
        """Inside the block, the tensors of modules ``names`` are on the execution device."""
        device = self.execution_device
        if device is None:
            yield
            return
        owners = self._owners(names)
        homes: dict[tuple[int, str, str], torch.device] = {}
        try:
            for _, module in owners:
                self._move_direct(module, device, homes)
            yield
        finally:
            self._send_home(owners, homes, device)

    def _send_home(self, owners: list[tuple[str, torch.nn.Module]],
                   homes: dict[tuple[int, str, str], torch.device], device: torch.device) -> None:
        fallback = next(iter(homes.values()), None)
        for _, module in owners:
            for kind, table in (("p", module._parameters), ("b", module._buffers)):
                for key, tensor in list(table.items()):
                    if tensor is None:
                        continue
                    # tensors a modifier added meanwhile go where their neighbours live
                    home = homes.get((id(module), kind, key), fallback)
                    if home is None or tensor.device == home:
                        continue
                    _replace(table, key, tensor, self._move(tensor.data if kind == "p" else tensor, home))

    def is_noop(self) -> bool:
        """True when every tensor already rests on the execution device."""
        if self.execution_device is None:
            return True
        return all(t.device == self.execution_device
                   for t in list(self.model.parameters()) + list(self.model.buffers()))


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
