"""Report-card benchmark: what ``layerwise eval`` costs beyond the forwards, and that it measures what gptq_bench does.

On ``tiny-llama-doc`` (``../shared/fixtures``), 128 windows of 512 tokens of ``eval.txt``: the windows of
``bench/gptq_bench.py`` (its blank-line separated blocks tokenized without special tokens, each followed by
EOS, cut into non-overlapping windows; every token but a window's first scored).

* **parity**: the perplexity of fp32 and of round-to-nearest W4A16 (group 128, in memory) by
  ``gptq_bench.perplexity`` over ``gptq_bench._windows`` and by ``layerwise.reports.quality.evaluate`` over
  the file; target: equal to 4 decimals.
* **overhead**: the time of ``evaluate`` (side by side, and one at a time: the original's predictions
  on disk) over the time of two plain forward passes (``model(input_ids=window)`` under ``no_grad``, the
  original then the compressed model, over every window), measured in one process taking turns, median of
  ``--repeat`` runs, over the first ``--timing-windows`` windows (16: the ratio, not the total, is what
  is measured). Both the process's CPU time (what this process computed, the steadier measure on a shared
  machine) and wall time are given. ``evaluate``'s time includes tokenizing the text; target: <= 1.2x.
* **quality**: the report card of RTN W8A16, W4A16 and W3A16 (group 128) against fp32.

    python bench/eval_bench.py                 # markdown on stdout
    python bench/eval_bench.py --quick         # 16 windows, one run: a smoke test
    python bench/eval_bench.py --part timing --repeat 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
from gptq_bench import EVAL, TINY_LLAMA, _windows, perplexity

W3A16 = {"QuantizationModifier": {"scheme": "W4A16", "num_bits": 3, "ignore": ["lm_head"]}}
SCHEMES = {"W8A16": "W8A16", "W4A16": "W4A16", "W3A16": W3A16}
#: the evaluation may take at most this many times two plain forward passes
OVERHEAD_TARGET = 1.2
LENGTH = 512


def plain_forwards(models: list[torch.nn.Module], windows: list[torch.Tensor]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) for each model's forward over every window, nothing else."""
    cpu, wall = time.process_time(), time.perf_counter()
    with torch.no_grad():
        for model in models:
            for window in windows:
                model(input_ids=window)
    return time.process_time() - cpu, time.perf_counter() - wall


def timed_evaluate(original, compressed, tokenizer, count: int, together: bool):
    """((CPU seconds, wall seconds), report) of one ``evaluate`` over ``count`` windows."""
    from layerwise.reports.quality import evaluate

    cpu, wall = time.process_time(), time.perf_counter()
    report = evaluate(original, compressed, EVAL, tokenizer, window_length=LENGTH, max_windows=count,
                      together=together, show_progress=False)
    return (time.process_time() - cpu, time.perf_counter() - wall), report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 windows, one run: a smoke test, not a measurement")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each (median reported)")
    parser.add_argument("--timing-windows", type=int, default=16, help="windows of each timed run (default 16)")
    parser.add_argument("--part", choices=["all", "parity", "timing"], default="all",
                        help="parity and quality, timing, or both (default)")
    args = parser.parse_args()
    import layerwise
    from layerwise.model_io.loading import load_model, load_tokenizer

    count, repeat = (16, 1) if args.quick else (128, args.repeat)
    tokenizer = load_tokenizer(TINY_LLAMA)
    original = load_model(TINY_LLAMA)
    windows = _windows(tokenizer, EVAL, count, LENGTH)
    compressed = {name: layerwise.compress(load_model(TINY_LLAMA), recipe, show_progress=False)
                  for name, recipe in SCHEMES.items()}
    w4 = compressed["W4A16"]

    lines = [f"## Report card: `layerwise eval` on tiny-llama-doc ({'quick, not a measurement' if args.quick else 'full'})",
             "", f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch "
             f"{torch.__version__} with {torch.get_num_threads()} threads; windows of {LENGTH} tokens of eval.txt.", ""]
    if args.part in ("all", "parity"):
        lines += parity_and_quality(original, compressed, tokenizer, windows, count)
    if args.part in ("all", "timing"):
        lines += timing(original, w4, tokenizer, windows, min(count, args.timing_windows), repeat)
    lines.append(f"(load average at the end: {os.getloadavg()[0]:.1f})")
    print("\n".join(lines))


def parity_and_quality(original, compressed: dict, tokenizer, windows: list, count: int) -> list[str]:
    print(f"[bench] parity on {len(windows)} windows ...", file=sys.stderr, flush=True)
    ours = {name: timed_evaluate(original, model, tokenizer, count, True)[1] for name, model in compressed.items()}
    parity = [("fp32", perplexity(original, windows), ours["W4A16"].tokens.perplexity_original),
              ("RTN W4A16 g128", perplexity(compressed["W4A16"], windows), ours["W4A16"].tokens.perplexity_compressed)]
    lines = [f"Perplexity over {len(windows)} windows ({ours['W4A16'].tokens.tokens:,} tokens scored), gptq_bench's "
             f"`perplexity()` vs `layerwise eval`:", "",
             "| model | gptq_bench | layerwise eval | equal to 4 decimals |", "|---|---:|---:|---|"]
    for name, theirs, mine in parity:
        lines.append(f"| {name} | {theirs:.4f} | {mine:.4f} | {_ok(f'{theirs:.4f}' == f'{mine:.4f}')} |")
    lines += ["", "Report card of round-to-nearest schemes (group 128) against fp32:", "",
              "| scheme | ppl | KL mean | KL median | KL p99 | KL max | top-1 | top-5 |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, report in ours.items():
        t = report.tokens
        lines.append(f"| {name} | {t.perplexity_compressed:.4f} | {t.kl_mean:.2e} | {t.kl_median:.2e} | "
                     f"{t.kl_p99:.2e} | {t.kl_max:.2e} | {t.top1_agreement:.4f} | {t.top5_agreement:.4f} |")
    return lines + [""]


def timing(original, w4, tokenizer, windows: list, timed: int, repeat: int) -> list[str]:
    print(f"[bench] timing, {repeat} run(s) of each over {timed} windows ...", file=sys.stderr, flush=True)
    plain_forwards([original, w4], windows[:1])  # warm: the first call of a model pays one-time costs
    runs: dict[str, list[tuple[float, float]]] = {"plain": [], "side": [], "apart": []}
    for _ in range(repeat):  # taking turns, so that a change in the shared machine's load hits all three
        runs["plain"].append(plain_forwards([original, w4], windows[:timed]))
        runs["side"].append(timed_evaluate(original, w4, tokenizer, timed, True)[0])
        runs["apart"].append(timed_evaluate(original, w4, tokenizer, timed, False)[0])
    cpu = {name: statistics.median(r[0] for r in values) for name, values in runs.items()}
    wall = {name: statistics.median(r[1] for r in values) for name, values in runs.items()}
    lines = [f"Time over the first {timed} windows, median of {repeat} runs taking turns:", "",
             "| what | CPU s | / plain | wall s | / plain | runs (wall s) |", "|---|---:|---:|---:|---:|---|"]
    labels = {"plain": "two plain forward passes (original, then W4A16)", "side": "`evaluate`, side by side",
              "apart": "`evaluate`, one at a time (original's log-probs on disk)"}
    for name, label in labels.items():
        lines.append(f"| {label} | {cpu[name]:.2f} | {cpu[name] / cpu['plain']:.2f}x | {wall[name]:.2f} | "
                     f"{wall[name] / wall['plain']:.2f}x | {', '.join(f'{w:.1f}' for _, w in runs[name])} |")
    ratio = cpu["side"] / cpu["plain"]
    lines += ["", f"- eval overhead, side by side: {ratio:.2f}x the CPU time of two plain forward passes (target <= "
                  f"{OVERHEAD_TARGET}x: {_ok(ratio <= OVERHEAD_TARGET)}); wall time "
                  f"{wall['side'] / wall['plain']:.2f}x", ""]
    return lines


def _ok(flag: bool) -> str:
    return "met" if flag else "MISSED"


if __name__ == "__main__":
    main()
