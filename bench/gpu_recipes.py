"""Every algorithm family calibrated on a GPU and on the CPU: the same perplexity, and what the GPU held.

Model: ``tiny-llama-doc`` in its stored dtype; calibration: ``SAMPLES`` windows of 512 tokens of
``calib.txt``; quality: perplexity at context 512 on 32 windows of ``eval.txt`` (the protocol of
``bench/gptq_bench.py``), computed on the CPU for both runs. Each family runs twice in one process, on
``DEVICE`` and on the CPU; printed per run: perplexity, wall time of the compress call, the peak memory
allocated on the GPU (``torch.cuda.max_memory_allocated`` from a reset just before) and the warnings the
run raised (a ``DeviceErrorWarning`` there means a cut fell back: a bug). The GPU's free memory at the
start is printed once: ``layerwise plan`` forecasts the peaks from it (``--gpu-memory``).
A GPU run and a CPU run agree to the rounding of the matmuls (TF32 is off: same fp32 sums, other order).

    python bench/gpu_recipes.py cuda 32            # on a GPU host
    python bench/gpu_recipes.py cpu 4 --only GPTQ_W4A16,NVFP4   # smoke test here

Lines start with ``RECIPE`` (one per run), ``FREE`` (free GPU memory) and ``WARN`` (warnings).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

from gptq_bench import CALIB, EVAL, TINY_LLAMA, _windows, perplexity

AUTOROUND = ("AutoRoundModifier:\n  scheme: W4A16\n  iters: {iters}\n  batch_size: 8\n  ignore: [lm_head]\n")
#: name -> recipe (a preset name or YAML); the families of 2025-2026 after the first eight
RECIPES = {
    "GPTQ_W4A16": "GPTQ_W4A16",
    "W8A8": "W8A8",
    "FP8_DYNAMIC": "FP8_DYNAMIC",
    "FP8_static": "FP8",
    "SparseGPT24": "SparseGPTModifier:\n  sparsity: 0.5\n  mask_structure: '2:4'\n  ignore: [lm_head]\n",
    "Wanda50": "WandaModifier:\n  sparsity: 0.5\n  ignore: [lm_head]\n",
    "SQ_GPTQ_W8A8": "SQ_GPTQ_W8A8",
    "AWQ": "AWQ_W4A16_ASYM",
    "NVFP4": "NVFP4",
    "NVFP4A16": "NVFP4A16",
    "MXFP4": "MXFP4",
    "MXFP8": "MXFP8",
    "W4AFP8": "W4AFP8",
    "GPTQ_NVFP4": "GPTQ_NVFP4",
    "GPTAQ_W4A16": "GPTQModifier:\n  scheme: W4A16\n  gptaq: true\n  ignore: [lm_head]\n",
    "AutoRound_W4A16": AUTOROUND,
    "QuaRot_W4A4": "QUAROT_GPTQ_W4A4",
    "GPTQ_KV_FP8": ("GPTQModifier:\n  scheme: W4A16\n  ignore: [lm_head]\n  kv_cache_scheme: {num_bits: 8, "
                    "type: float, strategy: tensor, dynamic: false, symmetric: true}\n"),
}


def run_one(recipe: str, device: str, calib: list, held: list) -> str:
    import torch

    import layerwise
    from layerwise.loading import load_model

    model = load_model(TINY_LLAMA)
    on_gpu = device.startswith("cuda")
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = layerwise.compress(model, recipe, dataset=calib, max_seq_length=512,
                                   num_calibration_samples=len(calib), device=device, show_progress=False)
        if on_gpu:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = f" gpu_peak_MiB {torch.cuda.max_memory_allocated() / 2**20:.0f}" if on_gpu else ""
    kinds = sorted({w.category.__name__ for w in caught})
    for kind in kinds:
        if "Device" in kind:
            print(f"WARN {device} {kind}: {next(str(w.message) for w in caught if w.category.__name__ == kind)[:300]}")
    return f"ppl {perplexity(model.to('cpu'), held):.4f} {seconds:.1f}s{peak} warnings {','.join(kinds) or '-'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("device")
    parser.add_argument("samples", type=int, nargs="?", default=32)
    parser.add_argument("--only", default="", help="comma-separated names of RECIPES")
    parser.add_argument("--iters", type=int, default=50, help="AutoRound's steps per block")
    parser.add_argument("--no-cpu", action="store_true", help="the device's runs only")
    args = parser.parse_args()
    import torch

    from layerwise.loading import load_model, load_tokenizer

    torch.backends.cuda.matmul.allow_tf32 = False
    tokenizer = load_tokenizer(TINY_LLAMA)
    calib = [{"input_ids": w, "attention_mask": torch.ones_like(w)}
             for w in _windows(tokenizer, CALIB, args.samples, 512)]
    held = _windows(tokenizer, EVAL, 32, 512)
    if args.device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        print(f"FREE {free} of {total} bytes on {torch.cuda.get_device_name()}", flush=True)
    print(f"RECIPE original - ppl {perplexity(load_model(TINY_LLAMA), held):.4f}", flush=True)
    chosen = [n for n in args.only.split(",") if n] or list(RECIPES)
    for name in chosen:
        recipe = RECIPES[name].format(iters=args.iters) if name.startswith("AutoRound") else RECIPES[name]
        for device in (args.device,) if args.no_cpu or args.device == "cpu" else (args.device, "cpu"):
            try:
                print(f"RECIPE {name} {device} {run_one(recipe, device, calib, held)}", flush=True)
            except Exception as exc:  # noqa: BLE001 - a failure is a result: report it and go on
                print(f"RECIPE {name} {device} FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
