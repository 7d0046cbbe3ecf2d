"""Rotations before GPTQ at W4A8 and W4A4: layerwise's residual (R1) and online (R4) Hadamards, and
llm-compressor's SpinQuant and QuIP, in one run.

Case: ``tiny-llama-doc`` (6 Llama layers, hidden 384, MLP 1024), calibrated on ``--samples`` windows of
512 tokens of ``calib.txt``; quality on ``--eval`` windows of ``eval.txt``: perplexity and the mean
per-token KL divergence from fp32 (see ``autoround_bench.py``). Schemes: int4 weights, symmetric, groups
of 128, with int8 (``W4A8``) or int4 (``W4A4``) inputs, symmetric, per token, dynamic; ``lm_head`` not
quantized. Configurations, each in a fresh process on the same windows:

* ``GPTQ``: layerwise's GPTQModifier alone;
* ``R1 + GPTQ``: RotationModifier (random Hadamard of the residual stream, ``--seed``, folded) first;
* ``R1+R4 + GPTQ``: the same with ``online: true`` (a Hadamard before every ``down_proj``, online);
* ``R1+R2+R4 + GPTQ``: and ``heads: true`` (a Hadamard per attention head, folded into v_proj / o_proj);
* with ``--llmcompressor`` (``LLMCOMPRESSOR_PYTHON``: a Python with llm-compressor 0.14):
  its GPTQModifier alone, SpinQuantModifier(R1, R4, and R1, R2, R4; ``random-hadamard``, as 384 is no
  power of two) + GPTQ, and QuIPModifier(``v``: an online random Hadamard before every Linear but ``lm_head``) + GPTQ,
  evaluated in memory after ``oneshot`` (its online transforms are hooks there; transformers would drop
  them on reload).

Wall time is the compress call (``compress()`` / ``oneshot``). Markdown on stdout, progress on stderr.

    LLMCOMPRESSOR_PYTHON=/tmp/llmc/bin/python python bench/rotation_bench.py --samples 16 --eval 16 \
        --threads 1 --llmcompressor
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from autoround_bench import (
    CALIB,
    EVAL,
    TINY_LLAMA,
    _windows,
    child_result,
    quality,
    timed_layerwise,
)

SCHEMES = {"W4A8 g128": 8, "W4A4 g128": 4}
OURS = ("GPTQ", "R1 + GPTQ", "R1+R4 + GPTQ", "R1+R2+R4 + GPTQ")
THEIRS = ("llm-compressor GPTQ", "llm-compressor SpinQuant R1+R4 + GPTQ", "llm-compressor SpinQuant R1+R2+R4 + GPTQ",
          "llm-compressor QuIP v + GPTQ")


def scheme_dict(scheme: str) -> dict:
    return {"targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128},
            "input_activations": {"num_bits": SCHEMES[scheme], "type": "int", "symmetric": True,
                                  "strategy": "token", "dynamic": True}}


def child_layerwise(method: str, scheme: str, args: argparse.Namespace) -> dict:
    from layerwise.plugins.modifiers.gptq import GPTQModifier
    from layerwise.plugins.modifiers.rotation import RotationModifier

    recipe = None
    if method != "fp32":
        recipe = [GPTQModifier(scheme=scheme_dict(scheme), ignore=["lm_head"])]
        if method != "GPTQ":
            recipe.insert(0, RotationModifier(seed=args.seed, online="R4" in method, heads="R2" in method))
    return timed_layerwise(recipe, args)


def child_llmcompressor(method: str, scheme: str, args: argparse.Namespace) -> dict:
    """Under LLMCOMPRESSOR_PYTHON: llm-compressor's rotation (if any) + GPTQ, evaluated in memory."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads) if args.threads else None
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    model = AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval()
    rows = [{"input_ids": w[0].tolist(), "attention_mask": [1] * w.shape[1]}
            for w in _windows(tokenizer, CALIB, args.samples)]
    recipe = [GPTQModifier(config_groups={"group_0": scheme_dict(scheme)}, ignore=["lm_head"])]
    if "SpinQuant" in method:
        from llmcompressor.modifiers.transform import SpinQuantModifier

        rotations = ["R1", "R2", "R4"] if "R2" in method else ["R1", "R4"]
        recipe.insert(0, SpinQuantModifier(rotations=rotations, transform_type="random-hadamard"))
    elif "QuIP" in method:
        from llmcompressor.modifiers.transform import QuIPModifier

        recipe.insert(0, QuIPModifier(rotations=["v"], transform_type="random-hadamard"))
    start = time.perf_counter()
    oneshot(model=model, dataset=Dataset.from_list(rows), recipe=recipe, max_seq_length=512,
            num_calibration_samples=len(rows), sequential_targets=["LlamaDecoderLayer"])
    seconds = time.perf_counter() - start
    reference = AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval()
    return {"seconds": seconds, **quality(model.eval(), reference, _windows(tokenizer, EVAL, args.eval))}


def run(config: str, scheme: str, args: argparse.Namespace) -> dict:
    """One configuration in a fresh process (llm-compressor's in its own Python); its RESULT line."""
    python = os.environ["LLMCOMPRESSOR_PYTHON"] if config in THEIRS else sys.executable
    cmd = [python, __file__, "--child", config, "--scheme", scheme, "--samples", str(args.samples),
           "--eval", str(args.eval), "--seed", str(args.seed)]
    return child_result(cmd, f"{config} / {scheme}", args.threads)


def report(results: dict[tuple[str, str], dict], args: argparse.Namespace) -> list[str]:
    fp = results[("fp32", "")]
    lines = [f"tiny-llama-doc, {args.samples} calibration windows of 512 tokens, {args.eval} eval windows, "
             f"R1 seed {args.seed} (fp32 ppl {fp.get('ppl', float('nan')):.3f})", "",
             "| scheme | method | ppl | KL to fp32 | KL vs GPTQ | compress s |", "|---|---|---|---|---|---|"]
    for scheme in SCHEMES:
        gptq = results.get(("GPTQ", scheme), {}).get("kl")
        for config in (*OURS, *THEIRS):
            r = results.get((config, scheme))
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {scheme} | {config} | failed: {r['error'][:300]} | | | |")
                continue
            versus = f"{r['kl'] / gptq:.3f}x" if gptq else ""
            lines.append(f"| {scheme} | {config} | {r['ppl']:.3f} | {r['kl']:.5f} | {versus} | {r['seconds']:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--eval", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="layerwise's random residual rotation (R1)")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated: " + ", ".join(SCHEMES))
    parser.add_argument("--methods", default=",".join(OURS))
    parser.add_argument("--llmcompressor", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--scheme", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child = child_llmcompressor if args.child in THEIRS else child_layerwise
        print("RESULT " + json.dumps(child(args.child, args.scheme, args)))
        return
    results = {("fp32", ""): run("fp32", "", args)}
    methods = [m for m in args.methods.split(",") if m] + (list(THEIRS) if args.llmcompressor else [])
    for scheme in [s for s in args.schemes.split(",") if s]:
        for method in methods:
            results[(method, scheme)] = run(method, scheme, args)
    print("\n".join(report(results, args)))
    sys.exit(1 if any("error" in r for r in results.values()) else 0)


if __name__ == "__main__":
    main()
