"""The GPTQ solver: quantize a weight column by column, pushing each column's error onto the rest.

Pure tensor math, no modules: :func:`accumulate_hessian` (or :func:`add_gram` then
:func:`gram_to_hessian`) builds a layer's Hessian from its inputs; :func:`gptq_quantize`
turns a ``(out, in)`` weight and that Hessian into fake-quantized values plus
compressed-tensors qparams.

For a linear layer with inputs ``X`` (``in x n``), GPTQ minimises ``||W X - Q X||^2``
one input column at a time: column ``j`` is rounded to the grid, and the rounding
error, weighted by the inverse Hessian ``H^-1 = (2 X X^T / n)^-1``, is subtracted from
the columns not quantized yet. With an upper Cholesky factor ``U`` of ``H^-1`` the
update for column ``j`` is ``W[:, j+1:] -= ((w_j - q_j) / U[j, j]) U[j, j+1:]``.
Columns are processed in blocks of ``block_size``: inside a block the updates reach
the next few columns one by one and the rest of the block once per 16 columns; the
columns after the block get the whole block's errors in one matrix product (the
"lazy batch" update). The result equals the column-by-column algorithm up to
floating-point rounding (a test checks it against a plain float64 reference).

Details, in the order they are applied:

* dead inputs: a column whose Hessian diagonal is 0 never saw a nonzero input; its
  diagonal becomes 1 and its weights 0 (exact on the grid, and harmless);
* activation order (``args.actorder``): ``"static"`` solves the columns in descending
  order of the Hessian diagonal but keeps groups of contiguous original columns, so
  the checkpoint needs no group index; ``"group"`` also forms the groups in that
  order, which needs a group index (``g_idx``) per column;
* dampening: ``dampening_frac`` times the mean diagonal is added to the diagonal;
  when a Cholesky factorisation still fails the dampening is raised tenfold, twice,
  before :class:`GPTQError` is raised (the caller falls back to round-to-nearest);
* qparams: ``tensor`` / ``channel`` scales, and the groups of ``"static"``, come
  from the whole (dead-column-zeroed) weight up front; other groups are observed
  when the solve reaches their first column, on the weights already updated by the
  error of every earlier column (the original GPTQ recipe).

The integer grid, rounding and ranges are those of :mod:`.qmath`, so with an identity
Hessian (no correlation between inputs) the result equals round-to-nearest bit for bit.

Launches: the column loop (:class:`_ColumnLoop`) is five torch calls per column (six
asymmetric), each a kernel launch on a GPU, where the work per call is one column: a GPU
solve is launch-bound. On CUDA a full block's loop is recorded once as a CUDA graph on
static buffers and replayed for every later block of that shape (also in later solves), so the
host issues a handful of calls per block instead of ~5 per column; the kernels, and so the
results, are the eager loop's. Groups observed as the solve reaches them (``actorder`` ``None``
or ``"group"`` with groups) stay eager, as does every block on the CPU (nothing to gain
there). ``LAYERWISE_GPTQ_GRAPHS=0`` turns the recording off.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from layerwise.algorithms.hessian import (
    DAMPENING_RETRIES,
    GRAM_STRIP,
    HessianError,
    accumulate_hessian,
    add_gram,
    gram_to_hessian,
    inverse_hessian_factor,
    single_thread,
)
from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.float_formats import fp4_grid
from layerwise.algorithms.quantization.qmath import (
    _check_weight,
    fake_quantize_weight,
    float8_grid,
    qrange,
    weight_global_scale,
    weight_qparams,
)

GPTQError = HessianError  # the name callers of the GPTQ solver catch

__all__ = [
    "DAMPENING_RETRIES",
    "GRAM_STRIP",
    "GPTQError",
    "GPTQResult",
    "accumulate_hessian",
    "add_gram",
    "gptq_quantize",
    "gram_to_hessian",
    "rtn_quantize",
]

#: columns whose rank-1 updates are applied one by one inside a block; then one product for the rest
_SUB_BLOCK = 16


@dataclass
class GPTQResult:
    """A quantized weight and what the saver needs to pack it."""

    #: fake-quantized ``(out, in)`` weight, float32, original column order
    weight: Tensor
    scale: Tensor
    zero_point: Tensor
    #: group index per input column (``actorder="group"`` only), int32
    g_idx: Tensor | None
    #: GPTQ's objective: half the sum over columns of ``((w - q) / U[j, j])**2``
    loss: float
    #: the dampening fraction finally used (larger than asked after a failed factorisation)
    dampening_frac: float
    #: ``loss`` per output row (float64): what :meth:`split` divides
    row_loss: Tensor | None = None

    def split(self, rows: list[int]) -> list[GPTQResult]:
        """The results of layers whose weights were solved stacked (rows in ``rows`` order, one Hessian).

        GPTQ treats every output row on its own given the Hessian (its qparams come from its own
        weights, its errors move along its own row), so solving layers that read one input as one
        taller weight gives each the result it would get alone, in one pass over the columns.
        """
        if sum(rows) != self.weight.shape[0] or self.row_loss is None:
            raise ValueError(f"cannot split {self.weight.shape[0]} rows into {rows}")
        parts = zip(self.weight.split(rows), self.scale.split(rows), self.zero_point.split(rows),
                    self.row_loss.split(rows))
        return [GPTQResult(weight=w.contiguous(), scale=sc.contiguous(), zero_point=z.contiguous(), g_idx=self.g_idx,
                           loss=float(loss.sum()), dampening_frac=self.dampening_frac, row_loss=loss)
                for w, sc, z, loss in parts]


# -- the solver ----------------------------------------------------------------------------
@torch.no_grad()
def gptq_quantize(weight: Tensor, hessian: Tensor, args: QuantizationArgs, observer: Any = None,
                  block_size: int = 128, dampening_frac: float = 0.01,
                  scale_dtype: torch.dtype | None = None, pruned: Tensor | None = None,
                  global_scale: Tensor | None = None) -> GPTQResult:
    """Quantize a ``(out, in)`` weight with GPTQ given its layer's ``(in, in)`` Hessian.

    ``observer(weight) -> (min, max)`` measures ranges as for round-to-nearest
    (``None``: min-max). ``scale_dtype`` is the dtype the scales will be stored in
    (the model's weight dtype); the solve quantizes with scales already rounded to it,
    so storing them changes nothing. ``hessian`` is not modified. ``pruned`` (bool,
    ``(out, in)``, ``True`` where a pruning modifier zeroed a weight) keeps those weights at
    exactly 0: they are quantized to 0 and their error, like any other, is pushed onto the
    columns not solved yet, so quantization never revives a pruned weight.

    Float weights round onto their own grid (FP8 E4M3, FP4 E2M1) instead of the integers. The low-bit float
    formats (NVFP4, MXFP4, MXFP8) solve in groups of their block: each block's scale is fixed from the
    current (error-updated) columns just before they are solved, as for integer groups, and kept in
    float32; NVFP4's block scales are relative to ``global_scale`` (default: the weight's own), which the
    caller fixes once, before solving, for the layers a server fuses.

    Raises :class:`GPTQError` when the Hessian has non-finite entries or cannot be
    factorised; the caller decides what to do (round-to-nearest, usually).
    """
    with torch.profiler.record_function(PROFILER_RANGE):  # a profiler counts the launches inside (gpu_bench)
        if args.float_format is not None:
            scale_dtype = None  # float32 effective scales: the stored fp8 / e8m0 scales are recovered from them
        return _gptq_quantize(weight, hessian, args, observer, block_size, dampening_frac, scale_dtype, pruned,
                              global_scale)


#: the profiler range each solve runs in (``bench/gpu_bench.py --profile`` counts the kernels launched inside)
PROFILER_RANGE = "gptq_quantize"


def _gptq_quantize(weight: Tensor, hessian: Tensor, args: QuantizationArgs, observer: Any, block_size: int,
                   dampening_frac: float, scale_dtype: torch.dtype | None, pruned: Tensor | None,
                   global_scale: Tensor | None = None) -> GPTQResult:
    _check_weight(weight, args)
    rows, columns = weight.shape
    if tuple(hessian.shape) != (columns, columns):
        raise ValueError(f"the Hessian has shape {tuple(hessian.shape)}, the weight has {columns} input columns")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    H = hessian.detach()
    if H.dtype != torch.float32:
        H = H.to(torch.float32)
    low, high = torch.aminmax(H)  # one pass; NaN propagates into both
    if not (math.isfinite(low.item()) and math.isfinite(high.item())):
        raise GPTQError("the Hessian has non-finite entries (its inputs held NaN/inf, or overflowed float32)")
    W = weight.detach().to(device=H.device, dtype=torch.float32).clone()

    diag = torch.diagonal(H)
    dead = diag == 0
    any_dead = bool(dead.any())
    if any_dead:
        W[:, dead] = 0.0
    actorder = args.actorder
    # solve order: decreasing Hessian diagonal (dead columns, 0, last) or the original one
    perm = torch.argsort(diag, descending=True, stable=True) if actorder is not None else None
    group = args.strategy in ("group", "tensor_group")
    gs = args.group_size if group else None
    if args.float_format == "nvfp4" and global_scale is None:
        global_scale = weight_global_scale(W, args)

    # up-front qparams: tensor / channel, and static groups (contiguous in the original order)
    upfront = not group or actorder == "static"
    if upfront:
        scale, zero_point = weight_qparams(W, args, observer, global_scale)
        scale, zero_point = _stored(scale, scale_dtype), zero_point.to(torch.float32)
    else:
        scale = torch.empty(rows, columns // gs, dtype=torch.float32, device=W.device)
        zero_point = torch.empty_like(scale)

    order = perm if perm is not None else torch.arange(columns, device=H.device)
    reverse = order.flip(0)

    def reversed_hessian() -> Tensor:  # a copy: ``hessian`` stays as it was
        # rows then columns: two gathers cost a third of one two-dimensional index (8 -> 2.8 ms at 1536)
        copy = H.index_select(0, reverse).index_select(1, reverse)
        if any_dead:
            copy.diagonal()[dead[reverse]] = 1.0
        return copy

    # factorised in the copy's own memory (U shares it); a retry with more dampening rebuilds it
    U, used_frac = inverse_hessian_factor(reversed_hessian(), dampening_frac, rebuild=reversed_hessian)
    # rows of Wt are input columns in solve order: the per-column work touches contiguous memory
    Wt = (W.index_select(1, perm) if perm is not None else W).t().contiguous()
    keep = None
    if pruned is not None:
        if tuple(pruned.shape) != (rows, columns):
            raise ValueError(f"the pruning mask has shape {tuple(pruned.shape)}, the weight {(rows, columns)}")
        kept = (~pruned.to(device=Wt.device, dtype=torch.bool)).to(torch.float32)
        keep = (kept.index_select(1, perm) if perm is not None else kept).t().contiguous()
    del W

    # static groups: the (original-order) group of each column, in solve order
    column_group = torch.div(perm, gs, rounding_mode="floor") if group and upfront else None
    dynamic_groups = group and not upfront
    sub_block = _SUB_BLOCK
    if dynamic_groups:  # (sub-)blocks start on group boundaries: a group is observed up to date
        block_size = max(gs, block_size // gs * gs)
        sub_block = math.gcd(gs, _SUB_BLOCK)
    group_args = None
    if dynamic_groups:  # the float formats keep their own strategy (tensor_group is NVFP4's)
        group_args = (args.replace(actorder=None) if args.float_format is not None
                      else args.replace(strategy="group", group_size=gs, actorder=None))

    qmin, qmax = qrange(args)
    row_loss = torch.zeros(rows, dtype=torch.float64, device=Wt.device)
    # each column reads a row of scales (and zero points): one view per column, made once
    if not group:  # one row for every column
        s_row = scale.reshape(-1).expand(rows).contiguous()
        z_row = zero_point.reshape(-1).expand(rows).contiguous()
        column_scales, column_zeros = [s_row] * columns, [z_row] * columns
    elif upfront:
        scale_rows, zero_rows = scale.t().contiguous().unbind(0), zero_point.t().contiguous().unbind(0)
        groups_in_order = column_group.tolist()
        column_scales = [scale_rows[g] for g in groups_in_order]
        column_zeros = [zero_rows[g] for g in groups_in_order]
    width = min(block_size, columns)
    Q1_buffer = torch.empty(width, rows, dtype=torch.float32, device=Wt.device)
    E1_buffer = torch.empty_like(Q1_buffer)
    # per-column views made once (a view costs ~1.5 us: more than the column's arithmetic when made per block)
    column_rows, q_buffer_rows, e_buffer_rows = Wt.unbind(0), Q1_buffer.unbind(0), E1_buffer.unbind(0)
    keep_columns = keep.unbind(0) if keep is not None else None
    loop = _ColumnLoop(qmin, qmax, args.symmetric, sub_block, _grid(args))
    graphs = None if dynamic_groups else _block_graphs(Wt.device, rows, block_size, loop, keep is not None)

    for i1 in range(0, columns, block_size):
        i2 = min(i1 + block_size, columns)
        count = i2 - i1
        W1 = Wt[i1:i2]            # (count, out) view; updated in place, then overwritten with Q1
        Q1, E1 = Q1_buffer[:count], E1_buffer[:count]
        U1 = U[i1:i2, i1:i2]
        d = torch.diagonal(U1).unsqueeze(1)
        # rows scaled by 1/U[j, j]: inside the block the errors stay raw (w - q) and are scaled once at the end;
        # the diagonal zeroed, so a column's update leaves it and the columns before it as they are
        V1 = U1 / d
        V1.diagonal().zero_()
        if not group:
            block_scale = s_row
        elif upfront:
            block_scale = scale.t()[column_group[i1:i2]]
        keep_block = keep_columns[i1:i2] if keep_columns is not None else None
        if graphs is not None and count == block_size:  # one recorded launch for the block's column loop
            Q1, E1 = graphs.run(W1, V1, column_scales[i1:i2], column_zeros[i1:i2],
                                keep[i1:i2] if keep is not None else None)
        elif dynamic_groups:
            _dynamic_group_block(loop, W1, V1, column_rows[i1:i2], q_buffer_rows[:count], e_buffer_rows[:count],
                                 keep_block, E1, i1, gs, scale, zero_point, group_args, observer, scale_dtype,
                                 global_scale)
        else:
            with single_thread():  # many tiny ops: a second thread only adds synchronisation
                loop.run(W1, V1, E1, column_rows[i1:i2], q_buffer_rows[:count], e_buffer_rows[:count],
                         column_scales[i1:i2], column_zeros[i1:i2], keep_block)
        if dynamic_groups:  # each group of gs columns has its own scale row
            g1 = i1 // gs
            block_scale = scale[:, g1:g1 + count // gs].t().repeat_interleave(gs, dim=0)
        E1.div_(d)
        torch.mul(Q1, block_scale, out=W1)
        row_loss += E1.square().sum(dim=0, dtype=torch.float64) / 2
        if i2 < columns:  # lazy update of every later column with this block's errors
            Wt[i2:].addmm_(U[i1:i2, i2:].t(), E1, alpha=-1.0)

    g_idx = None
    if perm is not None:
        inverse = torch.argsort(perm)
        Q = Wt[inverse].t().contiguous()
        if group and actorder == "group":
            g_idx = torch.div(inverse, gs, rounding_mode="floor").to(torch.int32)
    else:
        Q = Wt.t().contiguous()
    return GPTQResult(weight=Q, scale=scale, zero_point=zero_point, g_idx=g_idx, loss=float(row_loss.sum()),
                      dampening_frac=used_frac, row_loss=row_loss)


class _ColumnLoop:
    """One block's columns, one after another: round each to its grid, push its error onto the block's later columns.

    Per column (``w`` its current values, ``s``/``z`` its scale and zero-point rows): ``q = clamp(round(w / s
    + z)) - z`` (the grid values as :mod:`.qmath` computes them; ``z + w / s`` is one ``addcdiv``), masked by
    the kept weights of a pruned layer, the error ``e = w - q s``, and ``e`` times the row of ``V`` reaches the
    rest of the sub-block (one ``addr_``); each sub-block's errors reach the rest of the block in one
    product. Five torch calls per column symmetric, six asymmetric (``+1`` with a pruning mask).
    """

    def __init__(self, qmin: float, qmax: float, symmetric: bool, sub_block: int,
                 grid: Any = None) -> None:
        self.qmin, self.qmax, self.symmetric, self.sub_block = qmin, qmax, symmetric, sub_block
        #: ``None``: integers (round half to even); else rounds a clamped column onto a float grid in place
        self.grid = grid

    def run(self, W1: Tensor, V1: Tensor, E1: Tensor, w_rows: Any, q_rows: Any, e_rows: Any, scales: Any,
            zeros: Any, keep: Any = None, start: int = 0, stop: int | None = None) -> None:
        """Columns ``start`` to ``stop`` of the block (its rows ``W1``, updates ``V1``, errors into ``E1``)."""
        count = W1.shape[0] if stop is None else stop
        qmin, qmax, symmetric, grid = self.qmin, self.qmax, self.symmetric, self.grid
        for j1 in range(start, count, self.sub_block):
            j2 = min(j1 + self.sub_block, count)
            # a column's update reaches the whole sub-block (zeros up to its own row): one view, no slicing
            W_sub, v_rows = W1[j1:j2], V1[j1:j2, j1:j2].unbind(0)
            for i in range(j1, j2):
                w, q, e, s_col = w_rows[i], q_rows[i], e_rows[i], scales[i]
                if symmetric:
                    torch.div(w, s_col, out=q)
                else:
                    torch.addcdiv(zeros[i], w, s_col, out=q)  # z + w / s: qmath's w / s + z, bit for bit
                if grid is None:
                    q.round_().clamp_(qmin, qmax)
                else:
                    grid(q.clamp_(qmin, qmax))
                if not symmetric:
                    q.sub_(zeros[i])
                if keep is not None:
                    q.mul_(keep[i])
                torch.addcmul(w, q, s_col, value=-1.0, out=e)
                if i + 1 < j2:
                    W_sub.addr_(v_rows[i - j1], e, alpha=-1.0)
            if j2 < W1.shape[0]:  # the sub-block's errors reach the rest of the block at once
                W1[j2:].addmm_(V1[j1:j2, j2:].t(), E1[j1:j2], alpha=-1.0)


def _dynamic_group_block(loop: _ColumnLoop, W1: Tensor, V1: Tensor, w_rows: Any, q_rows: Any, e_rows: Any,
                         keep: Any, E1: Tensor, i1: int, gs: int, scale: Tensor, zero_point: Tensor,
                         group_args: QuantizationArgs, observer: Any, scale_dtype: torch.dtype | None,
                         global_scale: Tensor | None = None) -> None:
    """A block whose groups are observed as the solve reaches them (``actorder="group"``, or none)."""
    with single_thread():
        for j in range(0, W1.shape[0], gs):  # sub-blocks start on group boundaries
            g = (i1 + j) // gs
            s, z = weight_qparams(W1[j:j + gs].t(), group_args, observer, global_scale)
            scale[:, g:g + 1] = _stored(s, scale_dtype)
            zero_point[:, g:g + 1] = z
            s_col, z_col = scale[:, g].contiguous(), zero_point[:, g].contiguous()
            loop.run(W1, V1, E1, w_rows, q_rows, e_rows, _Repeat(s_col), _Repeat(z_col), keep, j, j + gs)


class _Repeat:
    """One row for every column index."""

    def __init__(self, row: Tensor) -> None:
        self.row = row

    def __getitem__(self, index: int) -> Tensor:
        return self.row


# -- the column loop recorded once, replayed per block (CUDA graphs) -------------------------------
#: ``LAYERWISE_GPTQ_GRAPHS=0`` turns the recorded column loop off (every block then launches its own kernels)
GRAPHS_ENV = "LAYERWISE_GPTQ_GRAPHS"
#: recorded loops kept for later solves of the same shape (a model's layers repeat a few shapes)
_GRAPH_CACHE_SIZE = 8
_graph_cache: dict[tuple, _BlockGraphs] = {}


class _CudaGraphs:
    """The recorder: :class:`torch.cuda.CUDAGraph` (a test swaps in a stand-in, :data:`_graph_backend`)."""

    @staticmethod
    def available(device: torch.device) -> bool:
        return device.type == "cuda" and torch.cuda.is_available()

    @staticmethod
    def record(fn: Any, device: torch.device) -> Any:
        """Run ``fn`` once for real on a side stream (the warm-up the capture needs), then record it; returns
        the replay callable. The warm-up's results are the first block's."""
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay


_graph_backend: Any = _CudaGraphs


class _BlockGraphs:
    """A full block's column loop on static buffers, recorded at its first block and replayed for the others.

    Each block copies its rows, update rows, scale / zero-point rows (and kept-weight mask) into the
    buffers, and the recorded loop runs on the device without the host issuing a call per column (a
    loop is ~5 launches per column: 1.15 M launches for a 1B model's solves, launch-bound). The kernels
    are the eager loop's own, so the results are too.
    """

    def __init__(self, device: torch.device, rows: int, width: int, loop: _ColumnLoop, pruned: bool) -> None:
        def buffer(height: int = width, columns: int = rows) -> Tensor:
            return torch.zeros(height, columns, dtype=torch.float32, device=device)

        self.device, self.loop = device, loop
        self.W, self.Q, self.E, self.S, self.Z = buffer(), buffer(), buffer(), buffer(), buffer()
        self.V = buffer(width, width)
        self.K = buffer() if pruned else None
        self._views = (self.W.unbind(0), self.Q.unbind(0), self.E.unbind(0), self.S.unbind(0), self.Z.unbind(0),
                       self.K.unbind(0) if self.K is not None else None)
        self._replay: Any = None

    def _loop(self) -> None:
        w_rows, q_rows, e_rows, s_rows, z_rows, k_rows = self._views
        self.loop.run(self.W, self.V, self.E, w_rows, q_rows, e_rows, s_rows, z_rows, k_rows)

    def run(self, W1: Tensor, V1: Tensor, scales: list[Tensor], zeros: list[Tensor],
            keep: Tensor | None) -> tuple[Tensor, Tensor]:
        """The block's grid values and raw errors (the buffers: read them before the next block)."""
        self.W.copy_(W1)
        self.V.copy_(V1)
        torch.stack(scales, out=self.S)
        torch.stack(zeros, out=self.Z)
        if self.K is not None:
            self.K.copy_(keep)
        if self._replay is None:
            self._replay = _graph_backend.record(self._loop, self.device)
        else:
            self._replay()
        return self.Q, self.E


def _block_graphs(device: torch.device, rows: int, width: int, loop: _ColumnLoop, pruned: bool) -> _BlockGraphs | None:
    """The recorded loop for blocks of ``width`` columns and ``rows`` rows on ``device``, or ``None`` where there
    is none to record (the CPU: the eager loop, as fast as ever) or ``LAYERWISE_GPTQ_GRAPHS=0``."""
    if os.environ.get(GRAPHS_ENV, "1") == "0" or not _graph_backend.available(device):
        return None
    key = (str(device), rows, width, loop.qmin, loop.qmax, loop.symmetric, loop.sub_block, pruned)
    graphs = _graph_cache.pop(key, None)
    if graphs is None:
        graphs = _BlockGraphs(device, rows, width, loop, pruned)
    _graph_cache[key] = graphs  # the most recent last
    while len(_graph_cache) > _GRAPH_CACHE_SIZE:
        _graph_cache.pop(next(iter(_graph_cache)))
    return graphs


def _grid(args: QuantizationArgs) -> Any:
    """How the column loop rounds: ``None`` for integers, else an in-place rounding onto the float grid."""
    if args.type != "float":
        return None
    if args.num_bits == 8:
        return float8_grid
    return lambda q: q.copy_(fp4_grid(q))


def _stored(scale: Tensor, dtype: torch.dtype | None) -> Tensor:
    """The scale as float32, after rounding to the dtype it will be stored in."""
    if dtype is not None and dtype != torch.float32:
        scale = scale.to(dtype)
        # a scale that underflows to 0 in the storage dtype would divide by zero
        scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(dtype).eps), scale)
    return scale.to(torch.float32)


def rtn_quantize(weight: Tensor, args: QuantizationArgs, observer: Any = None,
                 scale_dtype: torch.dtype | None = None, global_scale: Tensor | None = None) -> GPTQResult:
    """Round-to-nearest with the same result type (the fallback when GPTQ cannot run)."""
    W = weight.detach().to(torch.float32)
    if args.float_format is not None:
        scale_dtype = None
    scale, zero_point = weight_qparams(W, args, observer, global_scale)
    scale = _stored(scale, scale_dtype)
    zero_point = zero_point.to(torch.float32)
    return GPTQResult(weight=fake_quantize_weight(W, scale, zero_point, args), scale=scale,
                      zero_point=zero_point, g_idx=None, loss=math.nan, dampening_frac=math.nan)

