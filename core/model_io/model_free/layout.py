"""What the saver writes for one layer, known before the layer is read: names, dtypes, shapes.

A model-free shard file is written header first (:class:`~layerwise.model_io.streaming.safetensors_io.
StreamedFile`), so every encoded tensor's layout must be known before any value is. The saver is the
only authority on its format, so the layout is not computed from rules about compressed-tensors
here: the saver encodes two small probes of the layer (all-zero weights of ``PROBE_ROWS`` and twice
as many rows, the layer's width and dtype, quantized as the layer will be), and each tensor it
returns is

* *row-split* when its first dimension grows with the probe's rows (packed or plain weights, per
  row or per group scales, zero points packed along the rows): the layer's rows then add up chunk
  by chunk, one probe-sized unit at a time, and its full first dimension is the units' sum (a third
  probe gives the last, shorter unit's);
* *whole* otherwise (a global scale, the shape record): one value for the layer; if the two probes'
  values differ it must be the layer's shape itself (compressed-tensors' ``weight_shape``), which is
  written as ``[rows, columns]``; anything else is an error, as a chunked layer could not reproduce it.

The chunked encoding (:mod:`.worker`) checks every chunk against this layout, and the file is
refused unless every tensor's bytes add up: a layout guessed wrong cannot produce a wrong file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from layerwise.model_io.streaming.safetensors_io import DTYPES, NAMES, TensorLayout

#: rows of the layout probes, and the unit every chunk of rows is a multiple of (a multiple of 32 rows,
#: so int4 / int8 zero points packed along the rows split into whole int32 words, and of FP8 block rows)
PROBE_ROWS = 128


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor the saver writes for a layer: its layout, and whether it is split by rows."""

    key: str
    layout: TensorLayout
    row_split: bool
    #: the tensor records the layer's shape (written as ``[rows, columns]`` whatever the chunks)
    shape_record: bool = False


class LayoutError(ValueError):
    """The saver writes a tensor for a layer that cannot be assembled from chunks of rows."""


def row_unit(block_rows: int | None) -> int:
    """The rows every chunk but the last is a multiple of."""
    return PROBE_ROWS if not block_rows else math.lcm(PROBE_ROWS, block_rows)


def layer_layout(rows: int, columns: int, dtype: str, unit: int, encode) -> list[EncodedTensor]:
    """The tensors ``encode(weight)`` writes for a ``(rows, columns)`` layer stored as ``dtype``, in order.

    ``encode`` quantizes and encodes a weight as the run will (it returns the saver's ``key -> tensor``);
    it is called on zero probes of ``unit`` and ``2 * unit`` rows (and the remainder's rows if any).
    """
    torch_dtype = DTYPES[dtype]
    one = encode(torch.zeros(unit, columns, dtype=torch_dtype))
    two = encode(torch.zeros(2 * unit, columns, dtype=torch_dtype))
    units, rest = divmod(rows, unit)
    last = encode(torch.zeros(rest, columns, dtype=torch_dtype)) if rest else None
    if list(one) != list(two) or (last is not None and list(last) != list(one)):
        raise LayoutError(f"the saver writes different tensors for layers of {unit} and {2 * unit} rows "
                          f"({sorted(one)} against {sorted(two)}): it cannot be written in chunks")
    found = []
    for key, small in one.items():
        big = two[key]
        if small.dtype != big.dtype:
            raise LayoutError(f"the saver's {key!r} changes dtype with the layer's rows")
        if tuple(small.shape) == tuple(big.shape):
            record = not torch.equal(small, big)
            if record and not (small.dim() == 1 and small.tolist() == [unit, columns]
                               and big.tolist() == [2 * unit, columns]):
                raise LayoutError(f"the saver's {key!r} depends on the layer's rows but is not its shape: it "
                                  f"cannot be written in chunks")
            found.append(EncodedTensor(key, TensorLayout(NAMES[small.dtype], tuple(small.shape)), False, record))
            continue
        if small.dim() == 0 or small.shape[1:] != big.shape[1:] or big.shape[0] != 2 * small.shape[0]:
            raise LayoutError(f"the saver's {key!r} has shape {tuple(small.shape)} for {unit} rows and "
                              f"{tuple(big.shape)} for {2 * unit}: not split along the rows")
        first = units * small.shape[0] + (last[key].shape[0] if last is not None else 0)
        found.append(EncodedTensor(key, TensorLayout(NAMES[small.dtype], (first, *small.shape[1:])), True))
    return found
