"""AutoRound against GPTQ and round-to-nearest at 3 and 2 bits, and llm-compressor's AutoRound, in one run.

Case: ``tiny-llama-doc`` (6 Llama layers, hidden 384), calibrated on ``--samples`` windows of 512 tokens of
``calib.txt``; quality is perplexity at context 512 on ``--eval`` windows of ``eval.txt``. Configurations
(each in a fresh process, the same windows for every one; ``lm_head`` is not quantized):

* ``fp32``; ``RTN`` (QuantizationModifier); ``GPTQ`` (GPTQModifier, block 128, dampening 0.01, actorder
  static); ``AutoRound`` (AutoRoundModifier, ``--iters`` steps of ``--batch-size`` samples, lr 1/iters,
  seed 42): each at ``W3A16 g128`` (int3, asymmetric, groups of 128) and ``W2A16 g64`` (int2, asymmetric,
  groups of 64);
* with ``--w4a8``: ``GPTQ`` at W4A8 (int4 weights, symmetric, groups of 128; int8 inputs per token at run
  time, fake-quantized in the evaluation) alone, and after ``RotationModifier`` (random Hadamard, seed 0);
* with ``--llmcompressor`` and ``LLMCOMPRESSOR_PYTHON`` pointing at a Python with llm-compressor and
  auto-round: llm-compressor 0.14's ``AutoRoundModifier`` (the auto-round package inside) with the same
  scheme, iters, batch size and samples (``enable_torch_compile=False``: no compiler on this machine),
  its saved checkpoint loaded back with compressed-tensors (dequantized) for the perplexity.

Quality: perplexity, and the mean per-token KL divergence from fp32's next-token distribution (this small
model's perplexity barely moves with quantization; its KL does). Wall time is the compress call (``compress()`` / ``oneshot``), not loading nor evaluating. The paper's
defaults are 200 iters, batch 8, 128 samples of 2048 tokens: the quick run below uses fewer (said in the
table) so that it takes minutes on two CPU cores.

    python bench/autoround_bench.py --iters 20 --batch-size 4 --samples 16 --eval 16 --w4a8
    LLMCOMPRESSOR_PYTHON=/tmp/llmc/bin/python python bench/autoround_bench.py --iters 20 --batch-size 4 \
        --samples 16 --eval 16 --w4a8 --llmcompressor

Markdown on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("LAYERWISE_FIXTURES", ROOT.parent / "shared" / "fixtures"))
CALIB, EVAL, TINY_LLAMA = FIXTURES / "calib.txt", FIXTURES / "eval.txt", FIXTURES / "tiny-llama-doc"

#: scheme name -> (num_bits, group_size); both asymmetric
SCHEMES = {"W3A16 g128": (3, 128), "W2A16 g64": (2, 64)}
METHODS = ("RTN", "GPTQ", "AutoRound")
#: W4A8: int4 weights (symmetric, groups of 128), int8 inputs per token at run time
W4A8 = "W4A8 g128"
W4A8_METHODS = ("GPTQ", "Rotation + GPTQ")
LLMC = "llm-compressor AutoRound"


def _windows(tokenizer, path: Path, count: int, length: int = 512):
    import torch

    ids: list[int] = []
    for block in path.read_text(encoding="utf-8").split("\n\n"):
        ids.extend(tokenizer(block, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
        if len(ids) >= count * length:
            break
    return [torch.tensor([ids[i:i + length]]) for i in range(0, count * length, length) if i + length <= len(ids)]


def quality(model, reference, windows) -> dict:
    """Perplexity, and the mean KL divergence (per token) of the model's next-token distribution from the
    fp32 model's: this small model's perplexity barely moves with quantization, its KL does."""
    import torch

    total, kl, count = 0.0, 0.0, 0
    with torch.no_grad():
        for ids in windows:
            logits = model(input_ids=ids).logits[0, :-1].float()
            want = reference(input_ids=ids).logits[0, :-1].float()
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            kl += torch.nn.functional.kl_div(logits.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                             reduction="sum").item()
            count += ids.shape[1] - 1
    return {"ppl": math.exp(total / count), "kl": kl / count}


def _weights(bits: int, group: int) -> dict:
    return {"num_bits": bits, "type": "int", "symmetric": False, "strategy": "group", "group_size": group}


def layerwise_recipe(method: str, scheme: str, args: argparse.Namespace):
    from layerwise.plugins.modifiers.autoround import AutoRoundModifier
    from layerwise.plugins.modifiers.gptq import GPTQModifier
    from layerwise.plugins.modifiers.quantization import QuantizationModifier
    from layerwise.plugins.modifiers.rotation import W4A8 as W4A8_SCHEME
    from layerwise.plugins.modifiers.rotation import RotationModifier

    if scheme == W4A8:
        gptq = GPTQModifier(scheme=W4A8_SCHEME, ignore=["lm_head"])
        return [RotationModifier(), gptq] if method == "Rotation + GPTQ" else gptq

    weights = {"scheme": {"weights": _weights(*SCHEMES[scheme]), "targets": ["Linear"]}, "ignore": ["lm_head"]}
    if method == "RTN":
        return QuantizationModifier(**weights)
    if method == "GPTQ":
        return GPTQModifier(**weights)
    return AutoRoundModifier(**weights, iters=args.iters, batch_size=args.batch_size, nsamples=args.samples)


def child_layerwise(method: str, scheme: str, args: argparse.Namespace) -> dict:
    recipe = layerwise_recipe(method, scheme, args) if method != "fp32" else None
    result = timed_layerwise(recipe, args, with_data=method != "RTN")
    if method == "AutoRound":
        result["blocks_better_than_rtn"] = sum(r["loss"] < r["rtn_loss"] for r in recipe.summary)
    return result


def timed_layerwise(recipe, args: argparse.Namespace, with_data: bool = True) -> dict:
    """tiny-llama-doc compressed with ``recipe`` (None: fp32) on ``--samples`` windows of ``calib.txt``, the
    compress call timed, then evaluated against fp32 on ``--eval`` windows of ``eval.txt``."""
    import torch

    from layerwise import compress
    from layerwise.model_io.loading import load_model, load_tokenizer

    torch.set_num_threads(args.threads) if args.threads else None
    tokenizer, model = load_tokenizer(TINY_LLAMA), load_model(TINY_LLAMA)
    calib = [{"input_ids": w, "attention_mask": torch.ones_like(w)} for w in _windows(tokenizer, CALIB, args.samples)]
    result = {"seconds": 0.0}
    if recipe is not None:
        start = time.perf_counter()
        model = compress(model, recipe, dataset=calib if with_data else None, max_seq_length=512,
                         num_calibration_samples=len(calib), show_progress=False)
        result["seconds"] = time.perf_counter() - start
    result.update(quality(model, load_model(TINY_LLAMA), _windows(tokenizer, EVAL, args.eval)))
    return result


def child_llmcompressor(scheme: str, args: argparse.Namespace) -> dict:
    """Under LLMCOMPRESSOR_PYTHON: llm-compressor's AutoRoundModifier, saved, reloaded, evaluated."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.autoround import AutoRoundModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    torch.set_num_threads(args.threads) if args.threads else None
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    model = AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval()
    windows = _windows(tokenizer, CALIB, args.samples)
    rows = [{"input_ids": w[0].tolist(), "attention_mask": [1] * w.shape[1]} for w in windows]
    recipe = AutoRoundModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": _weights(*SCHEMES[scheme])}},
                               ignore=["lm_head"], iters=args.iters, batch_size=args.batch_size,
                               enable_torch_compile=False)
    start = time.perf_counter()
    oneshot(model=model, dataset=Dataset.from_list(rows), recipe=recipe, max_seq_length=512,
            num_calibration_samples=len(rows), sequential_targets=["LlamaDecoderLayer"])
    seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder, save_compressed=True)
        tokenizer.save_pretrained(folder)
        reloaded = AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
        reference = AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval()
        return {"seconds": seconds, **quality(reloaded, reference, _windows(tokenizer, EVAL, args.eval))}


def run(config: str, scheme: str, args: argparse.Namespace) -> dict:
    """One configuration in a fresh process (llm-compressor's in its own Python); its RESULT line."""
    python = os.environ["LLMCOMPRESSOR_PYTHON"] if config == LLMC else sys.executable
    cmd = [python, __file__, "--child", config, "--scheme", scheme, "--iters", str(args.iters),
           "--batch-size", str(args.batch_size), "--samples", str(args.samples), "--eval", str(args.eval)]
    return child_result(cmd, f"{config} / {scheme}", args.threads)


def child_result(cmd: list[str], label: str, threads: int | None) -> dict:
    """Run one configuration's child process (offline, ``--threads`` passed on) and read its RESULT line."""
    if threads:
        cmd = [*cmd, "--threads", str(threads)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    print(f"running {label} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            print(f"  {label}: {line[len('RESULT '):]}", file=sys.stderr, flush=True)
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": " | ".join(tail) or f"exit status {proc.returncode}"}


def report(results: dict[tuple[str, str], dict], args: argparse.Namespace) -> list[str]:
    fp = results[("fp32", "")]
    lines = [f"tiny-llama-doc, {args.samples} calibration windows of 512 tokens, perplexity on {args.eval} eval "
             f"windows (fp32: {fp.get('ppl', float('nan')):.3f}); AutoRound iters {args.iters}, batch "
             f"{args.batch_size}", "", "| scheme | method | ppl | KL to fp32 | KL vs GPTQ | compress s | note |",
             "|---|---|---|---|---|---|---|"]
    for scheme in (*SCHEMES, W4A8):
        gptq = results.get(("GPTQ", scheme), {}).get("kl")
        for config in dict.fromkeys((*METHODS, LLMC, *W4A8_METHODS)):  # GPTQ is in both lists
            r = results.get((config, scheme))
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {scheme} | {config} | failed | | | {r['error'][:300]} |")
                continue
            versus = f"{r['kl'] / gptq:.3f}x" if gptq else ""
            note = (f"{r['blocks_better_than_rtn']}/6 blocks below RTN's loss"
                    if "blocks_better_than_rtn" in r else "")
            lines.append(f"| {scheme} | {config} | {r['ppl']:.3f} | {r['kl']:.4f} | {versus} | {r['seconds']:.1f} | "
                         f"{note} |")
        ours, theirs = results.get(("AutoRound", scheme)), results.get((LLMC, scheme))
        if ours and theirs and "ppl" in ours and "ppl" in theirs:
            lines.append(f"| {scheme} | layerwise / llm-compressor | {ours['ppl'] / theirs['ppl']:.3f}x | "
                         f"{ours['kl'] / theirs['kl']:.3f}x | | {ours['seconds'] / theirs['seconds']:.2f}x | "
                         f"ratios |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--eval", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated: " + ", ".join(SCHEMES))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--w4a8", action="store_true", help="also GPTQ W4A8 with and without a rotation first")
    parser.add_argument("--llmcompressor", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--scheme", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = child_llmcompressor(args.scheme, args) if args.child == LLMC else child_layerwise(
            args.child, args.scheme, args)
        print("RESULT " + json.dumps(result))
        return
    results = {("fp32", ""): run("fp32", "", args)}
    methods = [m for m in args.methods.split(",") if m]
    if args.llmcompressor:
        methods.append(LLMC)
    for scheme in [s for s in args.schemes.split(",") if s]:
        for method in methods:
            results[(method, scheme)] = run(method, scheme, args)
    if args.w4a8:
        for method in W4A8_METHODS:
            results[(method, W4A8)] = run(method, W4A8, args)
    print("\n".join(report(results, args)))
    sys.exit(1 if any("error" in r for r in results.values()) else 0)


if __name__ == "__main__":
    main()
