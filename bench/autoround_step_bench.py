"""One AutoRound step on block 0, uncompiled and compiled, against the block's own forward and backward.

Captures block 0's samples as the pipeline gives them to the tuner (``compress`` with ``iters: 0``; the
bench's tiny-llama-doc windows or MiniLM rows), then times, in CPU seconds of this process and alternating so
that a busy machine slows every variant alike, one step of ``--batch-size`` samples:

* ``step``: the fake quantization of the block's weights, the block and the loss, forward and backward, as
  ``tune_block`` runs it (``compile=False``), and ``step compiled`` (``compile=True``, compiled once before);
* ``floor``: the block's forward and backward with its plain weights as the learned tensors, the loss on
  the same stacked samples: what any tool running this block on these samples pays (also compiled);
* ``step bf16`` and ``floor bf16``: the same two with the forward under ``torch.autocast`` to bfloat16
  (``step_dtype: bfloat16``; auto-round's ``amp``, which it turns on where the CPU has native bfloat16).

Prints the medians and ranges of ``--repeat`` runs and their ratios to ``step``. The compilation itself
(tens of seconds, cold) is not in these numbers: ``autoround_bench.py --compile`` counts it.

    python bench/autoround_step_bench.py --repeat 8
    python bench/autoround_step_bench.py --case minilm --repeat 10
"""

from __future__ import annotations

import argparse
import copy
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def captured_block(case: str, samples: int):
    """Block 0 (hooks cleared), its layers' (weight, args, transposed) and its samples, via the pipeline."""
    import autoround_bench as bench

    from layerwise.plugins.modifiers import autoround

    saved: dict = {}
    original = autoround.tune_block

    def spy(block, layers, block_samples, **kwargs):
        if not saved:
            copied = copy.deepcopy(block)
            for hooks in (copied._forward_hooks, copied._forward_hooks_with_kwargs, copied._forward_pre_hooks):
                hooks.clear()
            modules = dict(copied.named_modules())
            saved.update(block=copied, samples=list(block_samples),
                         layers={n: (modules[n].weight.detach(), a, t) for n, (_, a, t) in layers.items()})
        return original(block, layers, block_samples, **kwargs)

    autoround.tune_block = spy
    try:
        args = argparse.Namespace(case=case, iters=0, batch_size=8, samples=samples, eval=1, threads=1,
                                  minilm_data="windows", quick=True, device="cpu")
        timed = bench.timed_minilm if case == "minilm" else bench.timed_layerwise
        timed(bench.layerwise_recipe("AutoRound", "W3A16 g128" if case == "minilm" else "W2A16 g64", args), args)
    finally:
        autoround.tune_block = original
    return saved["block"], saved["layers"], saved["samples"]


def _autocast(forward):
    """``forward()`` under bfloat16 autocast (its backward then runs outside, as tune_block's does)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return forward()


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=["tiny-llama", "minilm"], default="tiny-llama")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=8)
    args = parser.parse_args()

    from layerwise.algorithms.quantization import autoround as ar

    torch.set_num_threads(1)
    block, layers, samples = captured_block(args.case, args.samples)
    torch.set_num_threads(1)
    for p in block.parameters():
        p.requires_grad_(False)
    prepared = ar._Layers(layers)
    roundings = {n: ar.Rounding.start(w, a) for n, (w, a, _) in layers.items()}
    plain = {f"{n}.weight": w.clone() for n, (w, _, _) in layers.items()}
    learned = [t for r in roundings.values() for t in r.tensors()] + list(plain.values())
    for t in learned:
        t.requires_grad_(True)
    batch = list(range(min(args.batch_size, len(samples))))
    eager, compiled = ar._Batches(block, samples, compile=False), ar._Batches(block, samples, compile=True)
    bf16 = ar._Batches(block, samples, step_dtype=torch.bfloat16)
    stacked = eager._stacked(eager.keys[0], [samples[i] for i in batch])
    if stacked is None:
        raise SystemExit("block 0 does not run its samples stacked; the floor here assumes it does")
    floor_compiled = torch.compile(ar._loss, dynamic=False)
    runs = {
        "step": lambda: eager.step_loss(prepared, roundings, batch),
        "step compiled": lambda: compiled.step_loss(prepared, roundings, batch),
        "floor": lambda: ar._loss(block, plain, stacked),
        "floor compiled": lambda: floor_compiled(block, plain, stacked),
        "step bf16": lambda: bf16.step_loss(prepared, roundings, batch),  # autocast by step_dtype
        "floor bf16": lambda: _autocast(lambda: ar._loss(block, plain, stacked)),
    }
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(args.repeat + 2):  # two warm-up rounds: the compilations, then the allocator
        for name, run in runs.items():
            start = _cpu()
            run().backward()
            if rep >= 2:
                seconds[name].append(_cpu() - start)
            for t in learned:
                t.grad = None
    base = sorted(seconds["step"])[len(seconds["step"]) // 2]
    print(f"{args.case} block 0, {len(batch)} samples of {tuple(samples[0].target.shape[1:])} stacked, one thread, "
          f"CPU ms per step (median, range of {args.repeat}):\n")
    print("| variant | ms | range | vs step |\n|---|---:|---|---:|")
    for name, values in seconds.items():
        values = sorted(values)
        median = values[len(values) // 2]
        print(f"| {name} | {median * 1e3:.0f} | {values[0] * 1e3:.0f}-{values[-1] * 1e3:.0f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
