"""The GPTQ solver against round-to-nearest and a plain column-by-column reference."""

from __future__ import annotations

import pytest
import torch

from layerwise.algorithms.quantization import gptq as gptq_module
from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.float_formats import nvfp4_block_scales
from layerwise.algorithms.quantization.gptq import (
    GPTQError,
    accumulate_hessian,
    add_gram,
    gptq_quantize,
    gram_to_hessian,
)
from layerwise.algorithms.quantization.qmath import (
    fake_quantize,
    fake_quantize_weight,
    quantize_weight,
    weight_global_scale,
    weight_qparams,
)

SCHEMES = {
    "int4 group 32": QuantizationArgs(num_bits=4, strategy="group", group_size=32),
    "int4 group 32 asym": QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=32),
    "int4 channel": QuantizationArgs(num_bits=4, strategy="channel", group_size=None),
    "int4 channel asym": QuantizationArgs(num_bits=4, symmetric=False, strategy="channel", group_size=None),
    "int8 channel": QuantizationArgs(num_bits=8, strategy="channel", group_size=None),
    "int8 group 32 asym": QuantizationArgs(num_bits=8, symmetric=False, strategy="group", group_size=32),
    "int4 tensor": QuantizationArgs(num_bits=4, strategy="tensor", group_size=None),
}
#: the low-bit float formats (solved in groups of their block) and float8 per channel
FLOAT_SCHEMES = {
    "nvfp4": QuantizationArgs(type="float", num_bits=4, strategy="tensor_group", group_size=16),
    "mxfp4": QuantizationArgs(type="float", num_bits=4, strategy="group", group_size=32),
    "mxfp8": QuantizationArgs(type="float", num_bits=8, strategy="group", group_size=32, scale_dtype="e8m0"),
    "fp8 channel": QuantizationArgs(type="float", num_bits=8, strategy="channel", group_size=None),
}


def problem(out=48, columns=128, tokens=1024, seed=0):
    """A weight and correlated inputs with unequal column energies (as in real layers)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(columns) + 2 * torch.randn(columns, columns, generator=g) / columns ** 0.5
    energy = torch.rand(columns, generator=g) * 3 + 0.1
    x = (torch.randn(tokens, columns, generator=g) @ mix) * energy
    w = torch.randn(out, columns, generator=g) * 0.1
    return w, x, 2 * x.t() @ x / tokens


def rtn(w, args):
    scale, zero_point = weight_qparams(w, args)
    return fake_quantize_weight(w, scale, zero_point, args), scale, zero_point


def output_error(w, q, x):
    return ((w - q) @ x.t()).norm() / (w @ x.t()).norm()


def reference_gptq(weight, hessian, args, dampening_frac=0.01):
    """Optimal Brain Quantization column by column, float64, explicit inverse downdated per column.

    No Cholesky, no lazy blocks: the textbook form the fast solver must agree with.
    """
    W = weight.double().clone()
    H = hessian.double().clone()
    columns = W.shape[1]
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    order = list(range(columns))
    if args.actorder is not None:
        order = torch.argsort(torch.diagonal(H).float(), descending=True, stable=True).tolist()
    H += torch.eye(columns, dtype=H.dtype) * dampening_frac * torch.diagonal(H).mean()
    Hinv = torch.linalg.inv(H)
    group = args.strategy in ("group", "tensor_group")
    upfront = not group or args.actorder == "static"
    global_scale = weight_global_scale(W.float(), args)  # NVFP4: fixed from the weight before the solve
    if upfront:
        scale, zero_point = weight_qparams(W.float(), args, global_scale=global_scale)
    else:
        scale = torch.zeros(W.shape[0], columns // args.group_size)
        zero_point = torch.zeros_like(scale)
    g_idx = torch.zeros(columns, dtype=torch.int32)
    Q = torch.zeros_like(W)
    for position, j in enumerate(order):
        if not group:
            s, z = scale.reshape(-1).expand(W.shape[0]), zero_point.reshape(-1).expand(W.shape[0])
        elif upfront:
            s, z = scale[:, j // args.group_size], zero_point[:, j // args.group_size]
        else:
            g = position // args.group_size
            if position % args.group_size == 0:
                cols = order[position:position + args.group_size]
                sg, zg = weight_qparams(W[:, cols].float(), args.replace(actorder=None), global_scale=global_scale)
                scale[:, g], zero_point[:, g] = sg[:, 0], zg[:, 0]
            s, z = scale[:, g], zero_point[:, g]
            g_idx[j] = g
        q = fake_quantize(W[:, j].float(), s, z, args).double()
        Q[:, j] = q
        err = (W[:, j] - q) / Hinv[j, j]
        W -= torch.outer(err, Hinv[j, :])   # columns already quantized are never read again
        Hinv = Hinv - torch.outer(Hinv[:, j], Hinv[j, :]) / Hinv[j, j]
    return Q.float(), scale, zero_point, (g_idx if args.actorder == "group" else None)


# -- identity Hessian: nothing to compensate -> round-to-nearest, bit for bit ----------------------
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_identity_hessian_equals_round_to_nearest_bit_for_bit(name):
    args = SCHEMES[name]
    w, _, _ = problem()
    expected, scale, zero_point = rtn(w, args)
    result = gptq_quantize(w, torch.eye(w.shape[1]), args, block_size=48)
    assert torch.equal(result.weight, expected)
    assert torch.equal(result.scale, scale) and torch.equal(result.zero_point, zero_point)
    assert result.g_idx is None


def test_diagonal_hessian_is_also_round_to_nearest():
    # no correlation between inputs: the inverse Hessian is diagonal, no error is pushed anywhere
    args = SCHEMES["int4 group 32 asym"]
    w, _, _ = problem()
    diag = torch.diag(torch.rand(w.shape[1]) + 0.5)
    assert torch.equal(gptq_quantize(w, diag, args).weight, rtn(w, args)[0])


# -- correlated inputs -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_gptq_beats_round_to_nearest_on_correlated_inputs(name):
    args = SCHEMES[name]
    w, x, h = problem()
    result = gptq_quantize(w, h, args)
    gptq_err, rtn_err = output_error(w, result.weight, x), output_error(w, rtn(w, args)[0], x)
    assert gptq_err < 0.85 * rtn_err, (gptq_err, rtn_err)
    # the result is on the grid its qparams describe (what the saver packs)
    assert torch.equal(fake_quantize_weight(result.weight, result.scale, result.zero_point, args), result.weight)
    assert result.loss > 0


@pytest.mark.parametrize("name, actorder", [
    ("int4 group 32", None), ("int4 group 32 asym", None), ("int4 channel", None), ("int8 channel", None),
    ("int4 tensor", None), ("int4 group 32", "static"), ("int4 channel", "static"), ("int4 group 32", "group"),
])
@pytest.mark.parametrize("block_size", [16, 128])
def test_fast_solver_matches_the_plain_reference(name, actorder, block_size):
    args = SCHEMES[name].replace(actorder=actorder)
    w, x, h = problem()
    result = gptq_quantize(w, h, args, block_size=block_size)
    q_ref, scale_ref, zp_ref, g_idx_ref = reference_gptq(w, h, args)
    torch.testing.assert_close(result.scale, scale_ref.float(), rtol=1e-5, atol=0)
    torch.testing.assert_close(result.zero_point, zp_ref.float(), rtol=0, atol=0)
    if g_idx_ref is None:
        assert result.g_idx is None
    else:
        assert torch.equal(result.g_idx, g_idx_ref)
    # float32 + lazy blocks vs float64 column by column: the same integers almost everywhere
    ints = quantize_weight(result.weight, result.scale, result.zero_point, args, result.g_idx)
    ints_ref = quantize_weight(q_ref, scale_ref.float(), zp_ref.float(), args, g_idx_ref)
    assert (ints == ints_ref).float().mean() > 0.995
    torch.testing.assert_close(output_error(w, result.weight, x), output_error(w, q_ref, x), rtol=2e-3, atol=0)


def test_block_size_changes_speed_not_the_result():
    args = SCHEMES["int4 channel"]
    w, _, h = problem()
    a, b = gptq_quantize(w, h, args, block_size=8), gptq_quantize(w, h, args, block_size=128)
    assert (a.weight == b.weight).float().mean() > 0.995


# -- activation order ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["int4 group 32", "int4 channel", "int4 group 32 asym"])
def test_static_actorder_is_as_good_or_better_and_needs_no_group_index(name):
    args = SCHEMES[name]
    w, x, h = problem(seed=3)
    plain = gptq_quantize(w, h, args)
    static = gptq_quantize(w, h, args.replace(actorder="static"))
    assert static.g_idx is None
    assert output_error(w, static.weight, x) <= output_error(w, plain.weight, x) * 1.01
    # groups keep contiguous original columns: plain fake-quant with the default group index reproduces it
    assert torch.equal(fake_quantize_weight(static.weight, static.scale, static.zero_point, args), static.weight)


def test_group_actorder_groups_columns_in_solve_order():
    args = SCHEMES["int4 group 32"].replace(actorder="group")
    w, x, h = problem(seed=4)
    result = gptq_quantize(w, h, args)
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    assert result.g_idx.dtype == torch.int32
    assert torch.equal(result.g_idx[order], torch.arange(w.shape[1], dtype=torch.int32) // 32)
    assert torch.equal(fake_quantize_weight(result.weight, result.scale, result.zero_point, args, result.g_idx),
                       result.weight)
    assert output_error(w, result.weight, x) < output_error(w, rtn(w, args.replace(actorder=None))[0], x)


# -- degenerate Hessians ---------------------------------------------------------------------------
def test_dead_columns_become_zero_and_the_rest_is_still_solved():
    args = SCHEMES["int4 group 32 asym"]
    w, x, _ = problem()
    dead = torch.tensor([0, 5, 77, 127])
    x[:, dead] = 0
    h = 2 * x.t() @ x / x.shape[0]
    result = gptq_quantize(w, h, args)
    assert torch.isfinite(result.weight).all()
    assert torch.equal(result.weight[:, dead], torch.zeros(w.shape[0], len(dead)))
    assert output_error(w, result.weight, x) < output_error(w, rtn(w, args)[0], x)


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("actorder", [None, "static", "group"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_results_are_on_their_own_grid(name, actorder, scale_dtype):
    """What lets the modifier store a result without quantizing it again (``set_quantized_weight(on_grid=
    True)``): fake-quantizing the result with its own qparams gives it back bit for bit."""
    args = SCHEMES[name]
    if actorder == "group" and args.strategy != "group":
        pytest.skip("group actorder needs groups")
    args = args.replace(actorder=actorder)
    w, _, h = problem()
    result = gptq_quantize(w, h, args, scale_dtype=scale_dtype)
    again = fake_quantize_weight(result.weight, result.scale, result.zero_point, args, result.g_idx)
    assert torch.equal(again, result.weight)


def test_non_finite_hessian_is_an_error():
    w, _, h = problem()
    h[3, 4] = float("nan")
    with pytest.raises(GPTQError, match="non-finite"):
        gptq_quantize(w, h, SCHEMES["int4 channel"])


def test_failed_cholesky_retries_with_more_dampening_then_gives_up(monkeypatch):
    w, _, h = problem()
    real = torch.linalg.cholesky_ex
    calls = []

    def failing_first(matrix, upper=False, out=None):
        calls.append(upper)
        lower, info = real(matrix, upper=upper) if out is None else real(matrix, upper=upper, out=out)
        return lower, torch.ones_like(info) if len(calls) == 1 else info

    monkeypatch.setattr(gptq_module.torch.linalg, "cholesky_ex", failing_first)
    result = gptq_quantize(w, h, SCHEMES["int4 channel"], dampening_frac=0.01)
    assert result.dampening_frac == pytest.approx(0.1)

    monkeypatch.setattr(gptq_module.torch.linalg, "cholesky_ex",
                        lambda matrix, upper=False, out=None: (matrix, torch.tensor(1)))
    with pytest.raises(GPTQError, match="not positive definite"):
        gptq_quantize(w, h, SCHEMES["int4 channel"])


def test_wide_hessians_are_factored_in_blocks_as_lapack_factors_them():
    """Above CHOLESKY_BLOCKED_ABOVE inputs the Cholesky factor is computed in blocks: it equals LAPACK's
    (float rounding aside), reads only the lower triangle, and a matrix that is not positive definite
    in a late block is refused (the caller then dampens more)."""
    from layerwise.algorithms.hessian import (
        CHOLESKY_BLOCK,
        CHOLESKY_BLOCKED_ABOVE,
        _cholesky_in_place,
    )

    n = CHOLESKY_BLOCKED_ABOVE + CHOLESKY_BLOCK // 2 + 3  # a last block narrower than the others
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * n, n, generator=g, dtype=torch.float64)
    h = x.t() @ x / (2 * n) + 0.01 * torch.eye(n, dtype=torch.float64)
    scrambled_upper = h.clone()
    scrambled_upper.triu_(1).add_(torch.randn(n, n, generator=g, dtype=torch.float64).triu(1))
    scrambled_upper += h.tril()
    lower, ok = _cholesky_in_place(scrambled_upper)
    assert ok and lower.data_ptr() == scrambled_upper.data_ptr()
    torch.testing.assert_close(lower, torch.linalg.cholesky(h), rtol=1e-10, atol=1e-10)
    broken = h.clone()
    broken[n - 2, n - 2] = -1.0  # the failure is only met in the last block
    assert not _cholesky_in_place(broken)[1]


def test_indefinite_hessian_without_dampening_fails_cleanly():
    w, _, _ = problem()
    h = -torch.eye(w.shape[1])  # negative definite: no dampening of its (negative) mean diagonal helps
    with pytest.raises(GPTQError):
        gptq_quantize(w, h, SCHEMES["int4 channel"])


def test_input_hessian_is_left_alone_unless_consumed():
    w, _, h = problem()
    before = h.clone()
    gptq_quantize(w, h, SCHEMES["int4 channel"])
    assert torch.equal(h, before)


def test_shape_mismatch_is_named():
    w, _, _ = problem()
    with pytest.raises(ValueError, match="input columns"):
        gptq_quantize(w, torch.eye(64), SCHEMES["int4 channel"])


# -- Hessian accumulation --------------------------------------------------------------------------
def test_running_hessian_equals_the_batch_formula():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(1, n, 16, generator=g) for n in (7, 9, 5)]
    h, count = None, 0
    for x in batches:
        h, count = accumulate_hessian(h, count, x)
    every = torch.cat([x.reshape(-1, 16) for x in batches])
    assert count == 21
    torch.testing.assert_close(h, 2 * every.t() @ every / 21, rtol=1e-5, atol=1e-6)
    gram = torch.zeros(16, 16)
    for x in batches:
        add_gram(gram, x.reshape(-1, 16))
    torch.testing.assert_close(gram_to_hessian(gram, 21), h, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_gram_is_the_float32_copys_and_only_a_gpu_keeps_the_half_precision(dtype):
    """Products of two bfloat16 / float16 values are exact in float32: the Gram of the inputs as they are (a GPU's
    tensor cores, float32 sums) is the float32 copy's up to the order of the sums. The CPU copies to float32."""
    from layerwise.algorithms.hessian import gram_dtype

    x = (torch.randn(300, 200, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    half = add_gram(torch.zeros(200, 200), x)
    exact = add_gram(torch.zeros(200, 200, dtype=torch.float64), x.to(torch.float64))
    upper = torch.ones(200, 200, dtype=torch.bool).triu()
    assert ((half.double() - exact).abs()[upper] <= 1e-6 * exact.abs().max()).all()
    assert gram_dtype(x) == torch.float32 and gram_dtype(x.float()) == torch.float32


@pytest.mark.parametrize("columns", [16, 100, 1000])
def test_gram_strips_cover_the_whole_upper_triangle(columns):
    x = torch.randn(37, columns, dtype=torch.float64)
    gram = add_gram(torch.zeros(columns, columns, dtype=torch.float64), x)
    torch.testing.assert_close(gram_to_hessian(gram, 37), 2 * x.t() @ x / 37)


def test_half_precision_inputs_accumulate_in_float32():
    x = torch.randn(2, 8, 16).to(torch.bfloat16)
    h, _ = accumulate_hessian(None, 0, x)
    assert h.dtype == torch.float32
    torch.testing.assert_close(h, 2 * x.float().reshape(-1, 16).t() @ x.float().reshape(-1, 16) / 16)


def test_scale_is_rounded_to_its_storage_dtype_before_the_solve():
    args = SCHEMES["int4 group 32"]
    w, _, h = problem()
    result = gptq_quantize(w, h, args, scale_dtype=torch.bfloat16)
    assert torch.equal(result.scale, result.scale.to(torch.bfloat16).float())
    assert torch.equal(fake_quantize_weight(result.weight, result.scale, result.zero_point, args), result.weight)


def test_a_pruning_mask_keeps_every_pruned_weight_at_zero_and_the_rest_compensates():
    from layerwise.algorithms.sparsity.masks import MaskStructure, magnitude_mask

    g = torch.Generator().manual_seed(11)
    x = torch.randn(256, 64, generator=g) @ (torch.eye(64) + torch.randn(64, 64, generator=g) / 8)
    hessian = 2 * x.t() @ x / 256
    weight = torch.randn(16, 64, generator=g)
    pruned = magnitude_mask(weight, MaskStructure(2, 4), 0.5)
    sparse = weight.masked_fill(pruned, 0.0)
    args = QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=16)
    kept = gptq_quantize(sparse, hessian, args, pruned=pruned).weight
    assert (kept[pruned] == 0).all()
    revived = gptq_quantize(sparse, hessian, args).weight  # without the mask GPTQ fills the zeros in
    assert (revived[pruned] != 0).any()


# -- layers reading one input, solved stacked ----------------------------------------------------------
@pytest.mark.parametrize("name", ["int4 group 32", "int4 group 32 asym", "int4 channel", "int8 channel"])
@pytest.mark.parametrize("actorder", [None, "static", "group"])
def test_stacked_layers_get_what_each_gets_alone(name, actorder):
    """GPTQ's rows are independent given the Hessian: q/k/v solved as one taller weight and split
    equal their own solves (the lazy updates' products may round differently: equal grids, close losses)."""
    if actorder == "group" and SCHEMES[name].strategy != "group":
        pytest.skip("group actorder needs groups")
    args = SCHEMES[name].replace(actorder=actorder)
    q, _, h = problem(out=48)
    k, v = torch.randn(16, 128) * 0.3, torch.randn(32, 128) * 0.05  # other magnitudes, other heights
    together = gptq_quantize(torch.cat([q, k, v]), h, args).split([48, 16, 32])
    for weight, part in zip((q, k, v), together):
        alone = gptq_quantize(weight, h, args)
        assert part.weight.shape == weight.shape and part.scale.shape == alone.scale.shape
        assert (part.weight == alone.weight).float().mean() > 0.995
        torch.testing.assert_close(part.scale, alone.scale)
        assert part.loss == pytest.approx(alone.loss, rel=1e-3)
        assert (part.g_idx is None) == (alone.g_idx is None)
        if alone.g_idx is not None:
            assert torch.equal(part.g_idx, alone.g_idx)


def test_a_split_must_cover_every_row():
    w, _, h = problem(out=8)
    with pytest.raises(ValueError, match="cannot split 8 rows"):
        gptq_quantize(w, h, SCHEMES["int4 channel"]).split([4, 3])


# -- launches: what the host issues per column ---------------------------------------------------------
#: the calls that compute (one kernel launch each on a GPU); views, shapes and indexing are left out
_KERNELS = {"div", "addcdiv", "add_", "round_", "clamp_", "sub_", "mul_", "addcmul", "addr_", "addmm_"}


class _CallCounter(torch.overrides.TorchFunctionMode):
    """Counts the computing torch calls the host issues."""

    def __init__(self):
        super().__init__()
        self.calls, self.paused = 0, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused and getattr(func, "__name__", "") in _KERNELS:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _calls_per_column(args, columns=256, pruned=None, **kw):
    w, _, h = problem(out=32, columns=columns)
    with _CallCounter() as counter:
        gptq_quantize(w, h, args, pruned=pruned, **kw)
    return counter.calls / columns


@pytest.mark.parametrize("name, most", [("int4 group 32", 5.2), ("int4 channel", 5.2), ("int4 group 32 asym", 6.2)])
def test_the_eager_column_loop_issues_five_calls_per_column_six_asymmetric(name, most):
    """div, round_, clamp_, addcmul, addr_ per column (an asymmetric grid adds its zero point with the division,
    one addcdiv where it was a div and an add_, and takes it off after rounding); the rest is per sub-block."""
    assert _calls_per_column(SCHEMES[name].replace(actorder="static"), block_size=128) <= most


class _StandInGraphs:
    """Records by running the loop once; a replay runs it again without the host's calls being counted, as a
    CUDA graph replays its kernels without the host issuing them."""

    def __init__(self, counter_box):
        self.counter_box, self.recorded = counter_box, 0

    def available(self, device):
        return True

    def record(self, fn, device):
        self.recorded += 1
        fn()

        def replay():
            counter = self.counter_box[0]
            if counter is not None:
                counter.paused = True
            try:
                fn()
            finally:
                if counter is not None:
                    counter.paused = False
        return replay


@pytest.mark.parametrize("name, actorder", [("int4 group 32", None), ("int4 group 32 asym", "static"),
                                            ("int8 channel", None), ("int4 tensor", "static"),
                                            ("int4 group 32", "group")])
def test_a_recorded_column_loop_gives_the_eager_result_and_no_call_per_column(name, actorder, monkeypatch):
    from layerwise.algorithms.sparsity.masks import MaskStructure, magnitude_mask

    args = SCHEMES[name].replace(actorder=actorder)
    w, _, h = problem(out=40, columns=224)  # blocks of 64: three recorded, the last (32 columns) eager
    pruned = magnitude_mask(w, MaskStructure(2, 4), 0.5)
    w = w.masked_fill(pruned, 0.0)
    expected = [gptq_quantize(w, h, args, block_size=64, pruned=mask) for mask in (None, pruned)]
    box = [None]
    stand_in = _StandInGraphs(box)
    monkeypatch.setattr(gptq_module, "_graph_backend", stand_in)
    monkeypatch.setattr(gptq_module, "_graph_cache", {})
    for mask, want in zip((None, pruned), expected):
        got = gptq_quantize(w, h, args, block_size=64, pruned=mask)
        assert torch.equal(got.weight, want.weight) and torch.equal(got.scale, want.scale) and got.loss == want.loss
    observed = args.strategy == "group" and actorder != "static"  # groups observed mid-block: never recorded
    assert stand_in.recorded == (0 if observed else 2)
    if not observed:
        with _CallCounter() as counter:
            box[0] = counter
            gptq_quantize(w, h, args, block_size=64)
        assert stand_in.recorded == 2  # the same shape again: the recorded loop is reused
        assert counter.calls / 224 < 1.2  # the eager last block of 32 columns: ~5 each; the recorded ones: none


def test_recording_is_off_on_the_cpu_and_when_asked(monkeypatch):
    assert gptq_module._block_graphs(torch.device("cpu"), 8, 16, gptq_module._ColumnLoop(-8, 7, True, 16),
                                     False) is None
    monkeypatch.setattr(gptq_module, "_graph_backend", _StandInGraphs([None]))
    monkeypatch.setenv(gptq_module.GRAPHS_ENV, "0")
    assert gptq_module._block_graphs(torch.device("cuda", 0), 8, 16, gptq_module._ColumnLoop(-8, 7, True, 16),
                                     False) is None


# -- float grids: FP8 per channel, and the block formats solved block by block ----------------------
@pytest.mark.parametrize("name", sorted(FLOAT_SCHEMES))
def test_float_identity_hessian_equals_round_to_nearest_bit_for_bit(name):
    args = FLOAT_SCHEMES[name]
    w, _, _ = problem()
    expected, scale, _ = rtn(w, args)
    # the block formats keep float32 effective scales whatever the storage dtype (the saver encodes them)
    dtype = torch.bfloat16 if args.float_format else None
    result = gptq_quantize(w, torch.eye(w.shape[1]), args, block_size=48, scale_dtype=dtype)
    assert torch.equal(result.weight, expected)
    assert torch.equal(result.scale, scale)


@pytest.mark.parametrize("name", sorted(FLOAT_SCHEMES))
@pytest.mark.parametrize("actorder", [None, "static"])
def test_float_solver_matches_the_plain_reference_and_beats_round_to_nearest(name, actorder):
    args = FLOAT_SCHEMES[name].replace(actorder=actorder)
    w, x, h = problem()
    result = gptq_quantize(w, h, args, block_size=64)
    q_ref, scale_ref, _, _ = reference_gptq(w, h, args)
    assert torch.equal(fake_quantize_weight(result.weight, result.scale, result.zero_point, args), result.weight)
    # float32 + lazy blocks vs float64 column by column: the same grid values almost everywhere
    assert (result.weight == q_ref).float().mean() > 0.99
    assert (result.scale == scale_ref.float()).float().mean() > 0.99
    torch.testing.assert_close(output_error(w, result.weight, x), output_error(w, q_ref, x), rtol=5e-3, atol=0)
    assert output_error(w, result.weight, x) < 0.9 * output_error(w, rtn(w, args)[0], x)


def test_nvfp4_solve_keeps_the_global_scale_it_is_given():
    args = FLOAT_SCHEMES["nvfp4"]
    w, _, h = problem()
    shared = weight_global_scale(w * 2, args)  # as if fused with a layer twice as large
    result = gptq_quantize(w, h, args, global_scale=shared)
    # every block scale is an fp8 value over the shared global scale
    assert torch.equal(nvfp4_block_scales(result.scale, shared).to(torch.float32) / shared, result.scale)
