"""Hadamard matrices of power-of-two order and the fast Walsh-Hadamard transform.

Sylvester's construction doubles ``H_1 = [1]`` by ``H_2n = [[H_n, H_n], [H_n, -H_n]]``: entry ``(i, j)``
is ``(-1) ** popcount(i & j)``, the matrix is symmetric and ``H H^T = n I``. compressed-tensors'
``hadamard`` transform type builds the same matrix (its ``deterministic_hadamard_matrix``), so a
rotation saved under that type is regenerated on load from its size alone.

:func:`fwht` multiplies by ``H / sqrt(n)`` without the ``n x n`` product: Sylvester's matrix is the
Kronecker product of smaller ones (``H_ab = H_a (x) H_b``, the index bits split between them), so
``x H`` is ``x`` viewed as ``(a, b)`` times ``H_b`` on one side and ``H_a`` on the other: two small
matrix products (``2 (a + b)`` operations per entry, 128 for ``n = 1024``) that run at the BLAS's
speed, against ``n`` per entry for the full product and the ``log2 n`` passes over memory of the
butterflies (3-4x slower than the two products at ``n = 1024`` on a CPU). The online rotations run it
on every token at inference. With ``block`` it applies the
block-diagonal matrix of ``H_block`` blocks (compressed-tensors' ``head_dim``), which is how a width
that is not a power of two (Llama-2-7B's 11008 = 43 x 256) still gets an exact, orthogonal rotation.

:func:`known_hadamard` builds the Hadamards of other orders (hidden 384 = 192 x 2, 3584 = 224 x 16) for the
folded residual rotation, from the library of known matrices compressed-tensors ships.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from layerwise.common.device_caches import device_cache

#: the largest Sylvester matrix :func:`fwht` multiplies by at once (larger sizes use several factors)
LARGEST_FACTOR = 64


#: compressed-tensors' library of Hadamard matrices (N. J. A. Sloane's; orders 1, 2 and the multiples of 4 up to 256),
#: a data file in its package
LIBRARY = ("compressed_tensors", "transform/utils/hadamards.safetensors")


class HadamardSizeError(ValueError):
    """No Hadamard matrix or transform of the asked size is built here."""


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def largest_power_of_two_dividing(n: int) -> int:
    return n & -n if n > 0 else 0


def check_block(width: int, block: int | None, what: str = "a Hadamard rotation") -> int:
    """The block size used for ``width`` (``None``: the whole width), or an error naming a size that works."""
    size = width if block is None else block
    if not is_power_of_two(size):
        fit = largest_power_of_two_dividing(width)
        raise HadamardSizeError(f"{what} of width {width} needs a power-of-two block, got {size}: only Sylvester "
                                f"(power-of-two) Hadamards are built; set the block size to {fit} (the largest power "
                                f"of two dividing {width}) for a block-diagonal rotation")
    if width % size:
        raise HadamardSizeError(f"{what}: block size {size} does not divide the width {width}; use a power of two "
                                f"dividing it, such as {largest_power_of_two_dividing(width)}")
    return size


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """Sylvester's ``n x n`` Hadamard matrix (entries +-1, not normalized), from its definition."""
    if not is_power_of_two(n):
        raise HadamardSizeError(f"Sylvester's construction gives Hadamard matrices of power-of-two order only, not {n}")
    index = torch.arange(n)
    bits = torch.bitwise_and(index.unsqueeze(1), index.unsqueeze(0))
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(dtype)


def known_hadamard(n: int) -> Tensor:
    """A Hadamard matrix of order ``n`` (float64, entries +-1): ``K^T (x) H_m``, ``K`` the largest matrix of
    compressed-tensors' library whose order ``k`` leaves ``m = n / k`` a power of two, ``H_m`` Sylvester's. It is
    the matrix compressed-tensors' ``random_hadamard_matrix`` multiplies its random signs by (tested), read from its
    data file without importing compressed-tensors (0.3-0.5 s, inside the compress call on tiny-llama-doc)."""
    for order in _library_orders():
        if n % order == 0 and is_power_of_two(n // order):
            return torch.kron(_library_matrix(order).t().contiguous(), hadamard_matrix(n // order))
    raise HadamardSizeError(f"no Hadamard matrix of order {n} is known here (orders k * 2^j, k a multiple of 4 up to "
                            f"256 or 1)")


@functools.lru_cache(maxsize=1)
def _library_path() -> str:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(LIBRARY[0])  # finds the package without running its __init__
    if spec is None or spec.origin is None:
        raise HadamardSizeError(f"{LIBRARY[0]} is not installed: its library of Hadamard matrices builds the orders "
                                f"that are not powers of two")
    return str(Path(spec.origin).parent / LIBRARY[1])


@functools.lru_cache(maxsize=1)
def _library_orders() -> tuple[int, ...]:
    from safetensors import safe_open

    with safe_open(_library_path(), framework="pt") as file:
        return tuple(sorted((int(key) for key in file.keys()), reverse=True))  # noqa: SIM118 - not a dict


@functools.lru_cache(maxsize=8)
def _library_matrix(order: int) -> Tensor:
    from safetensors import safe_open

    with safe_open(_library_path(), framework="pt") as file:
        return file.get_tensor(str(order)).to(torch.float64)


def fwht(x: Tensor, block: int | None = None) -> Tensor:
    """``x @ blockdiag(H_block, ...) / sqrt(block)`` over the last dimension, in ``x``'s dtype.

    ``block`` defaults to the whole last dimension; it must be a power of two dividing it.
    """
    width = x.shape[-1]
    size = check_block(width, block)
    y = x.reshape(-1, size)
    inner = 1  # the factors applied so far, the trailing index bits
    for factor in kronecker_factors(size):
        h = _sylvester(factor, y.dtype, y.device)
        y = y.reshape(-1, factor) @ h if inner == 1 else torch.matmul(h, y.reshape(-1, factor, inner))
        inner *= factor
    return (y.reshape(x.shape) / math.sqrt(size)).to(x.dtype)


def kronecker_factors(size: int) -> list[int]:
    """Powers of two multiplying to ``size``, as even as can be and none above :data:`LARGEST_FACTOR`."""
    bits = size.bit_length() - 1
    count = max(1, -(-bits // (LARGEST_FACTOR.bit_length() - 1)))
    return [1 << (bits // count + (i < bits % count)) for i in range(count)]


@device_cache(maxsize=64)
def _sylvester(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return hadamard_matrix(n, dtype).to(device)
