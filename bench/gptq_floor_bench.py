"""The float32 work under any GPTQ calibration of tiny-llama-doc, timed in plain torch, against both tools' runs.

Whatever a tool does around it, a GPTQ calibration in float32 runs the model forward once over the calibration
windows (each layer's inputs are the quantized model's, so every layer runs once more than nothing) and adds
every window's ``X^T X`` into each Linear input's Hessian (q/k/v share one input, gate/up another). This script
times exactly that with plain torch in a fresh process, one window at a time as both tools feed them:

* ``forward``: ``model(window)`` under ``no_grad`` for the 128 calibration windows of 512 tokens that
  ``activation_bench.py`` uses (no hooks, no quantization);
* ``Hessians``: the products alone, the inputs captured beforehand: ``X^T X`` in full (one ``addmm`` per
  input) and as the lower half in strips of 128 rows (layerwise's ``add_gram``, about half the flops).

Then, with ``--runs``, the same process layout runs ``activation_bench.py``'s layerwise and llm-compressor
children for ``--config`` (default ``GPTQ W4AFP8``), and the table gives each tool's time over the floor and the
floor over llm-compressor's time: the smallest ratio a float32 tool could reach here. Where that exceeds a
target, the target is out of reach on this machine for a reason no code path can remove.

    LAYERWISE_FIXTURES=../shared/fixtures python bench/gptq_floor_bench.py --threads 1
    LAYERWISE_FIXTURES=../shared/fixtures LLMCOMPRESSOR_PYTHON=/tmp/llmc/bin/python \\
        python bench/gptq_floor_bench.py --threads 1 --runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

BENCH = Path(__file__).resolve().parent
TARGET = 0.5  # issue 32: layerwise's time <= 0.5x llm-compressor's


def floor(samples: int) -> dict:
    """The forward and the Hessian products, timed apart (seconds)."""
    import torch
    from autoround_bench import CALIB, TINY_LLAMA, _windows
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from layerwise.algorithms.hessian import add_gram

    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    model = AutoModelForCausalLM.from_pretrained(TINY_LLAMA, dtype=torch.float32).eval()
    windows = _windows(tokenizer, CALIB, samples)
    with torch.no_grad():
        model(windows[0], use_cache=False)  # warm-up: the allocator and the first kernels
        start = time.perf_counter()
        for window in windows:
            model(window, use_cache=False)
        forward = time.perf_counter() - start
    inputs = _hessian_inputs(model, windows)
    full = half = 0.0
    with torch.no_grad():
        for per_window in inputs.values():
            width = per_window[0].shape[-1]
            gram = torch.zeros(width, width)
            start = time.perf_counter()
            for x in per_window:
                gram.addmm_(x.t(), x)
            full += time.perf_counter() - start
            gram.zero_()
            start = time.perf_counter()
            for x in per_window:
                add_gram(gram, x)
            half += time.perf_counter() - start
    return {"forward": forward, "hessians_full": full, "hessians_half": half, "windows": len(windows),
            "hessian_inputs": len(inputs)}


def _hessian_inputs(model, windows) -> dict[str, list]:
    """Each distinct Linear input of the decoder layers (the first Linear reading it names it), per window."""
    import torch

    readers = {"q_proj": "attn_in", "o_proj": "o_in", "gate_proj": "mlp_in", "down_proj": "down_in"}
    inputs: dict[str, list] = {}
    hooks = []
    for index, layer in enumerate(model.model.layers):
        for name, module in layer.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in readers:
                key = f"{index}.{readers[leaf]}"
                hooks.append(module.register_forward_pre_hook(
                    lambda m, args, key=key: inputs.setdefault(key, []).append(args[0][0].detach().clone())))
    with torch.no_grad():
        for window in windows:
            model(window, use_cache=False)
    for hook in hooks:
        hook.remove()
    return inputs


def _child_result(cmd: list[str], what: str) -> dict:
    """``cmd`` run offline from the project's root; its RESULT line (gptq_bench's reader)."""
    from gptq_bench import _result_line

    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return _result_line(subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=BENCH.parent), what)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--runs", action="store_true",
                        help="also run activation_bench's layerwise (and, with LLMCOMPRESSOR_PYTHON, llm-compressor) "
                             "children for --config")
    parser.add_argument("--config", default="GPTQ W4AFP8")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    threads = ["--threads", str(args.threads)] if args.threads else []
    if args.child:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        print("RESULT " + json.dumps(floor(args.samples)))
        return
    print("running the float32 floor ...", file=sys.stderr, flush=True)
    result = _child_result([sys.executable, __file__, "--child", "--samples", str(args.samples), *threads], "floor")
    runs: dict[str, float] = {}
    if args.runs:
        activation = str(BENCH / "activation_bench.py")
        print(f"running layerwise {args.config} ...", file=sys.stderr, flush=True)
        runs["layerwise"] = _child_result([sys.executable, activation, "--child", "tiny-llama", args.config, *threads],
                                          "layerwise")["seconds"]
        if python := os.environ.get("LLMCOMPRESSOR_PYTHON"):
            from activation_bench import MAPPINGS_ENV
            from gptq_bench import case_model_path

            os.environ.setdefault(MAPPINGS_ENV, "[]")  # no smoothing in a GPTQ config: its recipe reads none

            print(f"running llm-compressor {args.config} ...", file=sys.stderr, flush=True)
            runs["llm-compressor"] = _child_result(
                [python, activation, "--llmc-child", "tiny-llama", args.config, case_model_path("tiny-llama"),
                 *threads], "llm-compressor")["seconds"]
    work = result["forward"] + result["hessians_half"]
    print(f"tiny-llama-doc, {result['windows']} windows of 512 tokens, {result['hessian_inputs']} Hessian inputs, "
          f"torch threads {args.threads or torch_threads()}\n")
    print("| what | seconds |\n|---|---:|")
    print(f"| forward, plain torch, no_grad | {result['forward']:.1f} |")
    print(f"| Hessians X^T X, full products | {result['hessians_full']:.1f} |")
    print(f"| Hessians, lower half in strips (add_gram) | {result['hessians_half']:.1f} |")
    print(f"| **floor: forward + half Hessians** | **{work:.1f}** |")
    for tool, seconds in runs.items():
        print(f"| {tool} {args.config} (compress call) | {seconds:.1f} ({seconds / work:.2f}x the floor) |")
    if "llm-compressor" in runs:
        best = work / runs["llm-compressor"]
        verdict = "within reach" if best <= TARGET else "out of reach in float32 on this machine"
        print(f"\nThe floor alone is {best:.2f}x llm-compressor's time (target <= {TARGET}x: {verdict}); "
              f"layerwise's run {runs.get('layerwise', float('nan')) / runs['llm-compressor']:.2f}x.")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
