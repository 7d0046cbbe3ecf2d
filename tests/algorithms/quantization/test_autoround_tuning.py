"""AutoRound's block tuning against a plain reference written from the paper's definition."""

import pytest
import torch

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.autoround import (
    AutoRoundError,
    BlockSample,
    Rounding,
    _Batches,
    _loss,
    fake_quantize_learned,
    quantize_learned,
    sample_order,
    tune_block,
)
from layerwise.algorithms.quantization.gptq import rtn_quantize


class TinyBlock(torch.nn.Module):
    """A residual MLP block: x + down(gelu(up(x)))."""

    def __init__(self, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.down(torch.nn.functional.gelu(self.up(x)))


def _block_and_samples(count: int = 6, seed: int = 0):
    torch.manual_seed(seed)
    block = TinyBlock()
    samples = []
    with torch.no_grad():
        for _ in range(count):
            x = torch.randn(1, 5, 16)
            samples.append(BlockSample((x,), {"scale": 0.5}, block(x, scale=0.5)))
    return block, samples


def _layers(block, args):
    return {"up": (block.up.weight.detach(), args, False), "down": (block.down.weight.detach(), args, False)}


# -- the reference: the definition, written out per group with plain loops ---------------------------
def _reference_fake_quant(w, v, alpha, beta, bits, sym, group):
    """Per output row and group: range clipped by alpha/beta, scale and zero point as compressed-tensors
    defines them, q = clamp(round(w / s + v) + z); returns (q - z) * s."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    rows = []
    for r in range(w.shape[0]):
        parts = []
        for g in range(w.shape[1] // group):
            cols = slice(g * group, (g + 1) * group)
            lo = torch.clamp(w[r, cols].min() * beta[r, g], max=0.0)
            hi = torch.clamp(w[r, cols].max() * alpha[r, g], min=0.0)
            if sym:
                s = torch.clamp(torch.maximum(lo.abs(), hi.abs()) / ((qmax - qmin) / 2), min=torch.finfo(torch.float32).eps)
                z = torch.zeros(())
            else:
                s = torch.clamp((hi - lo) / (qmax - qmin), min=torch.finfo(torch.float32).eps)
                raw = qmin - lo / s
                z = torch.clamp(raw + (torch.round(raw) - raw).detach(), qmin, qmax)
            x = w[r, cols] / s + v[r, cols]
            q = torch.clamp(x + (torch.round(x) - x).detach() + z, qmin, qmax)
            parts.append((q - z) * s)
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def _reference_tune(block, samples, bits, sym, group, iters, batch_size, seed, lr=None):
    names = ["up", "down"]
    weights = {n: getattr(block, n).weight.detach().float() for n in names}
    params = {n: [torch.zeros_like(weights[n]), torch.ones(weights[n].shape[0], weights[n].shape[1] // group),
                  torch.ones(weights[n].shape[0], weights[n].shape[1] // group)] for n in names}
    for p in params.values():
        for t in p:
            t.requires_grad_(True)

    def loss_on(indices, values):
        total = 0.0
        for i in indices:
            x, = samples[i].args
            fq = {n: _reference_fake_quant(weights[n], *values[n], bits, sym, group) for n in names}
            h = torch.nn.functional.gelu(x @ fq["up"].t() + block.up.bias.detach())
            out = x + 0.5 * (h @ fq["down"].t())
            total = total + ((out - samples[i].target) ** 2).mean() / len(indices)
        return total

    order = sample_order(len(samples), batch_size, iters, seed)  # the draw order is part of the spec
    best, best_loss = None, float("inf")
    lr = 1.0 / iters if lr is None else lr
    for step in range(iters):
        loss = loss_on(order[step], params)
        loss.backward()
        if float(loss.detach()) < best_loss:
            best_loss = float(loss.detach())
            best = {n: [t.detach().clone() for t in p] for n, p in params.items()}
        with torch.no_grad():
            for p in params.values():
                for k, t in enumerate(p):
                    t -= lr * (1 - step / iters) * torch.sign(t.grad)
                    t.clamp_(*((-0.5, 0.5) if k == 0 else (0.5, 1.0)))
                    t.grad = None
    start = {n: [torch.zeros_like(weights[n]), torch.ones_like(p[1]), torch.ones_like(p[2])] for n, p in params.items()}
    with torch.no_grad():
        everything = list(range(len(samples)))
        if float(loss_on(everything, best)) > float(loss_on(everything, start)):
            best = start
        return {n: _reference_fake_quant(weights[n], *best[n], bits, sym, group) for n in names}


@pytest.mark.parametrize("bits,sym", [(4, True), (3, False), (2, False)])
def test_tune_block_matches_the_plain_reference(bits, sym):
    block, samples = _block_and_samples()
    args = QuantizationArgs(num_bits=bits, symmetric=sym, strategy="group", group_size=8)
    # every step on all six samples (the step losses compare like with like) and steps small enough to improve
    # on round-to-nearest (1 / 6 overshoots here), so a learned step is kept and compared
    result = tune_block(block, _layers(block, args), samples, iters=6, batch_size=6, seed=3, lr=0.02)
    expected = _reference_tune(block, samples, bits, sym, 8, iters=6, batch_size=6, seed=3, lr=0.02)
    for name in ("up", "down"):
        weight = getattr(block, name).weight.detach()
        got, _, _ = quantize_learned(weight, args, result.roundings[name], torch.float32)
        torch.testing.assert_close(got, expected[name], rtol=0, atol=1e-6)
    assert result.best_step > 0  # a learned step was kept (step 0 is round-to-nearest), so the comparison tested it


def test_same_seed_same_result_and_block_unchanged():
    block, samples = _block_and_samples()
    before = {k: v.clone() for k, v in block.state_dict().items()}
    args = QuantizationArgs(num_bits=3, symmetric=False, strategy="group", group_size=8)
    first = tune_block(block, _layers(block, args), samples, iters=10, batch_size=3, seed=7)
    second = tune_block(block, _layers(block, args), samples, iters=10, batch_size=3, seed=7)
    for name in ("up", "down"):
        for a, b in zip(first.roundings[name].tensors(), second.roundings[name].tensors()):
            assert torch.equal(a, b)
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())
    assert all(p.requires_grad and p.grad is None for p in block.parameters())


@pytest.mark.parametrize("bits,group,gain", [(4, 8, 1.0), (3, 16, 0.9), (2, 8, 0.9)])
def test_learned_rounding_is_never_worse_than_rtn_and_better_at_low_bits(bits, group, gain):
    block, samples = _block_and_samples(count=8)
    args = QuantizationArgs(num_bits=bits, symmetric=False, strategy="group", group_size=group)
    noisy = tune_block(block, _layers(block, args), samples, iters=20, batch_size=2)  # steps compare batches
    assert noisy.loss <= noisy.rtn_loss
    result = tune_block(block, _layers(block, args), samples, iters=20, batch_size=8)  # every step sees all
    assert result.loss <= gain * result.rtn_loss  # 4 bits asym in groups of 8: RTN is hard to beat here


def test_the_start_is_round_to_nearest():
    torch.manual_seed(0)
    weight = torch.randn(6, 32)
    for args in (QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=8),
                 QuantizationArgs(num_bits=3, symmetric=False, strategy="channel", group_size=None)):
        rtn = rtn_quantize(weight, args, scale_dtype=torch.float32)
        values, scale, _ = quantize_learned(weight, args, Rounding.start(weight, args), torch.float32)
        torch.testing.assert_close(values, rtn.weight)
        torch.testing.assert_close(scale, rtn.scale)
        torch.testing.assert_close(fake_quantize_learned(weight, args, Rounding.start(weight, args)), rtn.weight)


def _plain_fake_quant(w, v, alpha, beta, bits, sym, columns):
    """The learned fake quantization as plain differentiable ops, every group at once; autograd takes
    the gradients through the straight-through rounds and the clamps."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    g = w.reshape(w.shape[0], -1, columns)
    lo = torch.clamp(g.amin(-1, keepdim=True) * beta.reshape(*g.shape[:2], 1), max=0.0)
    hi = torch.clamp(g.amax(-1, keepdim=True) * alpha.reshape(*g.shape[:2], 1), min=0.0)
    if sym:
        s = torch.clamp(torch.maximum(lo.abs(), hi.abs()) / ((qmax - qmin) / 2), min=torch.finfo(torch.float32).eps)
        z = torch.zeros_like(s)
    else:
        s = torch.clamp((hi - lo) / (qmax - qmin), min=torch.finfo(torch.float32).eps)
        raw = torch.clamp(qmin - lo / s, qmin, qmax)
        z = raw + (torch.round(raw) - raw).detach()
    x = g / s + v.reshape(g.shape)
    q = torch.clamp(x + (torch.round(x) - x).detach() + z, qmin, qmax)
    return ((q - z) * s).reshape(w.shape)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("strategy", ["group", "channel"])
def test_fused_gradients_are_autograds_of_the_plain_formula(bits, sym, strategy):
    """The fused fake quantization's values and its gradients in the offsets and both clipping factors
    against autograd through the formula written out, with offsets and factors spread over their ranges
    so that the clamps bite (many weights at W2) and some do not."""
    torch.manual_seed(bits * 10 + sym)
    weight = torch.randn(24, 64)
    args = QuantizationArgs(num_bits=bits, symmetric=sym, strategy=strategy, group_size=16 if strategy == "group" else None)
    columns = 16 if strategy == "group" else 64
    start = Rounding.start(weight, args)
    rounding = Rounding(torch.rand_like(start.offset) - 0.5, 0.5 + 0.5 * torch.rand_like(start.max_scale),
                        0.5 + 0.5 * torch.rand_like(start.min_scale))
    upstream = torch.randn(weight.shape)
    fused = Rounding(*(t.clone().requires_grad_(True) for t in rounding.tensors()))
    plain = Rounding(*(t.clone().requires_grad_(True) for t in rounding.tensors()))
    got = fake_quantize_learned(weight, args, fused)
    want = _plain_fake_quant(weight, plain.offset, plain.max_scale, plain.min_scale, bits, sym, columns)
    assert torch.equal(got, want)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    clamped = plain.offset.grad == 0
    assert clamped.any() and not clamped.all()  # both sides of the clamp are exercised
    for name, a, b in zip(("offset", "max_scale", "min_scale"), fused.tensors(), plain.tensors()):
        assert b.grad is not None and b.grad.abs().sum() > 0, name  # the comparison compares something
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5 * float(b.grad.abs().max()), msg=name)


def test_bfloat16_steps_run_the_block_in_bfloat16_and_keep_float32_parameters_scored_in_float32():
    """step_dtype: each step's forward is autocast (the Linears compute in bfloat16), while the learned
    parameters stay float32 and the kept ones are scored against round-to-nearest in the block's float32;
    deterministic, and still below round-to-nearest's loss at 3 bits."""
    block, samples = _block_and_samples(count=8)
    args = QuantizationArgs(num_bits=3, symmetric=False, strategy="group", group_size=8)
    seen: list[tuple[bool, torch.dtype]] = []
    hook = block.up.register_forward_hook(lambda module, inputs, output: seen.append((torch.is_grad_enabled(),
                                                                                       output.dtype)))
    result = tune_block(block, _layers(block, args), samples, iters=10, batch_size=8, lr=0.02,
                        step_dtype=torch.bfloat16)
    hook.remove()
    assert [dtype for grad, dtype in seen if grad] == [torch.bfloat16] * 10  # one stacked call per step
    assert {dtype for grad, dtype in seen if not grad} == {torch.float32}  # the stacking check and the scoring
    assert all(t.dtype == torch.float32 for r in result.roundings.values() for t in r.tensors())
    assert result.best_step > 0 and result.loss < result.rtn_loss
    fp32 = tune_block(block, _layers(block, args), samples, iters=10, batch_size=8, lr=0.02)
    assert result.loss < 1.1 * fp32.loss  # the rounded steps cost little on this block
    again = tune_block(block, _layers(block, args), samples, iters=10, batch_size=8, lr=0.02,
                       step_dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for name in result.roundings
               for a, b in zip(result.roundings[name].tensors(), again.roundings[name].tensors()))


def test_zero_iterations_keep_round_to_nearest_and_bad_input_is_refused():
    block, samples = _block_and_samples(count=2)
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=8)
    result = tune_block(block, _layers(block, args), samples, iters=0)
    assert result.best_step == -1 and result.loss == result.rtn_loss
    with pytest.raises(AutoRoundError, match="at least one sample"):
        tune_block(block, _layers(block, args), [], iters=2)
    fp8 = QuantizationArgs(type="float", num_bits=8, symmetric=True, strategy="channel", group_size=None)
    with pytest.raises(AutoRoundError, match="strategy 'channel' or 'group'"):
        tune_block(block, _layers(block, fp8), samples, iters=2)


def test_sample_order_reads_every_sample_once_per_pass():
    steps = sample_order(5, 2, 10, seed=1)
    flat = [i for step in steps for i in step]
    assert len(steps) == 10 and all(len(s) == 2 for s in steps)
    assert sorted(flat[:5]) == list(range(5)) and sorted(flat[5:10]) == list(range(5))
    assert steps == sample_order(5, 2, 10, seed=1) and steps != sample_order(5, 2, 10, seed=2)


class GainBlock(TinyBlock):
    """Takes a per-sample gain of shape ``(1,)``: it looks batched (first dimension = the rows), but stacked
    the block adds the gains up, a different output without an error, so stacking must be refused."""

    def forward(self, x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x))) * gain.sum()


def test_a_step_runs_its_samples_stacked_only_where_the_block_gives_the_same_outputs():
    """The step's loss is the mean of the separate samples' losses, stacked or not. Stacking promises the
    separate outputs only up to a different matmul split's rounding (``same_outputs``), so the weights are
    perturbed: with the block's own weights the separate losses are exactly 0 and the stacked one is
    rounding (2e-16 with 2 threads), a comparison that says nothing about the mean."""
    block, samples = _block_and_samples(count=6)
    torch.manual_seed(1)
    gain_block = GainBlock()
    with torch.no_grad():
        gained = [BlockSample((s.args[0],), {"gain": torch.rand(1)}, s.target) for s in samples]
    for runner, stacks in ((block, True), (gain_block, False)):
        used = samples if runner is block else gained
        weights = {f"{n}.weight": getattr(runner, n).weight.detach() for n in ("up", "down")}
        replaced = {n: w + 0.05 * torch.randn_like(w) for n, w in weights.items()}
        batches = _Batches(runner, used)
        got = batches.loss(replaced, [4, 0, 2])
        want = sum(_loss(runner, replaced, used[i]) for i in (4, 0, 2)) / 3
        assert want > 1e-4  # far above the rounding of a different matmul split
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        assert list(batches.stacks.values()) == [stacks]


def _has_cpp_compiler() -> bool:
    import shutil

    return any(shutil.which(name) for name in ("g++", "c++", "clang++"))


@pytest.mark.slow
@pytest.mark.skipif(not _has_cpp_compiler(), reason="torch.compile on CPU needs a C++ compiler")
def test_a_compiled_step_gives_the_uncompiled_loss_and_gradients():
    """The compiled step (fake quantization, block, loss in one compiled function) against the same step
    uncompiled: equal up to float rounding, with offsets and factors spread so that the clamps bite."""
    from layerwise.algorithms.quantization.autoround import _Layers

    block, samples = _block_and_samples(count=4)
    for p in block.parameters():
        p.requires_grad_(False)
    args = QuantizationArgs(num_bits=3, symmetric=False, strategy="group", group_size=8)
    layers = _Layers(_layers(block, args))
    torch.manual_seed(5)
    start = {n: Rounding.start(w, args) for n, (w, _, _) in layers.layers.items()}
    spread = {n: Rounding(torch.rand_like(r.offset) - 0.5, 0.5 + 0.5 * torch.rand_like(r.max_scale),
                          0.5 + 0.5 * torch.rand_like(r.min_scale)) for n, r in start.items()}
    results = []
    for compile in (False, True):
        batches = _Batches(block, samples, compile=compile)
        roundings = {n: Rounding(*(t.clone().requires_grad_(True) for t in r.tensors())) for n, r in spread.items()}
        loss = batches.step_loss(layers, roundings, [0, 2, 3])
        loss.backward()
        results.append((loss.detach(), [t.grad for r in roundings.values() for t in r.tensors()]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    assert eager_loss > 0
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=0)
    for got, want in zip(compiled_grads, eager_grads):
        assert want.abs().sum() > 0  # the comparison compares something
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def test_a_step_that_fails_to_compile_runs_uncompiled(monkeypatch):
    """Compiling is an option that can fail (no C++ compiler): the steps then run uncompiled, the same result."""
    from layerwise.algorithms.quantization import autoround

    def broken(*_args, **_kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(autoround, "_compiled_loss", lambda: broken)
    block, samples = _block_and_samples()
    args = QuantizationArgs(num_bits=3, symmetric=False, strategy="group", group_size=8)
    plain = tune_block(block, _layers(block, args), samples, iters=6, batch_size=6, seed=2, lr=0.02)
    fallen = tune_block(block, _layers(block, args), samples, iters=6, batch_size=6, seed=2, lr=0.02, compile=True)
    for name in ("up", "down"):
        for a, b in zip(plain.roundings[name].tensors(), fallen.roundings[name].tensors()):
            assert torch.equal(a, b)
    assert plain.best_step == fallen.best_step > 0
