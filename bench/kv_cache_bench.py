"""The FP8 KV cache: perplexity with keys and values stored as FP8 E4M3 against the unquantized cache, layerwise
and llm-compressor side by side in one run.

Fixture and data are gptq_bench's (its helpers are imported, not copied): ``tiny-llama-doc`` (6 Llama layers,
6 KV heads of 64), 128 calibration windows of 512 tokens of ``calib.txt`` (``--quick``: 16), perplexity at
context 512 on 128 (16) windows of ``eval.txt``.

Configurations (weights untouched: only the KV cache is quantized, so the difference is the cache's):

* ``fp32``: the model as it is (unquantized cache);
* ``KV FP8 tensor``: layerwise ``QuantizationModifier(scheme=None, kv_cache_scheme="fp8")`` (one k_scale and
  one v_scale per layer); llm-compressor ``QuantizationModifier(kv_cache_scheme=QuantizationArgs(num_bits=8,
  type="float", strategy="tensor", dynamic=False, symmetric=True))`` with no scheme (its KV-only form);
* ``KV FP8 head``: the same with ``strategy: attn_head`` (one scale per KV head).

Measured, each configuration and tool in a fresh process: the wall time of the compress call (layerwise's
``compress()``, llm-compressor's ``oneshot``; neither loading nor evaluating), peak RSS when it returns, and
perplexity of the model each tool left in memory (its KV quantization active: layerwise's attention hook,
llm-compressor's hooked KV cache). layerwise's run also saves its output and reloads it with
``layerwise.load_compressed`` (max abs logit difference to the in-memory model on 2 windows), and, with
``--llmcompressor``, llm-compressor's Python (transformers 5.17, compressed-tensors 0.19, which apply a
``kv_cache_scheme`` on load) loads that same folder with plain ``AutoModelForCausalLM.from_pretrained`` and
compares its logits with layerwise's in-memory ones: whether a stock stack serves layerwise's scales as
layerwise computed with them.

    python bench/kv_cache_bench.py --threads 1
    LLMCOMPRESSOR_PYTHON=/tmp/llmc/bin/python python bench/kv_cache_bench.py --threads 1 --llmcompressor
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gptq_bench import (
    CALIB,
    EVAL,
    ROOT,
    TINY_LLAMA,
    _peak_rss_gb,
    _result_line,
    _windows,
    perplexity,
)

CONFIGS = {"fp32": None, "KV FP8 tensor": "tensor", "KV FP8 head": "attn_head"}
#: the issue's target: perplexity with the FP8 cache within 1 % of the unquantized cache's
PPL_TARGET = 1.01
PROBE = 2  # windows compared after reloading


def _data(tokenizer, quick: bool):
    import torch

    n = 16 if quick else 128
    calib = [{"input_ids": w, "attention_mask": torch.ones_like(w)} for w in _windows(tokenizer, CALIB, n, 512)]
    return calib, _windows(tokenizer, EVAL, n, 512)


def run_layerwise(config: str, quick: bool, out_dir: str) -> dict:
    import torch

    import layerwise
    from layerwise.model_io.loading import load_model, load_tokenizer
    from layerwise.plugins.savers.compressed_tensors import save_compressed

    tokenizer, model = load_tokenizer(TINY_LLAMA), load_model(TINY_LLAMA)
    calib, held_out = _data(tokenizer, quick)
    result: dict = {"samples": 0, "seconds": 0.0}
    strategy = CONFIGS[config]
    if strategy is not None:
        recipe = {"QuantizationModifier": {"scheme": None, "kv_cache_scheme": {
            "num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}}}
        start = time.perf_counter()
        model = layerwise.compress(model, recipe, dataset=calib, max_seq_length=512,
                                   num_calibration_samples=len(calib), show_progress=False)
        result.update(seconds=time.perf_counter() - start, peak_rss_gb=_peak_rss_gb(), samples=len(calib),
                      pipeline=model.layerwise_report.pipeline, pieces=model.layerwise_report.pieces)
        save_compressed(model, out_dir)
        with torch.no_grad():
            logits = [model(input_ids=w).logits for w in held_out[:PROBE]]
            reloaded, info = layerwise.load_compressed(out_dir, output_loading_info=True)
            result["reload_max_abs"] = max(float((reloaded(input_ids=w).logits - ref).abs().max())
                                           for w, ref in zip(held_out[:PROBE], logits))
        result["reload_unexpected"] = sorted(info["unexpected_keys"])
        torch.save({"windows": held_out[:PROBE], "logits": logits}, Path(out_dir) / "probe.pt")
        result["k_scales"] = sum(1 for n, _ in model.named_buffers() if n.endswith("k_scale"))
    result["ppl"] = perplexity(model, held_out)
    return result


def child(config: str, quick: bool, threads: int | None, out_dir: str) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    result = run_layerwise(config, quick, out_dir)
    result.setdefault("peak_rss_gb", _peak_rss_gb())
    print("RESULT " + json.dumps(result))


def llmcompressor_child(config: str, quick: bool, threads: int | None, out_dir: str) -> None:
    """Under LLMCOMPRESSOR_PYTHON: oneshot with a kv_cache_scheme, timed; its model's perplexity; then plain
    from_pretrained of layerwise's folder, compared with layerwise's in-memory logits."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    if not torch.accelerator.is_available():  # no device to copy to: pinning host memory only fails
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    model = AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval()
    calib, held_out = _data(tokenizer, quick)
    rows = [{"input_ids": w["input_ids"][0].tolist(), "attention_mask": [1] * w["input_ids"].shape[1]} for w in calib]
    scheme = QuantizationArgs(num_bits=8, type="float", strategy=CONFIGS[config], dynamic=False, symmetric=True)
    start = time.perf_counter()
    oneshot(model=model, recipe=QuantizationModifier(kv_cache_scheme=scheme), dataset=Dataset.from_list(rows),
            max_seq_length=512, num_calibration_samples=len(rows), sequential_targets=["LlamaDecoderLayer"])
    result = {"seconds": time.perf_counter() - start, "peak_rss_gb": _peak_rss_gb(), "samples": len(rows)}
    result["k_scales"] = sum(1 for n, _ in model.named_parameters() if n.endswith("k_scale"))
    result["ppl"] = perplexity(model, held_out)
    probe = torch.load(Path(out_dir) / "probe.pt")
    plain, info = AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True)
    with torch.no_grad():
        result["cross_max_abs"] = max(float((plain(input_ids=w).logits - ref).abs().max())
                                      for w, ref in zip(probe["windows"], probe["logits"]))
    result["cross_unexpected"] = sorted(info["unexpected_keys"])
    result["cross_hooked"] = sum(1 for m in plain.modules() if hasattr(m, "kv_cache"))
    print("RESULT " + json.dumps(result))


def _run(cmd: list[str], what: str) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return _result_line(subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT), what)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--llmcompressor", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "OUT"))
    parser.add_argument("--llmc-child", nargs=2, metavar=("CONFIG", "OUT"))
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.quick, args.threads, args.child[1])
    if args.llmc_child:
        return llmcompressor_child(args.llmc_child[0], args.quick, args.threads, args.llmc_child[1])
    flags = (["--quick"] if args.quick else []) + (["--threads", str(args.threads)] if args.threads else [])
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for config, strategy in CONFIGS.items():
            out = str(Path(tmp) / config.replace(" ", "_"))
            results[config] = {"layerwise": _run([sys.executable, __file__, "--child", config, out, *flags],
                                                 f"layerwise {config}")}
            if args.llmcompressor and strategy is not None:
                python = os.environ["LLMCOMPRESSOR_PYTHON"]
                results[config]["llm-compressor"] = _run([python, __file__, "--llmc-child", config, out, *flags],
                                                         f"llm-compressor {config}")
    print(report(results, args.quick))


def report(results: dict[str, dict], quick: bool) -> str:
    base = results["fp32"]["layerwise"]["ppl"]
    lines = [f"tiny-llama-doc, {'16' if quick else '128'} calibration / eval windows of 512 tokens; "
             f"{platform.machine()}, torch threads as given", "",
             "| config | tool | ppl | vs fp32 cache | compress s | peak RSS GB | reload max abs | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for config, by_tool in results.items():
        for tool, r in by_tool.items():
            ratio = r["ppl"] / base
            target = "" if config == "fp32" else (" (target <= 1.01: met)" if ratio <= PPL_TARGET else " (target missed)")
            reload = r.get("reload_max_abs", "")
            notes = []
            if "cross_max_abs" in r:
                notes.append(f"its transformers 5.17 + compressed-tensors 0.19 load layerwise's folder: max abs "
                             f"{r['cross_max_abs']:.3g} to layerwise's logits, {r['cross_hooked']} layers hooked, "
                             f"unexpected keys {r['cross_unexpected'] or 'none'}")
            if r.get("reload_unexpected"):
                notes.append(f"unexpected {r['reload_unexpected']}")
            if "pieces" in r:
                notes.append(f"pipeline {r['pipeline']}")
            lines.append(f"| {config} | {tool} | {r['ppl']:.4f} | {ratio:.4f}{target} | {r['seconds']:.1f} | "
                         f"{r['peak_rss_gb']:.2f} | {reload if reload == '' else f'{reload:.3g}'} | {'; '.join(notes)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
