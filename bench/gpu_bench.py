"""GPTQ on one GPU, piece by piece: layerwise against llm-compressor in one run, and the distance to the
device's own matmul peak.

Model: a random-weight bf16 Llama of Llama-3.2-3B shape (``--shape 3b``; ``1b`` for a short GPU lease, ``8b`` when
time allows)
saved once to ``--work``; calibration: ``--samples`` x ``--seq-len`` random tokens, the same ids
for both tools; recipe: GPTQ W4A16, groups of 128, ``lm_head`` left out. Each tool runs in a fresh
process (its own peak host RSS and GPU memory); llm-compressor from the Python named by
``LLMCOMPRESSOR_PYTHON`` (its own venv, as ``bench/gptq_bench.py`` does). Printed per tool: wall
time of the compress call, calibration tokens/s, peak GPU memory, peak host RSS; for layerwise the
TFLOP/s of its forwards and Hessian accumulation against the bf16 and fp32 ``torch.matmul`` peaks
measured in the same process, and the peak GPU memory against one piece (a decoder layer's
weights, the cached activations of every sample at a cut, the largest layer's Hessian).
``--quality``: tiny-llama-doc GPTQ W4A16 calibrated on ``--device`` and on the CPU, perplexity of
both (the protocol of ``bench/gptq_bench.py``).

Each tool's process is stopped after ``--time-limit`` seconds (a tool that hangs or crawls is
reported as timed out, the other still runs). The distance to the physical limit: the FLOPs of the
forwards at the bf16 peak, of the Hessians and the solves at the fp32 peak, all measured in the same
process, summed into the time a run could take at best, against the time it took.
``--profile`` runs layerwise under the torch profiler and adds: the kernels launched (on the CPU: the
operators run) per GPTQ solve, and the time in host-device copies (``Memcpy HtoD`` / ``DtoH``).

    LLMCOMPRESSOR_PYTHON=/opt/llmc/bin/python python bench/gpu_bench.py --shape 3b --llmcompressor --quality
    python bench/gpu_bench.py --shape tiny --samples 4 --seq-len 64 --device cpu --quality  # smoke test, no GPU
    python bench/gpu_bench.py --shape tiny --samples 4 --seq-len 64 --device cpu --profile  # the profile's smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

from gptq_bench import CALIB, EVAL, TINY_LLAMA, _peak_rss_gb, _result_line, _windows, perplexity

SHAPES = {
    # name: (hidden, intermediate, layers, heads, kv heads, vocab, tied)
    "tiny": (256, 512, 4, 4, 2, 1024, True),
    "1b": (2048, 8192, 16, 32, 8, 128256, True),  # Llama-3.2-1B: what the offline GPU runner's first stage uses
    "3b": (3072, 8192, 28, 24, 8, 128256, True),
    "8b": (4096, 14336, 32, 32, 8, 128256, False),
}
RECIPE = "GPTQModifier:\n  scheme: W4A16\n  ignore: [lm_head]\n"


def save_model(shape: str, folder: Path) -> Path:
    """A random-weight bf16 Llama of ``shape`` in ``folder`` (made once)."""
    if not (folder / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        hidden, inter, layers, heads, kv, vocab, tied = SHAPES[shape]
        config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                             max_position_embeddings=8192, tie_word_embeddings=tied, dtype="bfloat16")
        torch.manual_seed(0)
        with torch.device("cpu"):
            LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder, max_shard_size="5GB")
        from layerwise.testing import word_tokenizer

        word_tokenizer(vocab).save_pretrained(folder)  # llm-compressor's oneshot wants a processor
    return folder


def token_rows(vocab: int, samples: int, seq_len: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (seq_len,), generator=generator).tolist() for _ in range(samples)]


def matmul_peak_tflops(device: str, dtype_name: str, size: int = 8192, repeats: int = 10) -> float:
    """The best rate of a ``size``-square matmul on ``device`` in ``dtype``, now (TFLOP/s). fp32 is measured with
    TF32 off, as layerwise's Hessians and solves run."""
    import torch

    dtype = getattr(torch, dtype_name)
    if device == "cpu":
        size = min(size, 2048)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for i in range(repeats + 2):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        if i >= 2:
            best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best / 1e12


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def forward_flops(config, tokens: int, seq_len: int) -> float:
    """FLOPs of one forward of the decoder stack over ``tokens`` (2 per multiply-add of every Linear, plus
    attention's two products; the head is not run)."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    linear = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    attention = 2 * 2 * seq_len * q  # per token: scores and weighted sum (full, not causal-halved)
    return 2.0 * layers * tokens * linear + layers * tokens * attention


def child_layerwise(folder: str, device: str, samples: int, seq_len: int, profile: bool = False) -> None:
    import contextlib

    import torch
    from transformers import AutoConfig

    import layerwise
    from layerwise.algorithms.hessian import gram_dtype

    config = AutoConfig.from_pretrained(folder)
    rows = token_rows(config.vocab_size, samples, seq_len)
    peaks = {"bf16": matmul_peak_tflops(device, "bfloat16"), "fp32": matmul_peak_tflops(device, "float32")}
    batches = [{"input_ids": torch.tensor([r])} for r in rows]
    free = None
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        free = torch.cuda.mem_get_info(device)[0]
    # issue 35: the plan's forecast of the GPU peak, made before the run on the same free memory
    planned = layerwise.plan(folder, RECIPE, dataset=batches, num_calibration_samples=samples, max_seq_length=seq_len,
                             device=device, gpu_memory=free)
    profiler = _profiler(device) if profile else contextlib.nullcontext()
    start = time.perf_counter()
    with profiler, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = layerwise.compress(folder, RECIPE, dataset=batches, num_calibration_samples=samples,
                                   max_seq_length=seq_len, device=device, show_progress=False)
    seconds = time.perf_counter() - start
    report = model.layerwise_report
    tokens = samples * seq_len
    result = {"tool": "layerwise", "seconds": seconds, "tokens_per_s": tokens / seconds, "peak_rss_gb": _peak_rss_gb(),
              "peak_gpu_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.startswith("cuda") else None,
              "pieces": report.pieces, "accounting": report.accounting, "matmul_peak_tflops": peaks,
              "forward_flops": forward_flops(config, tokens, seq_len), "piece_gb": piece_gb(config, tokens),
              "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
              "free_gpu_bytes": free, "placement": getattr(report, "placement", ""),
              "hessian_dtype": str(gram_dtype(torch.zeros(1, device=device, dtype=torch.bfloat16))),
              "planned_gpu_peak": planned.gpu_peak, "planned_gpu_parts": planned.gpu_peak_parts,
              "planned_cache": planned.cache_bytes, "cache_peak": getattr(report, "cache_peak_bytes", 0),
              "warnings": sorted({f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught})}
    if profile:
        result["profile"] = profile_summary(profiler, report.accounting)
    print("RESULT " + json.dumps(result))


def _profiler(device: str):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    return profile(activities=activities)


#: profiler events that are host-device copies (CUDA's own names, and the operator that issues them)
COPY_EVENTS = ("Memcpy HtoD", "Memcpy DtoH", "Memcpy DtoD")


def profile_summary(profiler, accounting: dict) -> dict:
    """Kernels launched per GPTQ solve (on the CPU: operators run) and seconds in host-device copies."""
    events = profiler.events()
    device_kernels = [e for e in events if getattr(e, "device_type", None) is not None
                      and str(e.device_type).endswith("CUDA")]
    kernels = len(device_kernels) if device_kernels else sum(1 for e in events if e.name.startswith("aten::"))
    copies = [e for e in device_kernels if e.name.startswith(COPY_EVENTS)]
    copy_seconds = sum(_device_us(e) for e in copies) / 1e6
    solves = accounting.get("GPTQ solves", {})
    in_solves = _launched_in_solves(events, bool(device_kernels))
    return {"kernels": kernels, "on_gpu": bool(device_kernels), "copies": len(copies), "copy_seconds": copy_seconds,
            "solves": solves.get("calls", 0), "solve_seconds": solves.get("seconds", 0.0),
            "kernels_per_solve": (in_solves / solves["calls"]) if solves.get("calls") else None}


def _device_us(event) -> float:
    for name in ("device_time_total", "cuda_time_total", "self_device_time_total"):
        value = getattr(event, name, None)
        if value:
            return float(value)
    return 0.0


def _launched_in_solves(events, on_gpu: bool) -> int:
    """Kernels (CPU: operators) launched from inside ``gptq_quantize``: the profiler's ranges are nested by time,
    so every launch between the start and end of a solve's ``record_function`` range counts."""
    ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name == SOLVE_RANGE]
    if not ranges:
        return 0
    launches = [e for e in events if (e.name.startswith(("cudaLaunchKernel", "cudaGraphLaunch", "cuLaunchKernel"))
                                      if on_gpu else e.name.startswith("aten::"))]
    return sum(1 for e in launches if any(a <= e.time_range.start <= b for a, b in ranges))


#: the profiler range each GPTQ solve runs in (``bench/gpu_bench.py --profile`` counts the launches inside)
SOLVE_RANGE = "gptq_quantize"


def piece_gb(config, tokens: int) -> dict[str, float]:
    """What one piece needs at most (GB): a decoder layer's weights (bf16), the cached activations at a cut
    (three hidden-state-sized values per token, bf16) and the largest layer's fp32 Hessian."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer = 2 * (hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter)
    return {"layer_weights": layer / 1e9, "cached_activations": 3 * 2 * tokens * hidden / 1e9,
            "largest_hessian": 4 * inter * inter / 1e9}


def child_llmcompressor(folder: str, samples: int, seq_len: int) -> None:
    """Runs under LLMCOMPRESSOR_PYTHON: oneshot GPTQ W4A16 on the same token ids."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    rows = [{"input_ids": r, "attention_mask": [1] * len(r)} for r in token_rows(config.vocab_size, samples, seq_len)]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    oneshot(model=model, dataset=Dataset.from_list(rows), recipe=GPTQModifier(targets="Linear", scheme="W4A16",
                                                                               ignore=["lm_head"]),
            max_seq_length=seq_len, num_calibration_samples=samples)
    seconds = time.perf_counter() - start
    print("RESULT " + json.dumps({
        "tool": "llm-compressor", "seconds": seconds, "tokens_per_s": samples * seq_len / seconds,
        "peak_rss_gb": _peak_rss_gb(),
        "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None}))


def child_quality(device: str) -> None:
    """tiny-llama-doc GPTQ W4A16 calibrated on ``device``; perplexity on the CPU (gptq_bench's protocol)."""
    import torch

    import layerwise
    from layerwise.model_io.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(TINY_LLAMA)
    calib = [{"input_ids": w, "attention_mask": torch.ones_like(w)} for w in _windows(tokenizer, CALIB, 128, 512)]
    held_out = _windows(tokenizer, EVAL, 128, 512)
    model = layerwise.compress(load_model(TINY_LLAMA), RECIPE, dataset=calib, max_seq_length=512,
                               num_calibration_samples=len(calib), device=device, show_progress=False)
    print("RESULT " + json.dumps({"device": device, "ppl": perplexity(model.to("cpu"), held_out)}))


def run(cmd: list[str], what: str, time_limit: float | None = None) -> dict | None:
    """The child's RESULT line, or ``None`` when it ran past ``time_limit`` seconds (said on stderr)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent.parent,
                              timeout=time_limit)
    except subprocess.TimeoutExpired:
        print(f"{what}: stopped after the time limit of {time_limit:.0f} s", file=sys.stderr)
        return None
    return _result_line(proc, what)


def physical_limit(lw: dict) -> dict[str, float]:
    """Seconds each phase would take at the matmul peak measured in the run: the forwards' FLOPs at bf16, the
    Hessians' at bf16 when the run took them from bfloat16 inputs (``hessian_dtype``, a GPU) else at fp32, the
    solves' at fp32 (TF32 off); their sum is the run's physical limit."""
    acc, peaks = lw["accounting"], lw["matmul_peak_tflops"]
    limit = {"forwards": lw["forward_flops"] / (peaks["bf16"] * 1e12)}
    hessian_peak = peaks["bf16"] if lw.get("hessian_dtype") == "torch.bfloat16" else peaks["fp32"]
    for phase, name, peak in (("GPTQ Hessians", "Hessians", hessian_peak), ("GPTQ solves", "solves", peaks["fp32"])):
        flops = acc.get(phase, {}).get("flops") or 0.0
        limit[name] = flops / (peak * 1e12)
    limit["total"] = sum(limit.values())
    return limit


def report(lw: dict, llmc: dict | None) -> list[str]:
    acc, peaks = lw["accounting"], lw["matmul_peak_tflops"]
    lines = [f"device: {lw['device']}; matmul peak measured in the same process: {peaks['bf16']:.0f} TFLOP/s bf16, "
             f"{peaks['fp32']:.1f} TFLOP/s fp32 (TF32 off)", "", f"pieces: {lw['pieces']}",
             f"placement: {lw.get('placement') or '-'}; free GPU memory at the start: "
             f"{(lw.get('free_gpu_bytes') or 0) / 2**30:.1f} GiB",
             f"warnings: {'; '.join(lw.get('warnings') or []) or 'none'}", "",
             "| tool | compress() s | tokens/s | peak GPU GB | peak host RSS GB |", "|---|---:|---:|---:|---:|"]
    for r in (lw, llmc):
        if r is not None:
            gpu = f"{r['peak_gpu_gb']:.1f}" if r.get("peak_gpu_gb") is not None else "-"
            lines.append(f"| {r['tool']} | {r['seconds']:.1f} | {r['tokens_per_s']:.0f} | {gpu} | {r['peak_rss_gb']:.1f} |")
    if llmc is not None:
        lines += ["", f"time ratio layerwise / llm-compressor: {lw['seconds'] / llmc['seconds']:.2f}x (target <= 0.5x)"]
        load = acc.get("load", {}).get("seconds", 0.0)
        if load:  # like with like: llm-compressor's timer starts after its from_pretrained
            lines.append(f"the same without layerwise's checkpoint read ({load:.1f} s; llm-compressor loads before its "
                         f"timer starts): {(lw['seconds'] - load) / llmc['seconds']:.2f}x")
    forward = acc.get("forward", {}).get("seconds", 0.0)
    hessian = acc.get("GPTQ Hessians", {})
    lines += ["", "| phase | seconds | TFLOP | TFLOP/s | of peak |", "|---|---:|---:|---:|---:|"]
    if forward:
        rate = lw["forward_flops"] / forward / 1e12
        lines.append(f"| forwards (bf16) | {forward:.1f} | {lw['forward_flops'] / 1e12:.1f} | {rate:.1f} | "
                     f"{rate / peaks['bf16']:.0%} of bf16 |")
    if hessian.get("seconds"):
        rate = hessian["flops"] / hessian["seconds"] / 1e12
        kind = "bf16 in, fp32 sums" if lw.get("hessian_dtype") == "torch.bfloat16" else "fp32"
        lines.append(f"| Hessians ({kind}) | {hessian['seconds']:.1f} | {hessian['flops'] / 1e12:.1f} | {rate:.1f} | "
                     f"{rate / peaks['fp32']:.0%} of fp32, {rate / peaks['bf16']:.0%} of bf16 |")
    solve = acc.get("GPTQ solves", {})
    if solve.get("seconds"):
        rate = (solve.get("flops") or 0.0) / solve["seconds"] / 1e12
        lines.append(f"| solves (fp32) | {solve['seconds']:.1f} | {(solve.get('flops') or 0.0) / 1e12:.2f} | "
                     f"{rate:.2f} | {rate / peaks['fp32']:.0%} of fp32 |")
    others = {phase: work["seconds"] for phase, work in acc.items()
              if phase not in ("forward", "GPTQ Hessians", "GPTQ solves") and work.get("seconds")}
    for phase, seconds in others.items():  # the checkpoint read, ...: no FLOPs to rate
        lines.append(f"| {phase} | {seconds:.1f} | - | - | - |")
    lines.append(f"| outside the phases above | {max(lw['seconds'] - sum(w.get('seconds') or 0 for w in acc.values()), 0):.1f}"
                 f" | - | - | - |")
    limit = physical_limit(lw)
    lines += ["", f"physical limit (every phase at the measured peak): {limit['total']:.2f} s (forwards "
                  f"{limit['forwards']:.2f}, Hessians {limit['Hessians']:.2f}, solves {limit['solves']:.2f}); "
                  f"this run: {lw['seconds']:.1f} s, {lw['seconds'] / max(limit['total'], 1e-9):.0f}x the limit"]
    if lw.get("planned_gpu_peak") and lw.get("peak_gpu_gb"):
        measured, (resident, cached, work) = lw["peak_gpu_gb"] * 1e9, lw["planned_gpu_parts"]
        lines += ["", f"plan's GPU peak forecast: {lw['planned_gpu_peak'] / 2**30:.2f} GiB (weights {resident / 2**30:.2f} "
                      f"+ cached activations {cached / 2**30:.2f} + a piece's work {work / 2**30:.2f}) against the "
                      f"peak allocated {measured / 2**30:.2f} GiB: {lw['planned_gpu_peak'] / measured - 1:+.1%} "
                      f"(target within 15 %); cache planned {lw['planned_cache'] / 2**30:.2f} GiB, held at most "
                      f"{lw['cache_peak'] / 2**30:.2f} GiB"]
    piece = lw["piece_gb"]
    lines += ["", f"one piece at most: {sum(piece.values()):.2f} GB (layer weights {piece['layer_weights']:.2f}, "
                  f"cached activations {piece['cached_activations']:.2f}, largest Hessian {piece['largest_hessian']:.2f})"]
    profiled = lw.get("profile")
    if profiled:
        what = "kernels launched" if profiled["on_gpu"] else "operators run (CPU: no kernels)"
        per_solve = profiled["kernels_per_solve"]
        lines += ["", f"profile: {profiled['kernels']} {what}"
                      + (f", {per_solve:.0f} per GPTQ solve ({profiled['solves']} solves, "
                         f"{profiled['solve_seconds']:.1f} s)" if per_solve else "")
                      + (f"; host-device copies: {profiled['copies']} taking {profiled['copy_seconds']:.2f} s"
                         if profiled["on_gpu"] else "")]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="3b")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work", default="/tmp/layerwise-gpu-bench")
    parser.add_argument("--llmcompressor", action="store_true", help="run llm-compressor (LLMCOMPRESSOR_PYTHON)")
    parser.add_argument("--quality", action="store_true", help="tiny-llama-doc perplexity: --device vs cpu")
    parser.add_argument("--time-limit", type=float, default=3600.0,
                        help="seconds each tool's process may run (default 3600)")
    parser.add_argument("--profile", action="store_true",
                        help="layerwise under the torch profiler: kernels per GPTQ solve, time in host-device copies")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        {"layerwise": lambda: child_layerwise(rest[0], rest[1], int(rest[2]), int(rest[3]), "profile" in rest[4:]),
         "llmc": lambda: child_llmcompressor(rest[0], int(rest[1]), int(rest[2])),
         "quality": lambda: child_quality(rest[0])}[kind]()
        return
    folder = save_model(args.shape, Path(args.work) / f"llama-{args.shape}-bf16")
    script = str(Path(__file__).resolve())
    lw = run([sys.executable, script, "--child", "layerwise", str(folder), args.device, str(args.samples),
              str(args.seq_len), *(["profile"] if args.profile else [])], "layerwise", args.time_limit)
    llmc = None
    if args.llmcompressor:
        llmc = run([os.environ["LLMCOMPRESSOR_PYTHON"], script, "--child", "llmc", str(folder), str(args.samples),
                    str(args.seq_len)], "llm-compressor", args.time_limit)
    print(f"## GPTQ W4A16 g128 on {args.device}: {args.shape} bf16, {args.samples} x {args.seq_len} tokens\n")
    if lw is None:
        print(f"layerwise ran past the time limit ({args.time_limit:.0f} s)"
              + (f"; llm-compressor: {llmc['seconds']:.1f} s" if llmc else ""))
    else:
        print("\n".join(report(lw, llmc)))
    if args.quality:
        here, cpu = (run([sys.executable, script, "--child", "quality", d], f"quality on {d}", args.time_limit)
                     for d in (args.device, "cpu"))
        if here is None or cpu is None:
            return
        print(f"\ntiny-llama-doc perplexity: {here['ppl']:.3f} calibrated on {args.device}, {cpu['ppl']:.3f} on the "
              f"CPU ({here['ppl'] / cpu['ppl'] - 1:+.2%}; target within 0.2 %)")


if __name__ == "__main__":
    main()
