"""AutoRound: learned rounding and clipping for a block's weights, by signed gradient descent.

AutoRound (Cheng et al., 2023, "Optimize weight rounding via signed gradient descent") quantizes
each weight of a block as ``q = clamp(round(w / s + v) + z, qmin, qmax)``, where

* ``v`` (one per weight element, in ``[-0.5, 0.5]``) moves the rounding up or down;
* the scale ``s`` and zero point ``z`` come from the weight's range shrunk by learned factors:
  ``max * alpha`` and ``min * beta`` (one each per quantization group, in ``[0.5, 1]``), with the
  same formulas as round-to-nearest (:func:`~layerwise.algorithms.quantization.qmath.compute_qparams`).

All of a block's ``v``, ``alpha`` and ``beta`` are tuned together to make the block with
fake-quantized weights reproduce the block's own (unquantized) outputs: the loss is the mean
squared error over the cached samples. Each step takes ``batch_size`` samples, adds their
gradients (``round`` passes the gradient straight through) and moves every parameter by
``lr * sign(gradient)`` (SignSGD), the learning rate falling linearly to 0 over ``iters`` steps.
The parameters of the step with the lowest loss are kept; at the end the kept ones and the
round-to-nearest start (``v = 0``, ``alpha = beta = 1``) are scored on every sample and the better
is used, so the block is never further from its outputs than round-to-nearest leaves it.

Speed: a step is the block's forward and backward on its samples plus the fake quantization of its
weights. The samples of a step run as one stacked call where the block gives the same outputs that
way (:mod:`~layerwise.algorithms.quantization.stacked_calls`), and the fake quantization's gradients
come from one fused backward (:class:`_RoundedGrid`), so what is left is mostly the matmuls. With
``compile=True`` a step's fake quantization, block forward and loss (and their backward) go through
``torch.compile``, which fuses the elementwise work between the matmuls (the block's norms, rotary
embedding, gated activation, the fake quantization): about a sixth of a step on a small Llama block,
for one compilation per block class and shape (tens of seconds cold; a C++ compiler is needed on CPU).
With ``step_dtype=torch.bfloat16`` (or ``float16``) a step's forward runs under ``torch.autocast``: the
matmuls take that dtype (a float32 model's on a CPU with native bfloat16, or a GPU, run two to three
times faster), while the learned parameters, the fake quantization, the loss and the gradients stay
float32, as auto-round's ``amp`` does. The kept parameters are still scored in the block's own dtype.

The functions here take a block, its layers' args and the samples; they change nothing until
:func:`quantize_learned` is called per layer by the caller (the modifier stores the result).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.qmath import integer_qparams, qrange, weight_min_max
from layerwise.algorithms.quantization.stacked_calls import same_outputs, signature, stack_calls

log = logging.getLogger("layerwise")

#: the ranges the parameters are kept in (the paper's)
OFFSET_RANGE = (-0.5, 0.5)
CLIP_RANGE = (0.5, 1.0)


class AutoRoundError(ValueError):
    """A block cannot be tuned (no samples, a weight strategy AutoRound does not learn)."""


@dataclass
class Rounding:
    """One layer's learned parameters: rounding offsets ``offset`` (the weight's ``(out, in)`` shape) and
    clipping factors of the maximum (``max_scale``) and minimum (``min_scale``), one per qparam."""

    offset: Tensor
    max_scale: Tensor
    min_scale: Tensor

    @staticmethod
    def start(weight: Tensor, args: QuantizationArgs) -> Rounding:
        """Round-to-nearest: no offset, the whole range."""
        low, _ = weight_min_max(weight, args)
        return Rounding(torch.zeros(weight.shape, dtype=torch.float32, device=weight.device),
                        torch.ones(low.shape, dtype=torch.float32, device=weight.device),
                        torch.ones(low.shape, dtype=torch.float32, device=weight.device))

    def tensors(self) -> list[Tensor]:
        return [self.offset, self.max_scale, self.min_scale]

    def clone(self) -> Rounding:
        return Rounding(*(t.detach().clone() for t in self.tensors()))


@dataclass
class BlockSample:
    """One cached call of the block: its positional and keyword inputs, and its unquantized output."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: Tensor


@dataclass
class TuneResult:
    """What tuning a block found: the kept parameters per layer and how well they do."""

    roundings: dict[str, Rounding]
    #: mean squared error over every sample with the kept parameters, and with round-to-nearest
    loss: float
    rtn_loss: float
    #: the step whose parameters were kept (-1: round-to-nearest, the start, was kept: no step did better)
    best_step: int
    seconds: float


def check_autoround_args(args: QuantizationArgs) -> None:
    """AutoRound learns integer weights with a scale per channel or per group."""
    if args.type != "int" or args.strategy not in ("channel", "group"):
        raise AutoRoundError(f"AutoRound learns integer weights with strategy 'channel' or 'group', got type "
                             f"{args.type!r} strategy {args.strategy!r}; use W4A16 or W4A16_ASYM (num_bits: 3 or 2 for 3 or 2 bits)")


def _round_ste(x: Tensor) -> Tensor:
    """``round(x)`` forward, identity backward (the straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


def _grouped(x: Tensor, args: QuantizationArgs) -> Tensor:
    """An ``(out, in)`` tensor as ``(out, groups, columns)``: one quantization group per middle index."""
    columns = x.shape[1] if args.strategy == "channel" else args.group_size
    return x.reshape(x.shape[0], x.shape[1] // columns, columns)


def _ranges(weight: Tensor, args: QuantizationArgs) -> tuple[Tensor, Tensor, Tensor]:
    """The weight grouped (float32) and each group's minimum and maximum (``(out, groups, 1)``)."""
    grouped = _grouped(weight.detach().to(torch.float32), args)
    return grouped, grouped.amin(dim=-1, keepdim=True), grouped.amax(dim=-1, keepdim=True)


def _qparams(low: Tensor, high: Tensor, args: QuantizationArgs, rounding: Rounding) -> tuple[Tensor, Tensor]:
    """Scale and zero point (``(out, groups, 1)``, float32) of groups spanning ``[low, high]`` clipped by
    ``rounding``: ``integer_qparams``, differentiable in the clipping factors (straight-through rounding)."""
    low = low * rounding.min_scale.reshape(low.shape)
    high = high * rounding.max_scale.reshape(high.shape)
    return integer_qparams(low, high, args, _round_ste)


class _RoundedGrid(torch.autograd.Function):
    """``(clamp(round(w / s + v) + z, qmin, qmax) - z) * s`` over grouped weights ``w`` (``(out, groups,
    columns)``; ``s``, ``z``: ``(out, groups, 1)``) with straight-through rounding.

    The same values as those ops one by one, but the backward pass gives the gradients of ``v``, ``s``
    and ``z`` directly in a few passes over the weight, where autograd's chain takes some fifteen and
    allocates as many weight-sized tensors (on a small block that is a fifth of a step's time):
    with ``m`` the clamp's pass-through mask and ``G`` the incoming gradient,

    * ``dv = G s m``;
    * ``ds = sum(G (q - z)) - sum(dv w) / s^2`` (the scale divides ``w`` and multiplies the grid);
    * ``dz = sum(dv) - sum(G s)`` (the zero point shifts the grid and is taken off again).
    """

    @staticmethod
    def forward(ctx: Any, grouped: Tensor, offset: Tensor, scale: Tensor, zero_point: Tensor | None,
                qmin: float, qmax: float, learning: bool) -> Tensor:
        values = torch.addcdiv(offset, grouped, scale).round_()  # offset + w / s: the same float as w / s + offset
        if zero_point is not None:
            values.add_(zero_point)
        grid = torch.clamp(values, qmin, qmax)  # (scalar bounds: clamping to qmin - z, qmax - z is twice as slow)
        passed = torch.eq(values, grid, out=values) if learning else None  # 1 where the clamp let it through
        if zero_point is not None:
            grid.sub_(zero_point)
        if learning:
            ctx.save_for_backward(grouped, scale, passed, grid)
        return grid * scale

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        grouped, scale, passed, grid = ctx.saved_tensors
        grad_offset = grad * scale
        shifted = grad_offset.sum(-1, keepdim=True) if ctx.needs_input_grad[3] else None
        grad_offset.mul_(passed)
        grad_scale = grad_zero = None
        if ctx.needs_input_grad[2]:
            grad_scale = _row_dots(grad, grid) - _row_dots(grad_offset, grouped) / (scale * scale)
        if shifted is not None:
            grad_zero = grad_offset.sum(-1, keepdim=True) - shifted
        return None, grad_offset if ctx.needs_input_grad[1] else None, grad_scale, grad_zero, None, None, None


def _row_dots(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1, keepdim=True)`` as one batched matmul (no product tensor; a sixth faster)."""
    return torch.matmul(a.unsqueeze(-2), b.unsqueeze(-1)).squeeze(-1)


def _fake_grouped(grouped: Tensor, low: Tensor, high: Tensor, args: QuantizationArgs, rounding: Rounding,
                  scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(q - z) * s`` of a grouped weight (``(out, in)``, float32), with its scale and zero point."""
    learned, zero_point = _qparams(low, high, args, rounding)
    scale = learned if scale is None else scale
    offset = _grouped(rounding.offset, args)
    learning = torch.is_grad_enabled() and any(t.requires_grad for t in (offset, scale, zero_point))
    values = _RoundedGrid.apply(grouped, offset, scale, None if args.symmetric else zero_point, *qrange(args),
                                learning)
    return values.reshape(rounding.offset.shape), scale, zero_point


def fake_quantize_learned(weight: Tensor, args: QuantizationArgs, rounding: Rounding) -> Tensor:
    """The weight's values with the learned rounding (float32, differentiable in ``rounding``)."""
    return _fake_grouped(*_ranges(weight, args), args, rounding)[0]


@torch.no_grad()
def quantize_learned(weight: Tensor, args: QuantizationArgs, rounding: Rounding,
                     scale_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The stored form: fake-quantized weight (float32, exactly ``(q - z) * scale``), scale (in
    ``scale_dtype``, as the checkpoint keeps it; qparam shape) and zero point, for
    ``set_quantized_weight(on_grid=True)``."""
    grouped, low, high = _ranges(weight, args)
    scale, _ = _qparams(low, high, args, rounding)
    scale = scale.to(scale_dtype).to(torch.float32)  # the values are computed with the scale that is saved
    values, scale, zero_point = _fake_grouped(grouped, low, high, args, rounding, scale)
    return values, scale.squeeze(-1).to(scale_dtype), zero_point.squeeze(-1)


def block_output(output: Any) -> Tensor:
    """A block's hidden states: the output itself or its first element (tuple / ModelOutput)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    first = next(iter(output.values()), None) if hasattr(output, "values") else None
    if isinstance(first, Tensor):
        return first
    raise AutoRoundError(f"cannot find the hidden states in a block output of type {type(output).__name__}")


class _Layers:
    """A block's layers as the tuning sees them: each weight grouped with its ranges, computed once."""

    def __init__(self, layers: dict[str, tuple[Tensor, QuantizationArgs, bool]]) -> None:
        self.layers = layers
        self.ranges = {name: _ranges(weight, args) for name, (weight, args, _) in layers.items()}

    def replaced(self, roundings: dict[str, Rounding]) -> dict[str, Tensor]:
        """Each layer's weight (by its parameter name in the block) fake-quantized with ``roundings``."""
        out = {}
        for name, (weight, args, transposed) in self.layers.items():
            values = _fake_grouped(*self.ranges[name], args, roundings[name])[0].to(weight.dtype)
            out[f"{name}.weight"] = values.t() if transposed else values
        return out


def _loss(block: torch.nn.Module, replaced: dict[str, Tensor], sample: BlockSample) -> Tensor:
    """Mean squared error of the block with ``replaced`` weights against the sample's unquantized output."""
    output = block_output(torch.func.functional_call(block, replaced, sample.args, sample.kwargs, strict=False))
    return torch.nn.functional.mse_loss(output.to(torch.float32), sample.target.to(torch.float32))


def _quantized_loss(block: torch.nn.Module, layers: _Layers, roundings: dict[str, Rounding],
                    sample: BlockSample) -> Tensor:
    """:func:`_loss` with the weights fake-quantized by ``roundings``: a step's whole forward in one
    function, so that a compiler sees (and fuses) the fake quantization, the block and the loss together."""
    return _loss(block, layers.replaced(roundings), sample)


@functools.cache
def _compiled_loss() -> Callable[..., Tensor]:
    """:func:`_quantized_loss` through ``torch.compile``, made once per process: blocks of one class and
    one stacked shape reuse its graphs (their weights are inputs, not constants), so a model compiles once."""
    return torch.compile(_quantized_loss, dynamic=False)


def _rows(sample: BlockSample) -> int:
    return sample.target.shape[0] if sample.target.ndim else 1


class _Batches:
    """Runs a step's samples, those of one :func:`~.stacked_calls.signature` as one stacked call (one
    weight-gradient matmul per Linear instead of one per sample and their sum) where stacking keeps the
    block's outputs: checked once per signature, on the first group met, with the block's own weights."""

    def __init__(self, block: torch.nn.Module, samples: Sequence[BlockSample], compile: bool = False,
                 step_dtype: torch.dtype | None = None) -> None:
        self.block, self.samples = block, samples
        self.keys = [(signature(s.args, s.kwargs, _rows(s)), tuple(s.target.shape[1:]), s.target.dtype)
                     for s in samples]
        self.stacks: dict[Any, bool] = {}
        #: a step whose samples run as one call runs it through torch.compile (see step_loss)
        self.compile = compile
        #: the dtype a step's forward is autocast to (None: none)
        self.step_dtype = step_dtype

    def _autocast(self) -> contextlib.AbstractContextManager:
        """The context a step's forward runs in: ``torch.autocast`` to :attr:`step_dtype` on the samples' device."""
        if self.step_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.samples[0].target.device.type, dtype=self.step_dtype)

    def step_loss(self, layers: _Layers, roundings: dict[str, Rounding], indices: Sequence[int]) -> Tensor:
        """:meth:`loss` with the weights fake-quantized by ``roundings``; a step whose samples run as one
        call is one :func:`_quantized_loss` (compiled with :attr:`compile`), the same mean. The forward runs
        autocast to :attr:`step_dtype` (its backward, called after, runs each op in its forward's dtype)."""
        with self._autocast():
            groups = self._groups(indices)
            if len(groups) == 1:
                ((key, group),) = groups.items()
                single = group[0] if len(group) == 1 else self._stacked(key, group)
                if single is not None:
                    run = _compiled_loss() if self.compile else _quantized_loss
                    return run(self.block, layers, roundings, single)
            return self.loss(layers.replaced(roundings), indices)

    def _groups(self, indices: Sequence[int]) -> dict[Any, list[BlockSample]]:
        groups: dict[Any, list[BlockSample]] = {}
        for index in indices:
            groups.setdefault(self.keys[index], []).append(self.samples[index])
        return groups

    def loss(self, replaced: dict[str, Tensor], indices: Sequence[int]) -> Tensor:
        """The mean over ``indices`` of each sample's mean squared error."""
        groups = self._groups(indices)
        total: Tensor | float = 0.0
        for key, group in groups.items():
            stacked = self._stacked(key, group) if len(group) > 1 else None
            if stacked is None:
                total = total + sum(_loss(self.block, replaced, s) for s in group)
            else:
                total = total + _loss(self.block, replaced, stacked) * len(group)
        return total / len(indices)

    def _stacked(self, key: Any, group: list[BlockSample]) -> BlockSample | None:
        if self.stacks.get(key) is False:
            return None
        call = stack_calls([(s.args, s.kwargs, _rows(s)) for s in group])
        stacked = None if call is None else BlockSample(*call, torch.cat([s.target for s in group]))
        if key not in self.stacks:
            self.stacks[key] = stacked is not None and self._keeps_outputs(group[:2])
        return stacked if self.stacks[key] else None

    @torch.no_grad()
    def _keeps_outputs(self, probe: list[BlockSample]) -> bool:
        """Whether two samples stacked give their separate outputs: what could differ (a value shared or
        broadcast wrongly along the batch) differs from two on, and a check on all of a step's samples
        cost as many block forwards again (2 s of a 6-block model's AutoRound)."""
        call = stack_calls([(s.args, s.kwargs, _rows(s)) for s in probe])
        if call is None:
            return False
        # in the block's own dtype: a step's autocast would round both sides and blur what is compared
        with torch.autocast(probe[0].target.device.type, enabled=False):
            try:
                together = block_output(self.block(*call[0], **call[1]))
            except Exception:  # noqa: BLE001 - a block that cannot take them stacked runs them one by one
                return False
            return same_outputs(together, [block_output(self.block(*s.args, **s.kwargs)) for s in probe])


@torch.no_grad()
def _total_loss(batches: _Batches, layers: _Layers, roundings: dict[str, Rounding], batch_size: int) -> float:
    replaced = layers.replaced(roundings)
    count = len(batches.samples)
    chunks = [range(i, min(i + batch_size, count)) for i in range(0, count, batch_size)]
    return sum(float(batches.loss(replaced, chunk)) * len(chunk) for chunk in chunks) / count


def sample_order(count: int, batch_size: int, iters: int, seed: int) -> list[list[int]]:
    """Which samples each step reads: walks through seeded permutations of the samples, a fresh one
    each time the last runs out (every sample read once per pass)."""
    generator = torch.Generator().manual_seed(seed)
    steps: list[list[int]] = []
    order: list[int] = []
    take = min(batch_size, count)
    for _ in range(iters):
        batch: list[int] = []
        while len(batch) < take:
            if not order:
                order = torch.randperm(count, generator=generator).tolist()
            batch.append(order.pop(0))
        steps.append(batch)
    return steps


def tune_block(block: torch.nn.Module, layers: dict[str, tuple[Tensor, QuantizationArgs, bool]],
               samples: Sequence[BlockSample], *, iters: int = 200, lr: float | None = None,
               minmax_lr: float | None = None, batch_size: int = 8, seed: int = 42, compile: bool = False,
               step_dtype: torch.dtype | None = None,
               progress: Callable[[int, float], None] | None = None) -> TuneResult:
    """Learn the rounding of ``layers`` (relative name in ``block`` -> (weight ``(out, in)``, args,
    stored transposed)) so that ``block`` reproduces each sample's ``target``.

    ``lr`` (offsets) defaults to ``1 / iters``, ``minmax_lr`` (clipping factors) to ``lr``; both fall
    linearly to 0 over the steps. Deterministic for a seed. Changes neither the block nor the weights.
    ``compile``: the steps through ``torch.compile`` (module docstring); where compiling fails the steps run
    as they are, with a warning. The compiled steps' float sums differ from the eager ones in rounding.
    ``step_dtype``: the steps' forward under ``torch.autocast`` in that dtype (module docstring; None: the
    block's own dtype). The parameters kept are scored, against round-to-nearest, without it.
    """
    if not samples:
        raise AutoRoundError("AutoRound needs at least one sample of the block's inputs")
    if iters < 0 or batch_size < 1:
        raise AutoRoundError(f"iters must be >= 0 and batch_size >= 1, got {iters} and {batch_size}")
    for _, args, _ in layers.values():
        check_autoround_args(args)
    start = time.perf_counter()
    lr = 1.0 / iters if lr is None and iters else (lr or 0.0)
    minmax_lr = lr if minmax_lr is None else minmax_lr
    roundings = {name: Rounding.start(weight, args) for name, (weight, args, _) in layers.items()}
    prepared, batches = _Layers(layers), _Batches(block, samples, compile, step_dtype)
    initial = {name: r.clone() for name, r in roundings.items()}
    best = {name: r.clone() for name, r in roundings.items()}
    frozen = [p for p in block.parameters() if p.requires_grad]  # only the rounding learns
    for p in frozen:
        p.requires_grad_(False)
    try:
        best, _, best_step = _descend(batches, prepared, roundings, best, iters, lr, minmax_lr, batch_size,
                                      seed, progress)
        rtn_loss = _total_loss(batches, prepared, initial, batch_size)
        best_step = -1 if best_step == 0 else best_step  # step 0 scored the start: round-to-nearest itself
        loss = _total_loss(batches, prepared, best, batch_size) if best_step >= 0 else rtn_loss
    finally:
        for p in frozen:
            p.requires_grad_(True)
    if loss > rtn_loss:
        best, loss, best_step = initial, rtn_loss, -1
    return TuneResult(best, loss, rtn_loss, best_step, time.perf_counter() - start)


def _descend(batches: _Batches, layers: _Layers, roundings: dict[str, Rounding], best: dict[str, Rounding],
             iters: int, lr: float, minmax_lr: float, batch_size: int, seed: int,
             progress: Callable[[int, float], None] | None) -> tuple[dict[str, Rounding], float, int]:
    """The signed-gradient steps; returns the parameters with the lowest step loss, that loss and its step."""
    best_loss, best_step = float("inf"), -1
    with torch.enable_grad():
        for r in roundings.values():
            for t in r.tensors():
                t.requires_grad_(True)
        for step, batch in enumerate(sample_order(len(batches.samples), batch_size, iters, seed)):
            total = _forward_backward(batches, layers, roundings, batch)
            if total < best_loss:
                best_loss, best_step = total, step
                _keep(best, roundings)
            decay = 1.0 - step / iters  # linear schedule: lr at the first step, lr / iters at the last
            with torch.no_grad():
                for r in roundings.values():
                    _sign_step(r.offset, lr * decay, OFFSET_RANGE)
                    _sign_step(r.max_scale, minmax_lr * decay, CLIP_RANGE)
                    _sign_step(r.min_scale, minmax_lr * decay, CLIP_RANGE)
            if progress is not None:
                progress(step, total)
    return best, best_loss, best_step


def _forward_backward(batches: _Batches, layers: _Layers, roundings: dict[str, Rounding],
                      indices: Sequence[int]) -> float:
    """One step's loss, its gradients left in ``roundings``; a compiled step that fails (no C++ compiler,
    an op the compiler cannot take) is run again uncompiled, and so are the steps after it."""
    try:
        loss = batches.step_loss(layers, roundings, indices)
        loss.backward()
    except Exception as exc:  # any failure of the compiler: the uncompiled step computes the same
        if not batches.compile:
            raise
        log.warning("AutoRound: compiling the step failed (%s: %s); the steps run uncompiled",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        batches.compile = False
        for rounding in roundings.values():
            for t in rounding.tensors():
                t.grad = None
        loss = batches.step_loss(layers, roundings, indices)
        loss.backward()
    return float(loss.detach())


@torch.no_grad()
def _keep(best: dict[str, Rounding], roundings: dict[str, Rounding]) -> None:
    """Copy ``roundings`` into ``best``'s tensors (no fresh weight-sized tensors each improving step)."""
    for name, rounding in roundings.items():
        for kept, value in zip(best[name].tensors(), rounding.tensors()):
            kept.copy_(value)


def _sign_step(param: Tensor, lr: float, bounds: tuple[float, float]) -> None:
    """SignSGD: ``param -= lr * sign(grad)``, kept within ``bounds``; the gradient is cleared. In place:
    ``param + (-lr) * sign`` is ``param - lr * sign`` exactly (``lr * sign`` is ``lr``, 0 or ``-lr``)."""
    if param.grad is not None:
        param.add_(param.grad.sign_(), alpha=-lr).clamp_(*bounds)
        param.grad = None
