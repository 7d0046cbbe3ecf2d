"""Pruning quality over several calibration orders: layerwise against llm-compressor, order by order.

A pruned model's quality moves with float-level changes of its statistics: SparseGPT 2:4 on MiniLM
gave cosine 0.8506 with short samples joined in one forward and 0.8538 without (the same sums in
another order), and llm-compressor's own runs moved by 0.002 while its sampler drew a new order each
time. One run per tool compares two draws; this script compares their means over ``--orders`` seeded
shuffles of the same calibration samples, each tool getting the same order (sparsity_bench's
``LAYERWISE_BENCH_ORDER``), each run in a fresh process as in sparsity_bench.

    LLMCOMPRESSOR_PYTHON=/path/to/venv/bin/python python bench/quality_spread.py --case minilm \\
        --configs "SparseGPT 50%,SparseGPT 2:4" --orders 5

Bars: sparsity_bench's, on the means (cosine >= its - 0.002; ppl <= its x 1.002).
Markdown on stdout, progress on stderr; exit status 1 when a run failed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import sparsity_bench
from gptq_bench import COSINE_MARGIN, PPL_FACTOR, checked_configs, run_in_subprocess
from sparsity_bench import CONFIGS, LLMC, LW, ORDER_ENV, _attempt, run_llmcompressor


def quality(case: str, result: dict) -> float:
    return result["cosine"] if case == "minilm" else result["ppl"]


def spread_lines(case: str, config: str, runs: dict[str, list[dict]]) -> list[str]:
    """One configuration: each order's quality per tool, their means and ranges, and the bar on the means."""
    minilm = case == "minilm"
    metric = "cosine to fp32" if minilm else "ppl"
    lines = [f"#### {case} / {config}", "", f"| order | {LW} {metric} | {LLMC} {metric} |", "|---:|---:|---:|"]
    for order, (lw, llmc) in enumerate(zip(runs[LW], runs[LLMC])):
        lines.append(f"| {order} | {quality(case, lw):.4f} | {quality(case, llmc):.4f} |")
    means = {tool: statistics.mean(quality(case, r) for r in results) for tool, results in runs.items()}
    ranges = {tool: (min(quality(case, r) for r in results), max(quality(case, r) for r in results))
              for tool, results in runs.items()}
    if minilm:
        met = means[LW] >= means[LLMC] - COSINE_MARGIN
        bar = f"mean >= its - {COSINE_MARGIN}"
    else:
        met = means[LW] <= means[LLMC] * PPL_FACTOR
        bar = f"mean <= its x {PPL_FACTOR}"
    lines += ["", f"- means: {LW} {means[LW]:.4f} (range {ranges[LW][0]:.4f}-{ranges[LW][1]:.4f}), {LLMC} "
              f"{means[LLMC]:.4f} (range {ranges[LLMC][0]:.4f}-{ranges[LLMC][1]:.4f}); {bar}: "
              f"{'met' if met else 'MISSED'}", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["minilm", "tiny-llama"], default="minilm")
    parser.add_argument("--configs", default="SparseGPT 50%,SparseGPT 2:4",
                        help=f"comma-separated, from: {', '.join(c for c in CONFIGS if c != 'fp32')}")
    parser.add_argument("--orders", type=int, default=5, metavar="N", help="seeded calibration orders per tool")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    configs = checked_configs(parser, args, [c for c in CONFIGS if c != "fp32"])
    if args.orders < 2:
        parser.error("--orders must be at least 2 (a spread needs several runs)")
    if "LLMCOMPRESSOR_PYTHON" not in os.environ:
        parser.error("set LLMCOMPRESSOR_PYTHON to the python of a venv with llm-compressor installed")
    lines = [f"### Quality over {args.orders} calibration orders ({args.case})", ""]
    failed = False
    for config in configs:
        runs: dict[str, list[dict]] = {LW: [], LLMC: []}
        for order in range(args.orders):
            os.environ[ORDER_ENV] = str(order)
            try:
                runs[LW].append(_attempt(f"{args.case} / {config} / {LW} / order {order}", lambda c=config:
                                         run_in_subprocess(args.case, c, False, args.threads,
                                                           script=sparsity_bench.__file__)))
                runs[LLMC].append(_attempt(f"{args.case} / {config} / {LLMC} / order {order}", lambda c=config:
                                           run_llmcompressor(args.case, c, False, args.threads)))
            finally:
                del os.environ[ORDER_ENV]
        errors = [r["error"] for results in runs.values() for r in results if "error" in r]
        if errors:
            failed = True
            lines += [f"#### {args.case} / {config}: failed: {errors[0]}", ""]
            continue
        lines += spread_lines(args.case, config, runs)
    print("\n".join(lines))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
