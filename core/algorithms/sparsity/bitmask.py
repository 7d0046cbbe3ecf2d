"""compressed-tensors' sparse weight layouts: encode a dense ``(out, in)`` weight, decode it back.

Two layouts, both exact (decoding gives back every value, zeros as ``0``):

* **sparse-bitmask** (any zeros): ``compressed``, 1-D, the nonzero values row by row;
  ``bitmask``, uint8 ``(out, ceil(in / 8))``, bit ``j % 8`` of byte ``j // 8`` of row ``r`` set
  where ``W[r, j] != 0`` (least significant bit first: numpy's ``packbits(bitorder="little")``);
  ``row_offsets``, int32 ``(out,)``, where each row starts in ``compressed``.
* **sparse-24-bitmask** (at most 2 nonzeros in every 4 consecutive columns): ``compressed``,
  ``(out, in / 2)``, exactly 2 values of every 4 in column order (a run holding fewer than 2
  nonzeros also stores zeros, the earliest positions first, so every row has the same length);
  ``bitmask``, the kept positions packed as above.

Each layout also stores ``shape`` (int64 ``[out, in]``). The names are the tensors' suffixes in
a checkpoint: ``<layer>.weight.<part>``. Pure tensor math: callers name the layer in errors.
"""

from __future__ import annotations

import torch
from torch import Tensor

BITMASK = "sparse-bitmask"
SPARSE_24 = "sparse-24-bitmask"
#: the tensors of each layout, by the suffix they take after ``<layer>.weight.``
PARTS = {BITMASK: ("shape", "compressed", "bitmask", "row_offsets"), SPARSE_24: ("shape", "compressed", "bitmask")}
_INT32_MAX = 2**31 - 1


class SparseFormatError(ValueError):
    """Tensors that do not form (or a weight that does not fit) a sparse layout."""


def pack_bits(mask: Tensor) -> Tensor:
    """Boolean ``(rows, cols)`` -> uint8 ``(rows, ceil(cols / 8))``, least significant bit first."""
    rows, cols = mask.shape
    padded = torch.zeros(rows, -(-cols // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[:, :cols] = mask
    weights = torch.tensor([1 << bit for bit in range(8)], dtype=torch.uint8, device=mask.device)
    return (padded.view(rows, -1, 8) * weights).sum(dim=-1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, cols: int) -> Tensor:
    """uint8 ``(rows, ceil(cols / 8))`` -> boolean ``(rows, cols)``; the inverse of :func:`pack_bits`."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.to(torch.uint8).unsqueeze(-1) >> shifts) & 1
    return bits.reshape(packed.shape[0], -1)[:, :cols].bool()


def encode_bitmask(weight: Tensor) -> dict[str, Tensor]:
    """The sparse-bitmask tensors of a 2-D weight (values keep the weight's dtype)."""
    _check_2d(weight)
    nonzero = weight != 0
    counts = nonzero.sum(dim=1)
    if int(counts.sum()) > _INT32_MAX:
        raise SparseFormatError(f"{int(counts.sum())} nonzero weights do not fit the format's int32 row offsets")
    offsets = torch.cumsum(counts, 0) - counts
    return {"shape": _shape(weight), "compressed": weight[nonzero].contiguous(), "bitmask": pack_bits(nonzero),
            "row_offsets": offsets.to(torch.int32)}


def decode_bitmask(parts: dict[str, Tensor]) -> Tensor:
    """The dense weight of :func:`encode_bitmask`'s tensors; checks that they agree with each other."""
    rows, cols = _read_shape(parts["shape"])
    bitmask, values, offsets = parts["bitmask"], parts["compressed"], parts["row_offsets"]
    _expect(bitmask, "bitmask", (rows, -(-cols // 8)))
    _expect(offsets, "row_offsets", (rows,))
    if values.dim() != 1:
        raise SparseFormatError(f"compressed must be 1-D, got shape {tuple(values.shape)}")
    mask = unpack_bits(bitmask, cols)
    counts = mask.sum(dim=1)
    if int(counts.sum()) != values.numel():
        raise SparseFormatError(f"bitmask marks {int(counts.sum())} nonzero weights but compressed holds "
                                f"{values.numel()} values")
    if not torch.equal(offsets.to(torch.int64), torch.cumsum(counts, 0) - counts):
        raise SparseFormatError("row_offsets do not match the bitmask's count of nonzeros per row")
    dense = torch.zeros(rows, cols, dtype=values.dtype, device=values.device)
    dense[mask] = values
    return dense


def encode_sparse_24(weight: Tensor) -> dict[str, Tensor]:
    """The sparse-24-bitmask tensors of a 2-D weight with at most 2 nonzeros in every 4 columns."""
    _check_2d(weight)
    rows, cols = weight.shape
    if cols % 4:
        raise SparseFormatError(f"2:4 sparsity needs an input width divisible by 4, got {cols}")
    runs = weight.reshape(rows, cols // 4, 4)
    nonzero = runs != 0
    crowded = nonzero.sum(dim=-1) > 2
    if bool(crowded.any()):
        row, run = (int(i) for i in crowded.nonzero()[0])
        raise SparseFormatError(f"{int(crowded.sum())} run(s) of 4 columns hold more than 2 nonzero weights "
                                f"(the first: row {row}, columns {4 * run}-{4 * run + 3}), so the weight is not 2:4")
    # nonzeros first, then the earliest positions: exactly 2 per run, the same choice every time
    position = torch.arange(4, 0, -1, device=weight.device)
    keep_at = torch.topk(nonzero * 8 + position, 2, dim=-1).indices.sort(dim=-1).values
    keep = torch.zeros_like(nonzero).scatter_(-1, keep_at, True)
    values = runs.gather(-1, keep_at).reshape(rows, cols // 2)
    return {"shape": _shape(weight), "compressed": values.contiguous(), "bitmask": pack_bits(keep.reshape(rows, cols))}


def decode_sparse_24(parts: dict[str, Tensor]) -> Tensor:
    """The dense weight of :func:`encode_sparse_24`'s tensors; checks that they agree with each other."""
    rows, cols = _read_shape(parts["shape"])
    bitmask, values = parts["bitmask"], parts["compressed"]
    if cols % 4:
        raise SparseFormatError(f"shape {[rows, cols]} has an input width not divisible by 4")
    _expect(bitmask, "bitmask", (rows, -(-cols // 8)))
    _expect(values, "compressed", (rows, cols // 2))
    mask = unpack_bits(bitmask, cols)
    if not bool((mask.reshape(rows, cols // 4, 4).sum(dim=-1) == 2).all()):
        raise SparseFormatError("bitmask does not keep exactly 2 positions in every run of 4 columns")
    dense = torch.zeros(rows, cols, dtype=values.dtype, device=values.device)
    dense[mask] = values.reshape(-1)
    return dense


ENCODERS = {BITMASK: encode_bitmask, SPARSE_24: encode_sparse_24}
DECODERS = {BITMASK: decode_bitmask, SPARSE_24: decode_sparse_24}


def _check_2d(weight: Tensor) -> None:
    if weight.dim() != 2:
        raise SparseFormatError(f"a sparse weight must be 2-D (out, in), got shape {tuple(weight.shape)}")


def _shape(weight: Tensor) -> Tensor:
    return torch.tensor(list(weight.shape), dtype=torch.int64)


def _read_shape(shape: Tensor) -> tuple[int, int]:
    if shape.numel() != 2 or shape.dtype.is_floating_point or bool((shape < 0).any()):
        raise SparseFormatError(f"shape must hold two non-negative integers [out, in], got {shape.tolist()}")
    rows, cols = (int(v) for v in shape.reshape(-1))
    return rows, cols


def _expect(tensor: Tensor, part: str, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise SparseFormatError(f"{part} has shape {tuple(tensor.shape)}, the weight's shape needs {shape}")


def encoded_bytes(weight: Tensor, fmt: str) -> int:
    """Bytes ``weight`` takes on disk in layout ``fmt`` (what the run summary reports as its size)."""
    rows, cols = weight.shape
    bits = rows * ((cols + 7) // 8)
    if fmt == SPARSE_24:
        return weight.numel() // 2 * weight.element_size() + bits + 16
    return int((weight != 0).sum()) * weight.element_size() + bits + 4 * rows + 16
