"""Memory, FLOPs and output size of a run, from module shapes alone (the model may live on meta).

Every number is an estimate from shapes and the run's settings; the rules are written here
once, each beside the constant it uses:

* a piece's **weights** are its modules' parameters in the run's dtype;
* **cached activations** are those of the widest cut, for all calibration tokens
  (:func:`cut_cache_bytes`): the residual stream, beside it the widest input a modifier reads
  when the cut is before the layers (an MLP's down projection: its intermediate width), the
  rotary embedding's cos and sin (once when every sample has one length), and the token ids / mask; one
  sample's share is in flight;
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

from layerwise.algorithms.hessian import gram_strip
from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.common.module_walk import all_parameters, walk_modules
from layerwise.runtime.accounting import gptq_solve_flops, gram_flops
from layerwise.runtime.memory_policy import cache_bytes
from layerwise.runtime.placement import working_set_bytes

#: float32 copies a GPTQ solve keeps of its weight (W, Q, errors) beside the inverse Hessian
SOLVE_WEIGHT_COPIES = 3
#: bytes per token a cut holds beside the activations: int64 token ids or positions, and the attention mask
INDEX_BYTES_PER_TOKEN = 16


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
    #: does a calibration forward run it (the tail after the last target runs only when it holds a layer
    #: a modifier compresses: its outputs feed nothing)
    runs: bool = True

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
    working_set = working_set_bytes(seq_length, max(widest, hidden))
    solve = max((4 * (SOLVE_WEIGHT_COPIES * layer.rows * layer.columns + layer.columns ** 2)
                 for layer in piece.hessian_layers), default=0)
    piece.temporary = max(working_set, solve)
    return piece


def rotary_width(config: object) -> int:
    """Values per token of a rotary embedding's cos and sin, which every cut of a decoder holds (0: none)."""
    text = getattr(config, "text_config", None) or config
    if not any(getattr(text, key, None) for key in ("rope_parameters", "rope_theta", "rope_scaling")):
        return 0
    heads = getattr(text, "num_attention_heads", 0) or 1
    head = getattr(text, "qk_rope_head_dim", None) or getattr(text, "head_dim", None) or \
        getattr(text, "hidden_size", 0) // heads
    return 2 * int(head or 0)


def cut_cache_bytes(tokens: int, element: int, *, hidden: int, widest_read: int, rotary: int, cut: str,
                    rotary_tokens: int | None = None) -> int:
    """The activation cache at a run's widest cut, for ``tokens`` calibration tokens. At blocks a cut holds the
    residual stream; before the layers (``cut="layers"``) also the input of the layer after it, at most
    ``widest_read`` values (measured on tiny-llama-doc and MiniLM: the down projection's input beside the
    residual is the widest). Both hold the index tensors and the rotary cos / sin, which are equal for samples
    of one length and held once for them (the cache keeps a value equal to the last of its name once):
    ``rotary_tokens`` of them (None: every token's, the bound where lengths vary)."""
    values = hidden + (widest_read if cut == "layers" else 0)
    rotary_tokens = tokens if rotary_tokens is None else rotary_tokens
    return tokens * (values * element + INDEX_BYTES_PER_TOKEN) + rotary_tokens * rotary * element


# -- output size ----------------------------------------------------------------------------------------
def stored_weight_bytes(layer: Quantized, element: int) -> int:
    """Bytes the compressed-tensors saver writes for one quantized weight and its qparams (from shapes)."""
    args, inputs, rows, columns = layer.weights, layer.inputs, layer.rows, layer.columns
    if args is None:
        return rows * columns * element  # pruned only: stored dense
    if args.float_format is not None:  # values packed to their bits, one byte per block scale (FP8 / E8M0)
        total = rows * columns * args.num_bits // 8 + _scale_count(args, rows, columns)
        global_scales = (args.float_format == "nvfp4") + (inputs is not None and inputs.float_format == "nvfp4")
        return total + 4 * global_scales  # NVFP4's float32 global scales: the weight's, the inputs'
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
    embeddings = {id(m.weight) for _, m in walk_modules(model) if isinstance(m, torch.nn.Embedding)}
    matrix = sum(p.numel() for p in all_parameters(model) if p.dim() >= 2 and id(p) not in embeddings)
    return 2.0 * matrix * tokens + 4.0 * seq_length * hidden * layers * tokens


def hessian_flops(layers: list[Quantized], tokens: int, device: str = "cpu") -> float:
    """The Gram products of ``layers``' Hessians over ``tokens`` on ``device``, in the strips a run there takes
    (taller on CUDA: more of the lower triangle computed). Each distinct width counted once, then multiplied:
    a 256-expert model has 44,544 layers of three widths."""
    widths = Counter(layer.columns for layer in layers)
    return float(sum(count * gram_flops(tokens, columns, gram_strip(columns, device))
                     for columns, count in widths.items()))


def solve_flops(layers: list[Quantized]) -> float:
    shapes = Counter((layer.rows, layer.columns) for layer in layers)
    return float(sum(count * gptq_solve_flops(rows, columns) for (rows, columns), count in shapes.items()))
