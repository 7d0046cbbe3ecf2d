"""The GPTQ solver alone, this tree against a git revision's, in one run (same-run ratios).

Times :func:`layerwise.algorithms.quantization.gptq.gptq_quantize` on random correlated problems of
the shapes a model's layers have, and the same function of the solver file at ``--baseline`` (a git
revision, loaded from ``git show``), alternating the two so that a busy machine slows both alike;
prints the best of ``--repeat`` runs of each and their ratio, and checks the two agree bit for bit
(on the CPU, where both run the eager column loop).

    python bench/gptq_solver_bench.py --baseline 7b767bf            # the solver before the CUDA-graph loop
    python bench/gptq_solver_bench.py --baseline HEAD~1 --shapes 2048x2048 --repeat 3
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SOLVER = "core/algorithms/quantization/gptq.py"
#: (rows, columns): MiniLM's attention and MLP layers, tiny-llama-doc's, a 1B model's q/k/v stacked
SHAPES = ["384x384", "1536x384", "1024x1024", "3072x2048"]


def baseline_solver(revision: str):
    """The solver module as it was at ``revision``."""
    source = subprocess.run(["git", "show", f"{revision}:{SOLVER}"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    path = Path(tempfile.mkdtemp()) / "gptq_baseline.py"
    path.write_text(source.replace("from .", "from layerwise.algorithms.quantization."))  # relative imports, if any
    spec = importlib.util.spec_from_file_location("gptq_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gptq_baseline"] = module
    spec.loader.exec_module(module)
    return module


def problem(rows: int, columns: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * columns, columns, generator=g) @ (torch.eye(columns) + torch.randn(columns, columns, generator=g)
                                                          / columns ** 0.5)
    return torch.randn(rows, columns, generator=g) * 0.02, 2 * x.t() @ x / x.shape[0]


def main() -> None:
    from layerwise.algorithms.quantization import gptq as current
    from layerwise.algorithms.quantization.args import QuantizationArgs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="git revision of the solver to compare with")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated ROWSxCOLUMNS")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    old = baseline_solver(args.baseline)
    schemes = {"W4 g128 sym static": QuantizationArgs(num_bits=4, strategy="group", group_size=128, actorder="static"),
               "W4 g128 asym static": QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=128,
                                                       actorder="static")}
    print(f"| shape (rows x columns) | scheme | {args.baseline} ms | this tree ms | ratio | equal |")
    print("|---|---|---:|---:|---:|---|")
    for shape in args.shapes.split(","):
        rows, columns = map(int, shape.split("x"))
        w, h = problem(rows, columns)
        for name, scheme in schemes.items():
            if columns % 128:
                scheme = scheme.replace(strategy="channel", group_size=None, actorder=None)
            best = {"old": float("inf"), "new": float("inf")}
            results = {}
            for _ in range(args.repeat):
                for key, module in (("old", old), ("new", current)):
                    start = time.perf_counter()
                    results[key] = module.gptq_quantize(w, h, scheme)
                    best[key] = min(best[key], time.perf_counter() - start)
            equal = torch.equal(results["old"].weight, results["new"].weight)
            print(f"| {shape} | {name} | {best['old'] * 1e3:.0f} | {best['new'] * 1e3:.0f} | "
                  f"{best['new'] / best['old']:.3f} | {'yes' if equal else 'NO'} |")


if __name__ == "__main__":
    main()
