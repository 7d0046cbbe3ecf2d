"""Hessian hooks: the inputs of a modifier's layers, folded into shared float32 Gram matrices.

Used by every modifier that solves with a layer's Hessian ``H = 2/n X^T X`` (GPTQ,
SparseGPT). Each layer gets a forward pre-hook that folds its inputs into the upper
triangle of ``X^T X`` (float32, every 256 tokens, at matmul speed); layers that read the
very same tensor (q/k/v projections, gate/up) share one matrix. An input holding NaN or
inf is left out (it would poison the matrix) and counted. The modifier takes a layer's
Hessian once, when it compresses the layer, and the matrix is freed when its last
member took it.

In a distributed run :meth:`HessianBank.reduce` sums the Gram matrices, their token counts and
the non-finite input counts over the ranks before a piece is compressed (a Gram is a sum over
tokens: the sum of the ranks' Grams is the Gram of all their tokens), so every rank then takes
the Hessian one process calibrating on every batch would have built.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable
from typing import Any

import torch

from layerwise.plugin import NonFiniteError, RecipeError, warn_user
from layerwise.plugin.calibration import (
    Accounting,
    NonFiniteSampleWarning,
    add_gram,
    gram_dtype,
    gram_flops,
    gram_strip,
    gram_to_hessian,
    is_finite,
)
from layerwise.plugin.pipelines import inputs_are_held


class HessianBank:
    """The Gram matrices of one run's Hessian layers, shared by every modifier that solves with them.

    One pre-hook per layer whatever the number of modifiers subscribing to it (SparseGPT then
    GPTQ in one recipe read the same Hessian: one product, one matrix). The first subscriber
    to take a layer's Hessian builds it and stops the hook; the others get the same matrix (the
    solvers do not modify it), and it is dropped when the last one took it.
    """

    def __init__(self) -> None:
        #: per layer, the (possibly shared between layers) Gram matrix of its inputs
        self.grams: dict[str, _SharedGram] = {}
        self.handles: dict[str, torch.utils.hooks.RemovableHandle] = {}
        #: per layer, the calibration inputs left out of its Hessian because they held NaN or inf
        self.non_finite: dict[str, int] = {}
        #: the previous hook's input, its float32 copy, and the Gram that took it
        self.last: tuple[torch.Tensor, int, torch.Tensor, _SharedGram] | None = None
        #: per layer, the subscribers (``id`` of the modifier) that have not taken its Hessian yet
        self.waiting: dict[str, set[int]] = {}
        #: per layer, a Hessian taken by one subscriber and still owed to others: (hessian, rows, dropped)
        self.taken: dict[str, tuple[torch.Tensor | None, int, int]] = {}
        #: per layer, the accounting phase its Gram work is timed under (its first subscriber's)
        self.phases: dict[str, str] = {}
        self.accounting = Accounting()
        self.gram_flops = _FlopCount()
        #: layers whose matrix was summed over the ranks already (distributed runs)
        self.reduced: set[str] = set()

    def subscribe(self, owner: HessianHooks, name: str, module: torch.nn.Module) -> None:
        """``owner`` will take layer ``name``'s Hessian; the first subscriber registers the hook."""
        self.waiting.setdefault(name, set()).add(id(owner))
        if name not in self.handles and name not in self.taken:
            self.phases[name] = owner.hessian_phase
            self.handles[name] = owner.register_hook(module, self._hook(name), "forward_pre", with_kwargs=True)

    def take(self, owner: HessianHooks, name: str) -> tuple[torch.Tensor | None, int, int]:
        """Layer ``name``'s Hessian, token count and non-finite inputs left out, for ``owner``."""
        waiting = self.waiting.get(name, set())
        waiting.discard(id(owner))
        if name in self.taken:
            result = self.taken[name]
        else:
            handle = self.handles.pop(name, None)
            if handle is not None:
                handle.remove()
            with self.work(self.phases.get(name, owner.hessian_phase)):
                hessian, samples = self.hessian(name)
            dropped = self.non_finite.pop(name, 0)
            if dropped:
                _warn_dropped(owner.label, name, dropped, hessian is None or samples == 0)
            result = (hessian, samples, dropped)
        if waiting:
            self.taken[name] = result
        else:
            self.taken.pop(name, None)
            self.waiting.pop(name, None)
        return result

    def _hook(self, name: str):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            x = layer_input(args, kwargs)
            if not isinstance(x, torch.Tensor) or not self.waiting.get(name) or name in self.taken:
                return
            # the tensor the previous layer read (q/k/v, gate/up) was found finite already
            if not self._read_last(x) and not is_finite(x):  # one NaN row would make the whole Hessian NaN
                self.non_finite[name] = self.non_finite.get(name, 0) + 1
                return
            with self.work(self.phases[name]):
                self._accumulate(name, x)
        return hook

    @contextlib.contextmanager
    def work(self, phase: str):
        """Time a Hessian step into the run's accounting, with the Gram FLOPs it did."""
        start, flops = time.perf_counter(), self.gram_flops.value
        try:
            yield
        finally:
            self.accounting.add(phase, time.perf_counter() - start, self.gram_flops.value - flops)

    def _read_last(self, x: torch.Tensor) -> bool:
        """Is ``x`` the very tensor (unchanged since) the previous hooked layer read?"""
        return read_last(self.last, x)

    @torch.no_grad()
    def _accumulate(self, name: str, x: torch.Tensor) -> None:
        last = self.last
        gram = self.grams.get(name)
        if gram is not None and gram.alone_and_idle() and x.numel() >= FLUSH_ROWS * x.shape[-1]:
            # a layer with its own matrix and a long input: fold it right away, no copy kept
            self.last = None
            gram.fold_now(name, x.detach().reshape(-1, x.shape[-1]).to(gram_dtype(x)))
            return
        if self._read_last(x):
            flat = last[2]  # the same tensor as the previous layer read (q/k/v, gate/up)
        else:
            # a copy, unless the pipeline holds ``x`` unchanged until the Hessian is taken: the model may
            # write into its activations in place after this hook, before the input is folded
            flat = x.detach().to(gram_dtype(x), memory_format=torch.contiguous_format, copy=not inputs_are_held())
            flat = flat.reshape(-1, flat.shape[-1])
        if gram is None and last is not None and last[2] is flat and last[3].joinable(flat):
            gram = last[3]  # first input, and the same one another layer just started with: share
            self.grams[name] = gram
            gram.join(name)
        else:
            if gram is None:
                gram = self.grams[name] = _SharedGram(self.gram_flops)
            gram = gram.read(name, flat, self.grams)
        self.last = (x, x._version, flat, gram)
        gram.fold_confirmed(FLUSH_ROWS)

    def hessian(self, name: str) -> tuple[torch.Tensor | None, int]:
        """The layer's Hessian ``2/n X^T X`` (``None`` without data) and ``n``; forgets its Gram."""
        gram = self.grams.pop(name, None)
        if gram is None:
            return None, 0
        return gram.take(name)

    @torch.no_grad()
    def rescale_inputs(self, names: Iterable[str], scales: torch.Tensor) -> None:
        """Layers ``names`` read ``x / scales`` from now on (a smoothing folded ``scales`` into their input
        columns): rescale what was gathered from their inputs so far, as if it had been read smoothed.

        Saves a second calibration pass (SmoothQuant then GPTQ in one recipe): each Gram ``G = X^T X``
        becomes ``D G D`` with ``D = diag(1 / scales)``, inputs not folded yet are divided, and a Hessian
        already taken but owed to another subscriber is rescaled the same way. A Gram shared by several
        of the layers is rescaled once; its members read one tensor, so all of them must be in ``names``.
        """
        factors = 1.0 / scales.detach().to(torch.float32)
        rescaled: set[int] = set()
        for name in names:
            gram = self.grams.get(name)
            if gram is not None and id(gram) not in rescaled:
                rescaled.add(id(gram))
                gram.rescale(factors)
            if name in self.taken:
                hessian, rows, dropped = self.taken[name]
                if hessian is not None:
                    f = factors.to(hessian.device)
                    hessian = hessian * f[:, None] * f[None, :]
                self.taken[name] = (hessian, rows, dropped)
        self.last = None  # the previous input's float32 copy is unscaled: never reuse it

    @torch.no_grad()
    def reduce(self, reducer: Any, layers: dict[str, torch.nn.Module]) -> None:
        """Sum the Gram matrices of ``layers`` (name -> module, the same on every rank) over the ranks.

        Layers whose Hessian was reduced or taken already are left alone (two modifiers sharing the
        bank both ask). Layers sharing one matrix are reduced once: the groups are those sharing on
        every rank. A rank without data for a layer contributes zeros. Afterwards each group holds
        the summed matrix and token count, its hooks are gone (no local input may join a reduced
        matrix) and the non-finite counts are the ranks' sum.
        """
        names = sorted(n for n in layers if n not in self.reduced and n not in self.taken and n in self.waiting)
        if not names:
            return
        self.last = None
        groups = _common_groups(reducer.gather(self._local_groups(names)), names)
        dropped = reducer.sum(torch.tensor([float(self.non_finite.get(n, 0)) for n in names], dtype=torch.float64))
        for name, count in zip(names, dropped.tolist(), strict=True):
            if count:
                self.non_finite[name] = int(count)
            else:
                self.non_finite.pop(name, None)
        for group in groups:
            gram, rows = self._full_gram(group[0], layers[group[0]])
            reducer.sum(gram)
            rows = int(reducer.count(rows))
            shared = _SharedGram(self.gram_flops)
            shared.gram, shared.samples = (gram, rows) if rows else (None, 0)
            shared.positions = dict.fromkeys(group, 0)
            for name in group:
                self.grams[name] = shared
                handle = self.handles.pop(name, None)
                if handle is not None:
                    handle.remove()
                self.reduced.add(name)

    def _local_groups(self, names: list[str]) -> list[list[str]]:
        """``names`` grouped by the matrix they share on this rank (a matrix whose members read different
        inputs, or a layer without one, stands alone)."""
        by_gram: dict[int, list[str]] = {}
        alone: list[list[str]] = []
        for name in names:
            gram = self.grams.get(name)
            if gram is None or len(set(gram.positions.values())) > 1:
                alone.append([name])
            else:
                by_gram.setdefault(id(gram), []).append(name)
        return [*by_gram.values(), *alone]

    def _full_gram(self, name: str, module: torch.nn.Module) -> tuple[torch.Tensor, int]:
        """Layer ``name``'s whole Gram matrix on this rank (a fresh tensor; zeros without data) and its rows."""
        gram = self.grams.get(name)
        if gram is not None:
            position = gram.positions.get(name, 0)
            if position > gram.folded:
                if all(p >= position for p in gram.positions.values()):
                    gram._fold(position - gram.folded)
                else:
                    x = torch.cat(gram.pending[:position - gram.folded])
                    own = (torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
                           if gram.gram is None else gram.gram.clone())
                    _add_gram(own, x, self.gram_flops)
                    return own, gram.samples + x.shape[0]
            if gram.gram is not None:
                return gram.gram.clone(), gram.samples
        width = module.weight.shape[0] if type(module).__name__ == "Conv1D" else module.weight.shape[-1]
        device = next((g.gram.device for g in self.grams.values() if g.gram is not None), torch.device("cpu"))
        return torch.zeros(width, width, dtype=torch.float32, device=device), 0

    def clear(self) -> None:
        """Forget every matrix and hook handle (the hooks themselves go with their modifiers')."""
        self.grams.clear()
        self.handles.clear()
        self.non_finite.clear()
        self.waiting.clear()
        self.taken.clear()
        self.reduced.clear()
        self.last = None


def _common_groups(per_rank: list[list[list[str]]], names: list[str]) -> list[list[str]]:
    """The layers that share one matrix on every rank, grouped (in ``names`` order): each rank's grouping refined."""
    keys: dict[str, list[int]] = {name: [] for name in names}
    for groups in per_rank:
        for index, group in enumerate(groups):
            for name in group:
                keys[name].append(index)
    merged: dict[tuple[int, ...], list[str]] = {}
    for name in names:
        merged.setdefault(tuple(keys[name]), []).append(name)
    return list(merged.values())


class HessianHooks:
    """Mixin for modifiers whose layers need their input Hessian; keeps no dataclass fields.

    The modifier calls :meth:`_init_hessians` from ``__post_init__``, :meth:`_hook_hessians`
    at calibration start, :meth:`_take_hessian` when it compresses a layer, and
    :meth:`_free_all` on reset; ``self._done`` names the layers already compressed. The
    matrices live in the run's :class:`HessianBank` (``state.extensions[HessianBank]``), shared with the
    other modifiers of the recipe that read the same layers.
    """

    #: the accounting phase the Gram work is timed under (see layerwise.runtime.accounting)
    hessian_phase = "Hessians"
    #: how warnings and errors name the modifier
    label = "Hessian"
    _done: set[str]
    _modules: dict[str, torch.nn.Module]
    block_size: int
    dampening_frac: float
    register_hook: Any

    def _check_solver_fields(self) -> None:
        """``block_size`` (an int >= 1) and ``dampening_frac`` (a number >= 0): errors naming the field."""
        owner, block_size, dampening = type(self).__name__, self.block_size, self.dampening_frac
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise RecipeError(f"{owner}.block_size must be a positive integer, got {block_size!r}")
        if (isinstance(dampening, bool) or not isinstance(dampening, (int, float)) or not math.isfinite(dampening)
                or dampening < 0):
            raise RecipeError(f"{owner}.dampening_frac must be a number >= 0 (typically 0.01), got {dampening!r}")

    def _init_hessians(self) -> None:
        self._bank = HessianBank()

    @property
    def _accounting(self) -> Accounting:
        """The run's accounting (from calibration_start on): where the Hessian and solve time goes."""
        return self._bank.accounting

    @property
    def _grams(self) -> dict[str, _SharedGram]:
        return self._bank.grams

    @property
    def _last(self) -> tuple | None:
        return self._bank.last

    @_last.setter
    def _last(self, value: tuple | None) -> None:
        self._bank.last = value

    def _hook_hessians(self, state, modules: dict[str, torch.nn.Module]) -> None:
        """Join the run's bank (the first modifier creates it) and subscribe to the layers not compressed yet."""
        extensions = getattr(state, "extensions", None)  # a test's bare state may have none: no sharing
        shared = extensions.get(HessianBank) if extensions is not None else None
        if shared is None:
            accounting = getattr(state, "accounting", None)
            self._bank.accounting = accounting if accounting is not None else Accounting()
            if extensions is not None:
                extensions[HessianBank] = self._bank
        else:
            self._bank = shared
        for name, module in modules.items():
            if name not in self._done:
                self._bank.subscribe(self, name, module)

    def _reduce_hessians(self, reducer: Any, modules: list[str] | None) -> None:
        """Sum the Grams of this modifier's layers in ``modules`` (``None``: all not compressed) over the ranks."""
        from .quantization import _in_piece

        layers = {name: module for name, module in self._modules.items()
                  if name not in self._done and (modules is None or _in_piece(name, modules))}
        self._bank.reduce(reducer, layers)

    def _take_hessian(self, name: str) -> tuple[torch.Tensor | None, int, int]:
        """The layer's Hessian, token count (``None, 0`` without data) and inputs left out as non-finite.

        Left-out inputs are a warning naming the layer, or a :class:`NonFiniteError` when no
        finite input was left.
        """
        return self._bank.take(self, name)

    def _hessian(self, name: str) -> tuple[torch.Tensor | None, int]:
        """The layer's Hessian and row count, straight from the bank, no subscriber bookkeeping (tests read it)."""
        return self._bank.hessian(name)

    def _free_all(self) -> None:
        """Forget this modifier's matrices: a fresh bank of its own (the run's is joined at calibration start)."""
        self._bank.clear()
        self._bank = HessianBank()


def read_last(last: tuple | None, x: torch.Tensor) -> bool:
    """Is ``x`` the tensor a hook recorded as ``last = (tensor, its version, ...)``, not written to since?

    Layers reading one value one after another (q/k/v, gate/up) get the very same tensor: what was
    computed from it for the first can serve the others, unless something wrote into it in between.
    """
    return last is not None and last[0] is x and last[1] == x._version


def layer_input(args: tuple, kwargs: dict) -> Any:
    """What a layer's forward pre-hook sees as its input: the first positional argument, else ``input=``,
    else the first keyword argument."""
    return args[0] if args else kwargs.get("input", next(iter(kwargs.values()), None))


def _warn_dropped(label: str, name: str, dropped: int, none_left: bool, statistic: str = "Hessian") -> None:
    """Non-finite calibration inputs of one layer: a warning, or an error when no finite one was left.

    ``statistic``: what the inputs were left out of (GPTQ's Hessian, Wanda's input norms).
    """
    if none_left:
        raise NonFiniteError(f"{label}: every calibration input of layer {name!r} ({dropped}) held NaN or inf, so "
                             f"there is no data to calibrate it with; the model's forward is not finite on this "
                             f"data (a non-finite weight upstream, or float16 overflow: load it in bfloat16 or "
                             f"float32)")
    message = (f"{label}: layer {name!r}: {dropped} calibration input(s) held NaN or inf and were left out of its "
               f"{statistic}")
    warn_user(message, NonFiniteSampleWarning)


class _FlopCount:
    """FLOPs of the Gram products so far (shared by a modifier's Gram matrices)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


def _add_gram(gram: torch.Tensor, x: torch.Tensor, flops: _FlopCount) -> None:
    add_gram(gram, x)
    flops.value += gram_flops(x.shape[0], x.shape[1], gram_strip(x.shape[1], x.device))


#: inputs are folded into a Gram matrix once this many rows (tokens) are waiting: products this
#: tall run near the machine's peak, and the matrix is read and written once per fold, not per batch
FLUSH_ROWS = 512  # 256 ran a 384-input Gram at 70 % of the speed of 512 (K of the products too short)


class _SharedGram:
    """The Gram matrix ``X^T X`` (upper triangle) of the inputs one or more layers read.

    Layers that read the very same tensors (q/k/v projections, gate/up) share one
    instance: one product, one matrix. Each member's position counts the inputs it
    has read; an input is folded into the matrix only once every member read it, so
    a member whose inputs stop matching (never seen in practice) splits off with an
    exact copy of its own history.
    """

    __slots__ = ("first", "flops", "folded", "gram", "pending", "positions", "samples")

    def __init__(self, flops: _FlopCount) -> None:
        self.flops = flops
        self.first: torch.Tensor | None = None          # the only input so far (``None`` once there are two)
        self.gram: torch.Tensor | None = None
        self.samples = 0                                # rows folded into ``gram``
        self.pending: list[torch.Tensor] = []           # inputs not folded yet, in order
        self.folded = 0                                 # inputs folded (index of pending[0])
        self.positions: dict[str, int] = {}             # member -> inputs it has read

    def joinable(self, flat: torch.Tensor) -> bool:
        """Has this Gram seen exactly one input, ``flat`` (folded already or not)?"""
        return self.folded + len(self.pending) == 1 and self.first is flat

    def join(self, name: str) -> None:
        """A new member whose first input is this Gram's only one (see :meth:`joinable`)."""
        self.positions[name] = 1

    def read(self, name: str, flat: torch.Tensor, owners: dict[str, _SharedGram]) -> _SharedGram:
        """Member ``name`` read ``flat``; returns the Gram that holds its history now."""
        position = self.positions.get(name, 0)
        end = self.folded + len(self.pending)
        if position == end:
            self.first = flat if end == 0 else None
            self.pending.append(flat)
        elif self.pending[position - self.folded] is not flat:
            return self._split(name, position, flat, owners)
        self.positions[name] = position + 1
        return self

    def _split(self, name: str, position: int, flat: torch.Tensor, owners: dict[str, _SharedGram]) -> _SharedGram:
        mine = _SharedGram(self.flops)
        mine.gram = None if self.gram is None else self.gram.clone()
        mine.samples, mine.folded = self.samples, self.folded
        mine.pending = [*self.pending[:position - self.folded], flat]
        mine.positions[name] = position + 1
        del self.positions[name]
        owners[name] = mine
        return mine

    def rescale(self, factors: torch.Tensor) -> None:
        """Every input becomes ``x * factors`` (per column), folded or pending: the matrix becomes ``D G D``."""
        if self.gram is not None:
            f = factors.to(self.gram.device)
            self.gram.mul_(f[:, None]).mul_(f[None, :])
        self.pending = [x * factors.to(x.device) for x in self.pending]
        self.first = None  # the input a new member could join on is gone (replaced by its rescaled copy)

    def alone_and_idle(self) -> bool:
        """One member, nothing waiting, and past its first input (when another layer could have joined)."""
        return len(self.positions) == 1 and not self.pending and self.folded > 0

    def fold_now(self, name: str, x: torch.Tensor) -> None:
        """Fold the sole member's next input directly."""
        _add_gram(self.gram, x, self.flops)
        self.samples += x.shape[0]
        self.folded += 1
        self.positions[name] += 1

    def fold_confirmed(self, min_rows: int) -> None:
        """Fold the inputs every member has read, once they add up to ``min_rows`` rows."""
        ready = min(self.positions.values()) - self.folded
        if ready and sum(t.shape[0] for t in self.pending[:ready]) >= min_rows:
            self._fold(ready)

    def _fold(self, count: int) -> None:
        chunk = self.pending[:count]
        x = chunk[0] if len(chunk) == 1 else torch.cat(chunk)
        if self.gram is None:
            self.gram = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
        _add_gram(self.gram, x, self.flops)
        self.samples += x.shape[0]
        del self.pending[:count]
        self.folded += count

    def take(self, name: str) -> tuple[torch.Tensor | None, int]:
        """Member ``name``'s Hessian and row count; it leaves the group."""
        position = self.positions.pop(name)
        others_caught_up = all(p >= position for p in self.positions.values())
        if others_caught_up:  # fold for everyone: the next member reuses the work
            if position > self.folded:
                self._fold(position - self.folded)
            if self.gram is None:
                return None, 0
            return gram_to_hessian(self.gram, self.samples), self.samples
        mine = self.gram.clone() if self.gram is not None else None
        rows = self.samples
        chunk = self.pending[:position - self.folded]
        if chunk:
            x = torch.cat(chunk)
            mine = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device) if mine is None else mine
            _add_gram(mine, x, self.flops)
            rows += x.shape[0]
        return (None, 0) if mine is None else (gram_to_hessian(mine, rows), rows)
