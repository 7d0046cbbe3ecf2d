"""Weights streamed from disk, measured: peak RSS of a streamed GPTQ run against the checkpoint's size.

A Llama of real shape with random weights is saved once (safetensors, sharded); then each mode runs
in a fresh process, so its peak RSS is its own: ``stream`` (weights read piece by piece, written
as each piece ends) and ``memory`` (loaded whole, today's default for models that fit). Both
outputs are compared tensor by tensor: streaming must not change a single bit.

    python bench/scale_bench.py --case stream --shape 1b --samples 8 --seq-len 128
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from scale_shapes import SHAPES

RECIPE = "GPTQModifier:\n  scheme: W4A16\n  ignore: [lm_head]\n"

RUN = """
import json, sys, time, torch, layerwise
from layerwise.host.lifecycle import Lifecycle
folder, out, weights, samples, seq_len, recipe, resume = sys.argv[1:8]
epochs = []
original = Lifecycle.sequential_epoch_end
Lifecycle.sequential_epoch_end = lambda self, modules: (epochs.append(1), original(self, modules))[1]
generator = torch.Generator().manual_seed(0)
from transformers import AutoConfig
vocab = AutoConfig.from_pretrained(folder).vocab_size
batches = [{"input_ids": torch.randint(0, vocab, (1, int(seq_len)), generator=generator)} for _ in range(int(samples))]
start = time.perf_counter()
model = layerwise.compress(folder, recipe, dataset=batches, output_dir=out, show_progress=False,
                           options=layerwise.CompressOptions.of(weights=weights, resume=resume == "resume"))
report = model.layerwise_report
print(json.dumps({"weights": report.weights, "seconds": round(time.perf_counter() - start, 1),
                  "peak_rss_bytes": report.peak_rss_bytes, "pieces": report.pieces, "pieces_run": len(epochs)}))
"""


def save_model(shape: str, folder: Path) -> int:
    """Save a random-weight Llama of ``shape`` to ``folder`` once; its checkpoint bytes."""
    if not (folder / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
        config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                             max_position_embeddings=4096, tie_word_embeddings=False)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="1GB")
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def command(folder: Path, out: Path, weights: str, samples: int, seq_len: int, resume: bool = False) -> list[str]:
    return [sys.executable, "-c", RUN, str(folder), str(out), weights, str(samples), str(seq_len), RECIPE,
            "resume" if resume else "fresh"]


def run(folder: Path, out: Path, weights: str, samples: int, seq_len: int, resume: bool = False) -> dict:
    done = subprocess.run(command(folder, out, weights, samples, seq_len, resume), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{weights} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def same_tensors(a: Path, b: Path) -> tuple[int, int]:
    """(tensors equal bit for bit, tensors) between two saved folders."""
    import torch
    from safetensors import safe_open

    def index(folder: Path) -> dict[str, Path]:
        found = {}
        for file in folder.glob("*.safetensors"):
            with safe_open(str(file), framework="pt") as handle:
                found.update(dict.fromkeys(handle.keys(), file))
        return found

    left, right = index(a), index(b)
    equal = 0
    for key, file in left.items():
        if key in right:
            with safe_open(str(file), "pt") as x, safe_open(str(right[key]), "pt") as y:
                equal += torch.equal(x.get_tensor(key), y.get_tensor(key))
    return equal, max(len(left), len(right))


def case_stream(args: argparse.Namespace) -> dict:
    """``scale_bench.py --case stream``: streamed vs in-memory peak RSS, then a SIGKILL and a resume."""
    work = Path(args.work)
    folder = work / f"llama-{args.shape}"
    start = time.perf_counter()
    size = save_model(args.shape, folder)
    print(f"checkpoint: {folder} {size / 2**30:.2f} GiB fp32 (saved in {time.perf_counter() - start:.0f} s)")
    results = {}
    for weights in ("stream", "memory"):
        out = work / f"out-{args.shape}-{weights}"
        subprocess.run(["rm", "-rf", str(out)])
        results[weights] = run(folder, out, weights, args.samples, args.seq_len)
        ratio = results[weights]["peak_rss_bytes"] / size
        print(f"{weights:>6}: {results[weights]['seconds']:7.1f} s, peak RSS "
              f"{results[weights]['peak_rss_bytes'] / 2**30:.2f} GiB = {ratio:.2f}x the checkpoint")
    equal, total = same_tensors(work / f"out-{args.shape}-stream", work / f"out-{args.shape}-memory")
    print(f"outputs: {equal}/{total} tensors bit-identical")
    results["resume"] = kill_and_resume(folder, work / f"out-{args.shape}-resumed", work / f"out-{args.shape}-stream",
                                        args, results["stream"])
    results.update(checkpoint_bytes=size, identical_tensors=[equal, total])
    return results


def kill_and_resume(folder: Path, out: Path, reference: Path, args: argparse.Namespace, uninterrupted: dict) -> None:
    """SIGKILL a streamed run halfway through a piece after half its pieces, resume it, count the work redone."""
    import signal

    subprocess.run(["rm", "-rf", str(out), *map(str, out.parent.glob(f".{out.name}.incomplete-*"))])
    total = int(uninterrupted["pieces"].split(":")[1].split()[0])
    per_piece = uninterrupted["seconds"] / total
    start = time.perf_counter()
    process = subprocess.Popen(command(folder, out, "stream", args.samples, args.seq_len),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finished = -1
    while finished + 1 < total // 2:
        time.sleep(0.2)
        for progress in out.parent.glob(f".{out.name}.incomplete-*/.layerwise-resume/progress.json"):
            try:
                finished = json.loads(progress.read_text())["finished"]
            except (OSError, ValueError):
                pass
    time.sleep(per_piece / 2)  # in the middle of the next piece
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_after = time.perf_counter() - start
    progress = next(out.parent.glob(f".{out.name}.incomplete-*/.layerwise-resume/progress.json"))
    done = json.loads(progress.read_text())["finished"] + 1
    resumed = run(folder, out, "stream", args.samples, args.seq_len, resume=True)
    redone = resumed["pieces_run"] - (total - done)
    equal, count = same_tensors(out, reference)
    print(f"resume: killed at {killed_after:.1f} s with {done} of {total} pieces checkpointed; the resumed run "
          f"ran {resumed['pieces_run']} pieces ({redone} redone beyond those left) in {resumed['seconds']:.1f} s; "
          f"killed + resumed {killed_after + resumed['seconds']:.1f} s vs {uninterrupted['seconds']:.1f} s "
          f"uninterrupted; outputs {equal}/{count} tensors bit-identical to the uninterrupted run")
    return {"killed_after_s": round(killed_after, 1), "checkpointed": done, "pieces": total,
            "resumed": resumed, "redone_beyond_left": redone, "identical_tensors": [equal, count]}
