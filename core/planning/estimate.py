"""Memory, FLOPs and output size of a run, from module shapes alone (the model may live on meta).

Every number is an estimate from shapes and the run's settings; the rules are written here
once, each beside the constant it uses:

* a piece's **weights** are its modules' parameters in the run's dtype;
* **cached activations** at a cut are :func:`~layerwise.runtime.memory_policy.cache_bytes` of all
  calibration tokens (the same rule ``offload="auto"`` uses); one sample's share is in flight;
* **statistics**: a float32 ``in x in`` Hessian per layer a Hessian modifier (GPTQ, SparseGPT)
  compresses (an upper bound: layers that read one input share one), AWQ's cached inputs of
  its searched layers;
* the **largest temporary**: a forward's working set (the placement rule,
  :data:`~layerwise.runtime.placement.WORKING_SET_FACTOR` x the widest activation of a sample),
  or a GPTQ solve's copies of its largest weight and inverse Hessian, whichever is larger.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from layerwise.algorithms.hessian import GRAM_STRIP
from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.runtime.accounting import gptq_solve_flops, gram_flops
from layerwise.runtime.memory_policy import cache_bytes
from layerwise.runtime.placement import WORKING_SET_FACTOR

#: float32 copies a GPTQ solve keeps of its weight (W, Q, errors) beside the inverse Hessian
SOLVE_WEIGHT_COPIES = 3


@dataclass(frozen=True)
class Quantized:
    """One layer a modifier compresses: its shape and how."""

    name: str
    rows: int
    columns: int
    weights: QuantizationArgs | None  # None: pruned only
    inputs: QuantizationArgs | None
    hessian: bool


@dataclass
class PieceEstimate:
    """What one piece holds on the execution device while it is calibrated."""

    label: str
    modules: list[str]
    weights: int = 0
    activations: int = 0
    statistics: int = 0
    temporary: int = 0
    hessian_layers: list[Quantized] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.statistics + self.temporary


def estimate_piece(label: str, modules: list[str], inside: list[Quantized], *, weights: int, widest: int,
                   dtype: torch.dtype, seq_length: int, hidden: int, awq_tokens: int) -> PieceEstimate:
    """The device memory of one piece: ``modules`` (qualified names) holding ``weights`` bytes of parameters,
    the compressed layers ``inside``, and Linear outputs ``widest`` wide at most."""
    element = torch.empty((), dtype=dtype).element_size()
    piece = PieceEstimate(label, list(modules))
    piece.weights = weights
    piece.activations = cache_bytes(seq_length, hidden, element)  # one sample in flight
    piece.hessian_layers = [layer for layer in inside if layer.hessian]
    piece.statistics = sum(4 * layer.columns ** 2 for layer in piece.hessian_layers)
    piece.statistics += sum(4 * min(awq_tokens, seq_length) * layer.columns for layer in inside
                            if awq_tokens and layer.weights is not None)
    working_set = WORKING_SET_FACTOR * seq_length * max(widest, hidden) * 4
    solve = max((4 * (SOLVE_WEIGHT_COPIES * layer.rows * layer.columns + layer.columns ** 2)
                 for layer in piece.hessian_layers), default=0)
    piece.temporary = max(working_set, solve)
    return piece


# -- output size ----------------------------------------------------------------------------------------
def stored_weight_bytes(layer: Quantized, element: int) -> int:
    """Bytes the compressed-tensors saver writes for one quantized weight and its qparams (from shapes)."""
    args, inputs, rows, columns = layer.weights, layer.inputs, layer.rows, layer.columns
    if args is None:
        return rows * columns * element  # pruned only: stored dense
    packed = args.type != "float" and not (inputs is not None and args.num_bits == 8)
    total = rows * -(-columns * args.num_bits // 32) * 4 + 16 if packed else rows * columns
    scales = _scale_count(args, rows, columns)
    total += scales * element
    if not args.symmetric:
        groups = scales // max(rows, 1) if args.strategy in ("channel", "group") else scales
        total += -(-rows * args.num_bits // 32) * groups * 4 if packed and args.strategy in ("channel", "group") \
            else scales
    if inputs is not None and not inputs.dynamic:
        total += element + (0 if inputs.symmetric else 1)
    return total


def _scale_count(args: QuantizationArgs, rows: int, columns: int) -> int:
    if args.strategy == "tensor":
        return 1
    if args.strategy == "channel":
        return rows
    if args.strategy == "block":
        block_rows, block_columns = args.block_structure
        return math.ceil(rows / block_rows) * math.ceil(columns / block_columns)
    return rows * (columns // args.group_size)


# -- FLOPs --------------------------------------------------------------------------------------------------
def forward_flops(model: torch.nn.Module, tokens: int, seq_length: int, layers: int, hidden: int) -> float:
    """One calibration forward over ``tokens``: 2 FLOPs per weight (matrices, embeddings left out) per token,
    and attention's two products (``4 x seq x hidden`` per token and layer)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    matrix = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in embeddings)
    return 2.0 * matrix * tokens + 4.0 * seq_length * hidden * layers * tokens


def hessian_flops(layers: list[Quantized], tokens: int) -> float:
    """The Gram products of ``layers``' Hessians over ``tokens`` (each distinct width counted once, then
    multiplied: a 256-expert model has 44,544 layers of three widths)."""
    widths = Counter(layer.columns for layer in layers)
    return float(sum(count * gram_flops(tokens, columns, GRAM_STRIP) for columns, count in widths.items()))


def solve_flops(layers: list[Quantized]) -> float:
    shapes = Counter((layer.rows, layer.columns) for layer in layers)
    return float(sum(count * gptq_solve_flops(rows, columns) for (rows, columns), count in shapes.items()))
