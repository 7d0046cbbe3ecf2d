"""What trace guards cost: checking every calibration batch, and re-tracing for the kinds that need it.

Two cases, each timed in this process:

* ``tiny-llama-doc`` (``../shared/fixtures``), GPTQ W4A16 on ``calib.txt``: samples of many
  lengths, unpadded. Llama's only guard (the causal mask, read by attention kernels alone)
  is loose, so one trace serves every length; the table shows what checking costs.
* ``idefics3`` (the tiny zoo model, eager attention, text layers as targets) on a mix of
  full and padded images: the vision mask's ``None``-ness is a strict guard, so the padded
  images get a trace of their own.

Columns: traces made, batches, seconds to trace and assign every batch to a trace
(``traces_for_batches``), seconds of the whole ``compress()``, and the share of the first in
the second.

    python bench/guards_bench.py
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch

import layerwise

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT.parent / "shared" / "fixtures"


def _timed_assignment():
    """Wrap the pipeline's trace-and-assign step to time it and count the traces."""
    from layerwise.plugins.pipelines import sequential

    seen: dict[str, float] = {}
    original = sequential.traces_for_batches

    def timed(model, batches, options, lifecycle):
        start = time.perf_counter()
        traces, assignment = original(model, batches, options, lifecycle)
        seen.update(seconds=time.perf_counter() - start, traces=len(traces.traces), batches=len(assignment))
        return traces, assignment

    sequential.traces_for_batches = timed
    return seen, lambda: setattr(sequential, "traces_for_batches", original)


def _row(case: str, run) -> str:
    seen, restore = _timed_assignment()
    try:
        start = time.perf_counter()
        model = run()
        total = time.perf_counter() - start
    finally:
        restore()
    assert model.layerwise_report.pipeline == "sequential", model.layerwise_report.fallbacks
    return (f"| {case} | {seen['traces']} | {seen['batches']} | {seen['seconds']:.2f} | {total:.1f} | "
            f"{100 * seen['seconds'] / total:.1f}% |")


def _llama():
    from layerwise import compress

    texts = (FIXTURES / "calib.txt").read_text().splitlines()
    return compress(str(FIXTURES / "tiny-llama-doc"), "GPTQ_W4A16", dataset=texts, num_calibration_samples=128,
                    max_seq_length=256, show_progress=False)


def _idefics3():
    sys.path.insert(0, str(ROOT / "tests" / "model_zoo"))
    from zoo_tiny_models import idefics3

    from layerwise import compress
    from layerwise.model_zoo.idefics3 import TEXT_LAYERS, sample_inputs

    model = idefics3()
    model.set_attn_implementation("eager")
    batches = []
    for i in range(32):
        batch = sample_inputs(model.config, "image", batch=1)
        if i % 2:  # every other image has its lower half padded
            batch["pixel_attention_mask"] = batch["pixel_attention_mask"].clone()
            batch["pixel_attention_mask"][..., 28:, :] = False
        batches.append(batch)
    recipe = {"GPTQModifier": {"scheme": "W8A16", "ignore": ["lm_head"]}}
    return compress(model, recipe, dataset=batches, show_progress=False, options=layerwise.CompressOptions.of(sequential_targets=[TEXT_LAYERS]))


def main() -> None:
    import transformers

    torch.manual_seed(0)
    print(f"<!-- {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__} -->")
    print("| case | traces | batches | trace + check s | compress s | share |")
    print("|---|---:|---:|---:|---:|---:|")
    print(_row("tiny-llama-doc, 128 samples of many lengths", _llama))
    print(_row("idefics3 (tiny), 32 images, half padded", _idefics3))


if __name__ == "__main__":
    main()
