"""Data-free presets on a model big enough to time: layerwise's compress() against llm-compressor's oneshot.

The presets that need no calibration data (round-to-nearest NVFP4A16, MXFP4A16, MXFP8A16, W4AFP8,
FP8_DYNAMIC, W4A16, ...) take well under a second on tiny-llama-doc for both tools, which is the noise of a
shared machine. This bench builds a random Llama-shaped bf16 checkpoint (``--hidden``, ``--intermediate``,
``--layers``; by default 2 layers of Llama-3.2-1B's width and MLP, about 130 M quantized weights) in a
temporary folder and, for each preset, in a fresh process per tool: loads it (not timed), then times
the compress call and the save, which together are the job (``compress(model, PRESET, output_dir=...)``;
``oneshot(model, recipe=QuantizationModifier(scheme=PRESET))`` then ``save_pretrained(save_compressed=True)``;
every Linear but ``lm_head``), and reports the process's peak RSS and the whole process's wall time
(interpreter, imports, loading, the job: what a user waits for). layerwise's save does not import
compressed-tensors (it writes the config dicts itself); llm-compressor imports it with itself, before its
timer. The two calls split the work differently: layerwise's compress() leaves the quantized values in the
model (what it evaluates and saves), llm-compressor's oneshot computes the scales only and quantizes the
weights when it saves, so only the sum compares like with like. That both write the same values is checked
elsewhere (``bench/activation_bench.py``: identical perplexities; the tests: byte-identical packing against
compressed-tensors). One layout differs: for W4AFP8 llm-compressor 0.14 (compressed-tensors 0.19) writes the
int4 weights unpacked, one int8 each (``int-quantized``, 132 MB here), where layerwise packs them
(``pack-quantized``, 71 MB, as for W4A16), so llm-compressor skips its packing there.

    LLMCOMPRESSOR_PYTHON=/tmp/llmc/bin/python python bench/datafree_bench.py --threads 1 --repeat 3

Markdown on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRESETS = ("NVFP4A16", "MXFP4A16", "MXFP8A16", "W4AFP8", "FP8_DYNAMIC", "W4A16")
TOOLS = ("layerwise", "llm-compressor")


def build(folder: Path, args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
                         vocab_size=1024, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)


def child(tool: str, preset: str, folder: str, threads: int | None) -> dict:
    import torch

    out = tempfile.mkdtemp(prefix="datafree-out-")

    if threads:
        torch.set_num_threads(threads)

    def quantized_weights(model: torch.nn.Module) -> int:  # counted before saving: llm-compressor packs them away
        return sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head")

    if tool == "layerwise":
        from layerwise import compress
        from layerwise.model_io.loading import load_model

        model = load_model(folder)
        weights = quantized_weights(model)
        start = time.perf_counter()
        compress(model, preset, show_progress=False, output_dir=out)
        compressed = saved = time.perf_counter()  # compress() saves: the two are one call
    else:
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        weights = quantized_weights(model)
        start = time.perf_counter()
        oneshot(model=model, recipe=[QuantizationModifier(scheme=preset, targets="Linear", ignore=["lm_head"])])
        compressed = time.perf_counter()
        model.save_pretrained(out, save_compressed=True)
        saved = time.perf_counter()
    seconds = saved - start
    result = {"seconds": seconds, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
              "weights": weights}
    if tool != "layerwise":
        result["oneshot_seconds"] = compressed - start
    shutil.rmtree(out, ignore_errors=True)
    return result


def run(tool: str, preset: str, folder: Path, args: argparse.Namespace) -> dict:
    python = os.environ["LLMCOMPRESSOR_PYTHON"] if tool == "llm-compressor" else sys.executable
    cmd = [python, __file__, "--child", tool, "--preset", preset, "--folder", str(folder)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent.parent)
    process_seconds = time.perf_counter() - start
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT "):]), "process_seconds": process_seconds}
    return {"error": " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1, help="runs per tool and preset, alternating; medians")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--preset", default="", help=argparse.SUPPRESS)
    parser.add_argument("--folder", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.preset, args.folder, args.threads)))
        return
    tools = TOOLS if os.environ.get("LLMCOMPRESSOR_PYTHON") else TOOLS[:1]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        build(folder, args)
        rows = ["| preset | tool | compress + save s (median) | runs | of which oneshot | whole process s (median) "
                "| peak RSS GB |", "|---|---|---:|---|---|---:|---:|"]
        ratios = []
        weights = 0
        for preset in args.presets.split(","):
            results: dict[str, list[dict]] = {tool: [] for tool in tools}
            for _ in range(args.repeat):
                for tool in tools:
                    print(f"{preset} / {tool} ...", file=sys.stderr, flush=True)
                    results[tool].append(run(tool, preset, folder, args))
                    print(f"  {results[tool][-1]}", file=sys.stderr, flush=True)
            medians = {}
            for tool in tools:
                done = [r for r in results[tool] if "error" in r] or results[tool]
                if "error" in done[0]:
                    rows.append(f"| {preset} | {tool} | failed: {done[0]['error'][:200]} | | | | |")
                    continue
                weights = done[0]["weights"]
                medians[tool] = statistics.median(r["seconds"] for r in done)
                runs = ", ".join(f"{r['seconds']:.2f}" for r in done)
                oneshot = ", ".join(f"{r['oneshot_seconds']:.2f}" for r in done if "oneshot_seconds" in r)
                whole = statistics.median(r["process_seconds"] for r in done)
                rows.append(f"| {preset} | {tool} | {medians[tool]:.2f} | {runs} | {oneshot} | {whole:.2f} | "
                            f"{max(r['peak_rss_gb'] for r in done):.2f} |")
            if len(medians) == 2:
                ratios.append(f"- **{preset}**: {medians['layerwise']:.2f} / {medians['llm-compressor']:.2f} s = "
                              f"{medians['layerwise'] / medians['llm-compressor']:.2f}x llm-compressor's time")
    print(f"Random Llama-shaped bf16 model: hidden {args.hidden}, MLP {args.intermediate}, {args.layers} layers "
          f"({weights / 1e6:.0f} M quantized weights); torch threads {args.threads or 'default'}; "
          f"{args.repeat} run(s) per tool and preset, each in a fresh process.\n")
    print("\n".join(rows + [""] + ratios))


if __name__ == "__main__":
    main()
