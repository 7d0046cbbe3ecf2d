"""A linear layer's reconstruction Hessian and its inverse factor: what GPTQ and SparseGPT share.

For a layer ``y = W x`` with inputs ``X`` (``in x n``), the error ``||W X - W' X||^2`` of any
changed weight ``W'`` is a quadratic form in ``H = 2 X X^T / n``. Both solvers sweep the
columns in order and push each column's change onto the columns after it through the
upper Cholesky factor of ``H^-1``; this module builds ``H`` from inputs (as the Gram
matrix ``X^T X``, in strips, upper triangle only) and factors it with dampening.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from layerwise.common.device_caches import device_cache
from layerwise.errors import LayerwiseError

__all__ = [
    "CUDA_STRIP_BYTES", "DAMPENING_RETRIES", "GRAM_STRIP", "HessianError", "accumulate_hessian", "add_gram",
    "gram_dtype", "gram_strip", "gram_to_hessian", "inverse_hessian_factor", "single_thread",
]


class HessianError(LayerwiseError, ArithmeticError):
    """The Hessian cannot be factorised (not finite, or not positive definite even when dampened)."""


#: how often the dampening is multiplied by 10 when a Cholesky factorisation fails
DAMPENING_RETRIES = 2
def accumulate_hessian(hessian: Tensor | None, num_samples: int, inputs: Tensor) -> tuple[Tensor, int]:
    """Fold ``inputs`` (``(..., in)``) into the running mean ``H = 2/n sum x x^T``.

    ``num_samples`` counts the rows (tokens) already in ``hessian``; returns the
    updated Hessian (float32, updated in place when given) and the new count.
    """
    x = inputs.detach().reshape(-1, inputs.shape[-1])
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    columns = x.shape[1]
    if hessian is None:
        hessian = torch.zeros(columns, columns, dtype=torch.float32, device=x.device)
    rows = x.shape[0]
    if rows == 0:
        return hessian, num_samples
    total = num_samples + rows
    # H <- n/(n+m) H + 2/(n+m) X^T X, one BLAS call, no temporary
    hessian.addmm_(x.t(), x, beta=num_samples / total, alpha=2.0 / total)
    return hessian, total


#: rows per strip of the Gram matrix: only the blocks on or above the diagonal are computed
GRAM_STRIP = 128
#: on CUDA, the float32 bytes one strip's product may take: 128-row strips are products too small to
#: fill a GPU (an H200 took a 1B model's bf16 Hessians at ~44 TFLOP/s in ~115,000 of them, launch-bound)
CUDA_STRIP_BYTES = 64 * 2**20
_HALF = (torch.bfloat16, torch.float16)


def add_gram(gram: Tensor, x: Tensor, strip: int | None = None) -> Tensor:
    """``gram += X^T X`` on and above the diagonal only (``gram`` float32; ``x``: ``(rows, in)`` in
    :func:`gram_dtype`'s dtype).

    The Gram matrix is symmetric; computed as row strips of its upper triangle, ``GRAM_STRIP``
    rows each, it costs a little more than half the full product (9/16 for 1024 inputs).
    Only the entries on and above the diagonal are meaningful: read the result with
    :func:`gram_to_hessian`. The strips are ``strip`` rows tall (default: :func:`gram_strip`'s).
    """
    columns = x.shape[1]
    step = strip or gram_strip(columns, x.device)
    for i in range(0, columns, step):
        if x.dtype in _HALF:
            gram[i:i + step, i:].add_(_float32_products(x[:, i:i + step].t(), x[:, i:]))
        else:
            gram[i:i + step, i:].addmm_(x[:, i:i + step].t(), x[:, i:])
    return gram


def gram_strip(columns: int, device: torch.device | str) -> int:
    """Rows per strip of the Gram matrix of ``columns`` inputs on ``device``: :data:`GRAM_STRIP`, or on CUDA as
    many (a multiple of it) as :data:`CUDA_STRIP_BYTES` allow: a few large products instead of ``columns / 128``
    small ones (one product up to 4096 inputs), for a little more of the lower triangle computed."""
    if torch.device(device).type != "cuda":
        return GRAM_STRIP
    rows = CUDA_STRIP_BYTES // (4 * max(columns, 1))
    return max(GRAM_STRIP, rows // GRAM_STRIP * GRAM_STRIP)


def gram_dtype(x: Tensor) -> torch.dtype:
    """The dtype a Gram matrix reads ``x`` in: bfloat16 / float16 on a CUDA device as it is, else float32.

    Why: the product of two bfloat16 (or float16) values is exact in float32, so ``X^T X`` taken on the
    tensor cores with float32 sums (``torch.mm(..., out_dtype=torch.float32)``) is the product of the float32
    copy, up to the order of the sums, at the tensor cores' rate (an H100: ~990 against ~60 TFLOP/s), and the
    inputs waiting to be folded take half the memory. Where that product is missing (an older torch) or gives
    other numbers (checked once per device and dtype), the inputs are copied to float32 as before.
    """
    if x.device.type == "cuda" and x.dtype in _HALF and _float32_products_work(
            x.device, x.dtype):
        return x.dtype
    return torch.float32


def _float32_products(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` in float32 from half-precision ``a``, ``b``: on CUDA in one call, elsewhere through float32
    copies (the same numbers; only tests send half-precision inputs here off CUDA)."""
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.to(torch.float32) @ b.to(torch.float32)


@device_cache()
def _float32_products_work(device: torch.device, dtype: torch.dtype) -> bool:
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(256, 192, device=device, generator=generator).to(dtype)
    try:
        product = _float32_products(a.t(), a)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    exact = a.to(torch.float64).t() @ a.to(torch.float64)
    return product.dtype == torch.float32 and bool(
        ((product.double() - exact).abs() <= 1e-5 * exact.abs().max()).all())


def gram_to_hessian(gram: Tensor, num_samples: int) -> Tensor:
    """``H = 2/n X^T X`` (a new, full, symmetric matrix) from the upper triangle of a Gram matrix."""
    upper = torch.triu(gram)
    # the mirror image through a contiguous transposed copy, then one aligned add: reading a transposed
    # view inside the add strides across the matrix (1536 inputs: 4 ms this way, 10-13 ms that way)
    hessian = upper.t().contiguous()
    hessian.add_(upper)
    hessian.diagonal().copy_(upper.diagonal())  # the add counted it twice
    return hessian.mul_(2.0 / max(num_samples, 1))


def inverse_hessian_factor(reversed_hessian: Tensor, dampening_frac: float,
                           rebuild: Callable[[], Tensor] | None = None) -> tuple[Tensor, float]:
    """Upper triangular ``U`` with ``U^T U`` = the dampened ``H^-1``; retries with more dampening.

    Takes ``J H J`` (``H`` with rows and columns in reverse order; ``J`` is the exchange
    matrix) and overwrites it. With ``J H J = L L^T`` (lower Cholesky factor ``L``),
    ``H = R R^T`` for the upper triangular ``R = J L J``, so ``H^-1 = (R^-1)^T R^-1`` and
    ``U = R^-1 = J L^-1 J``: one factorisation and one triangular inverse, instead of
    factorising ``H``, inverting it and factorising the inverse.

    With ``rebuild`` (a function returning ``J H J`` again) the factor is computed in the
    matrix's own memory and ``U`` shares it: two ``n x n`` matrices fewer at the peak (a
    5632-input ``down_proj``: 250 MB), and a retry rebuilds the matrix.
    """
    diagonal = torch.diagonal(reversed_hessian)
    diag_mean = torch.mean(diagonal).item()
    frac = dampening_frac
    for attempt in range(DAMPENING_RETRIES + 1):
        damp = frac * diag_mean
        if attempt and rebuild is not None:  # the failed factorisation overwrote it
            reversed_hessian.copy_(rebuild())
        diagonal.add_(damp)
        lower, factored = _cholesky_in_place(reversed_hessian if rebuild is not None else reversed_hessian.clone())
        if factored:
            inverse = _lower_triangular_inverse(lower)
            upper = _flip_into(inverse, lower) if rebuild is not None else inverse.flip(0, 1)
            if bool(torch.isfinite(torch.diagonal(upper)).all()):
                return upper, frac
        if rebuild is None:
            diagonal.sub_(damp)
        frac = frac * 10 if frac > 0 else 1e-4
    raise HessianError(f"the Hessian is not positive definite even with dampening {frac / 10:g} of its mean "
                       f"diagonal (Cholesky factorisation failed)")


#: matrices wider than this are factorised in blocks of :data:`CHOLESKY_BLOCK`: on a 1536-wide Hessian
#: LAPACK's own factorisation took 1.4-1.7x as long as these blocks (whose work is mostly matrix products)
CHOLESKY_BLOCKED_ABOVE = 512
CHOLESKY_BLOCK = 256


def _cholesky_in_place(matrix: Tensor) -> tuple[Tensor, bool]:
    """The lower Cholesky factor of symmetric ``matrix`` (only its lower triangle is read), computed in its
    memory; and whether it succeeded (``False``: not positive definite, the matrix is overwritten).

    Right-looking blocks: factor a diagonal block, solve the panel below it, subtract the panel's product
    from the trailing matrix. The last two are matrix products, which run near the machine's peak.
    """
    n = matrix.shape[0]
    if n <= CHOLESKY_BLOCKED_ABOVE:
        status = torch.empty((), dtype=torch.int32, device=matrix.device)
        _, info = torch.linalg.cholesky_ex(matrix, out=(matrix, status))
        return matrix, int(info) == 0
    for start in range(0, n, CHOLESKY_BLOCK):
        end = min(start + CHOLESKY_BLOCK, n)
        block, info = torch.linalg.cholesky_ex(matrix[start:end, start:end])
        if int(info) != 0:
            return matrix, False
        matrix[start:end, start:end] = block
        if end < n:
            panel = torch.linalg.solve_triangular(block.t(), matrix[end:, start:end], upper=True, left=False)
            matrix[end:, start:end] = panel
            matrix[end:, end:].addmm_(panel, panel.t(), alpha=-1.0)
    return matrix.tril_(), True


def _flip_into(matrix: Tensor, spare: Tensor) -> Tensor:
    """``matrix`` with rows and columns reversed, computed through ``spare`` (overwritten) into ``matrix``."""
    reverse = torch.arange(matrix.shape[0] - 1, -1, -1, device=matrix.device)
    torch.index_select(matrix, 0, reverse, out=spare)
    torch.index_select(spare, 1, reverse, out=matrix)
    return matrix


def _lower_triangular_inverse(lower: Tensor, leaf: int = 128) -> Tensor:
    """``L^-1`` by halves: ``[[A, 0], [B, C]]^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]]``.

    Matrix products instead of a triangular solve against the identity, which would do
    three times the work on zeros.
    """
    n = lower.shape[0]
    if n <= leaf:
        eye = torch.eye(n, dtype=lower.dtype, device=lower.device)
        return torch.linalg.solve_triangular(lower, eye, upper=False)
    h = n // 2
    a_inv = _lower_triangular_inverse(lower[:h, :h], leaf)
    c_inv = _lower_triangular_inverse(lower[h:, h:], leaf)
    out = torch.empty_like(lower)
    out[:h, :h] = a_inv
    out[:h, h:] = 0
    out[h:, h:] = c_inv
    torch.neg(c_inv @ (lower[h:, :h] @ a_inv), out=out[h:, :h])
    return out


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
