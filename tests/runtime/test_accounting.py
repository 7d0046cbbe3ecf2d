"""Run accounting: a phase's own seconds, FLOP formulas, and the report's time line."""

from __future__ import annotations

import time

import torch

from layerwise.algorithms.quantization.gptq import GRAM_STRIP, add_gram
from layerwise.reports.text import time_text
from layerwise.runtime.accounting import Accounting, gptq_solve_flops, gram_flops


def test_an_inner_phase_is_taken_out_of_the_enclosing_one():
    accounting = Accounting()
    with accounting.timed("forward"):
        time.sleep(0.02)
        accounting.add("hessian", 0.5, flops=10)
        with accounting.timed("inner"):
            time.sleep(0.02)
    assert accounting["hessian"].seconds == 0.5 and accounting["hessian"].flops == 10
    assert 0.015 < accounting["inner"].seconds < 0.2
    # forward's own time: its elapsed less the inner phases (0.5 s were never slept: it goes negative)
    assert accounting["forward"].seconds < 0
    outside = Accounting()
    outside.add("solve", 2.0, flops=4e9)
    assert outside["solve"].gflops_per_second == 2.0
    assert outside.as_dict()["solve"] == {"seconds": 2.0, "flops": 4e9, "calls": 1, "gflops_per_second": 2.0}


def test_gram_flops_count_the_strips_add_gram_computes():
    rows, columns = 10, 300
    # strips of 128 rows over the upper triangle: widths 128, 128, 44 against 300, 172, 44 columns
    assert gram_flops(rows, columns, 128) == 2 * rows * (128 * 300 + 128 * 172 + 44 * 44)
    x = torch.randn(rows, columns)
    gram = torch.zeros(columns, columns)
    add_gram(gram, x)  # the same strips: the upper triangle is exact
    torch.testing.assert_close(torch.triu(gram), torch.triu(x.t() @ x), rtol=1e-5, atol=1e-4)
    assert GRAM_STRIP == 128
    tall = torch.zeros(columns, columns)
    add_gram(tall, x, strip=256)  # a GPU's taller strips: the same upper triangle, more of the lower one
    torch.testing.assert_close(torch.triu(tall), torch.triu(gram), rtol=1e-5, atol=1e-4)
    assert gram_flops(rows, columns, 256) == 2 * rows * (256 * 300 + 44 * 44)
    assert gptq_solve_flops(4, 3) == 4 * 9 + 2 * 27 // 3


def test_a_gpu_takes_its_gram_in_strips_as_tall_as_a_bounded_product_allows():
    from layerwise.algorithms.hessian import CUDA_STRIP_BYTES, gram_strip

    assert gram_strip(8192, "cpu") == GRAM_STRIP  # the CPU's measured best
    assert gram_strip(2048, "cuda:0") >= 2048  # one product for the whole matrix
    assert gram_strip(8192, "cuda") == 2048  # four, each 64 MiB of float32
    assert gram_strip(28672, "cuda") == 512 and 512 * 28672 * 4 <= CUDA_STRIP_BYTES
    assert gram_strip(10**7, "cuda") == GRAM_STRIP  # never below the CPU's strips


def test_time_text_splits_the_run_and_names_the_rest_other():
    accounting = {"forward": {"seconds": 2.0, "gflops_per_second": None},
                  "GPTQ Hessians": {"seconds": 1.0, "gflops_per_second": 171.4},
                  "unused": {"seconds": 0.0}}
    assert time_text(5.0, accounting) == "5.0 s (forward 2.0 s, GPTQ Hessians 1.0 s at 171 GFLOP/s, other 2.0 s)"
    assert time_text(5.0, {}) == "5.0 s"
