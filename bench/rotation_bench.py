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

A random rotation's draw moves W4A4's perplexity by as much as the gaps between the tools, so
``--seeds 0,1,2,3,4`` runs every rotating configuration once per seed (layerwise's ``RotationModifier.seed``;
llm-compressor's transforms draw from a ``torch.Generator`` it never seeds, so the same matrices every
run, unless ``--seed-theirs`` seeds that generator with each seed too) and adds a row of means per
method, then the ratios of the means of R1+R4 + GPTQ to SpinQuant R1+R4 + GPTQ's. ``--theirs`` picks which of
llm-compressor's methods run (all by default).

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
    if args.seed_theirs:
        from compressed_tensors.transform.factory.base import TransformFactory

        unseeded = TransformFactory.__init__

        def seeded(self, name, scheme, seed=None):
            unseeded(self, name, scheme, args.seed if seed is None else seed)

        TransformFactory.__init__ = seeded
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


def rotates(config: str) -> bool:
    """Whether the configuration draws a random rotation (so its seed matters)."""
    return "R1" in config or "QuIP" in config


def run(config: str, scheme: str, seed: int, args: argparse.Namespace) -> dict:
    """One configuration in a fresh process (llm-compressor's in its own Python); its RESULT line."""
    python = os.environ["LLMCOMPRESSOR_PYTHON"] if config in THEIRS else sys.executable
    cmd = [python, __file__, "--child", config, "--scheme", scheme, "--samples", str(args.samples),
           "--eval", str(args.eval), "--seed", str(seed), "--device", args.device] + (
               ["--seed-theirs"] if args.seed_theirs else [])
    return child_result(cmd, f"{config} / {scheme} / seed {seed}", args.threads)


def seeds_of(config: str, args: argparse.Namespace) -> list[int]:
    """The seeds a configuration runs with: every ``--seeds`` where its draw is seeded, else one run."""
    seeded = rotates(config) and (config in OURS or args.seed_theirs)
    return args.seed_list if seeded else args.seed_list[:1]


def mean_of(runs: list[dict]) -> dict:
    """The mean ppl, KL and seconds of a method's runs (an error when any failed)."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    return {key: sum(r[key] for r in runs) / len(runs) for key in ("ppl", "kl", "seconds")}


def report(results: dict[tuple[str, str], list[tuple[int, dict]]], args: argparse.Namespace) -> list[str]:
    (_, fp), = results[("fp32", "")]
    seeded = "R1 seeds " + ",".join(map(str, args.seed_list))
    theirs = "llm-compressor's transforms seeded alike" if args.seed_theirs else "llm-compressor's transforms unseeded"
    lines = [f"tiny-llama-doc, {args.samples} calibration windows of 512 tokens, {args.eval} eval windows, {seeded}, "
             f"{theirs} (fp32 ppl {fp.get('ppl', float('nan')):.3f})", "",
             "| scheme | method | seed | ppl | KL to fp32 | KL vs GPTQ | compress s |", "|---|---|---|---|---|---|---|"]
    means: dict[tuple[str, str], dict] = {}
    for scheme in SCHEMES:
        gptq = mean_of([r for _, r in results.get(("GPTQ", scheme), [])]).get("kl") \
            if ("GPTQ", scheme) in results else None
        for config in (*OURS, *THEIRS):
            runs = results.get((config, scheme))
            if not runs:
                continue
            rows = [(str(seed) if len(runs) > 1 or rotates(config) else "", r) for seed, r in runs]
            if len(runs) > 1:
                means[(config, scheme)] = mean_of([r for _, r in runs])
                rows.append((f"**mean of {len(runs)}**", means[(config, scheme)]))
            elif "error" not in runs[0][1]:
                means[(config, scheme)] = runs[0][1]
            for label, r in rows:
                if "error" in r:
                    lines.append(f"| {scheme} | {config} | {label} | failed: {r['error'][:300]} | | | |")
                    continue
                versus = f"{r['kl'] / gptq:.3f}x" if gptq else ""
                lines.append(f"| {scheme} | {config} | {label} | {r['ppl']:.3f} | {r['kl']:.5f} | {versus} | "
                             f"{r['seconds']:.1f} |")
    for scheme in SCHEMES:
        ours, spin = means.get(("R1+R4 + GPTQ", scheme)), means.get(("llm-compressor SpinQuant R1+R4 + GPTQ", scheme))
        if ours and spin:
            lines += ["", f"{scheme}, R1+R4 + GPTQ / llm-compressor SpinQuant R1+R4 + GPTQ (means): ppl "
                      f"{ours['ppl'] / spin['ppl']:.4f}x (target <= 1.002x), KL {ours['kl'] / spin['kl']:.3f}x, "
                      f"time {ours['seconds'] / spin['seconds']:.2f}x (target <= 0.5x)"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--eval", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="the random rotations' seed (one run)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds, a run per seed and their means")
    parser.add_argument("--seed-theirs", action="store_true",
                        help="seed llm-compressor's transforms with each seed too (else its fixed default draw)")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated: " + ", ".join(SCHEMES))
    parser.add_argument("--methods", default=",".join(OURS))
    parser.add_argument("--llmcompressor", action="store_true")
    parser.add_argument("--device", default="cpu", help="where layerwise calibrates (autoround_bench's --device)")
    parser.add_argument("--theirs", default=",".join(THEIRS), help="llm-compressor's methods run with --llmcompressor")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--scheme", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child = child_llmcompressor if args.child in THEIRS else child_layerwise
        print("RESULT " + json.dumps(child(args.child, args.scheme, args)))
        return
    args.seed_list = [int(seed) for seed in args.seeds.split(",") if seed] if args.seeds else [args.seed]
    results = {("fp32", ""): [(0, run("fp32", "", 0, args))]}
    methods = [m for m in args.methods.split(",") if m] + ([m for m in args.theirs.split(",") if m] if args.llmcompressor else [])
    for scheme in [s for s in args.schemes.split(",") if s]:
        for method in methods:
            results[(method, scheme)] = [(seed, run(method, scheme, seed, args)) for seed in seeds_of(method, args)]
    print("\n".join(report(results, args)))
    sys.exit(1 if any("error" in r for runs in results.values() for _, r in runs) else 0)


if __name__ == "__main__":
    main()
