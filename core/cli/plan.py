"""``layerwise plan``: the arguments of ``compress``, answered before the run (exit 0 runs, 1 will not).

Wire-up: ``add_parser(subparsers)`` registers the subcommand, ``run(args)`` executes it.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any, TextIO

from layerwise.cli.arguments import memory_size, with_kv_cache


def add_parser(subparsers: Any, add_run_arguments: Any, options_from_flags: Any) -> argparse.ArgumentParser:
    """Register ``plan`` with ``compress``'s flags (``add_run_arguments``, read back by ``options_from_flags``)
    and the machine to plan for."""
    parser = subparsers.add_parser(
        "plan", help="say whether a compress run will fit, how long it takes and whether it will serve",
        description="Plan `layerwise compress` with the same flags, in seconds and without reading weights: "
                    "targets, cut, mappings, memory per piece, host RAM, disk, FLOPs and time, vLLM kernels. "
                    "Exit status 0: it runs as asked; 1: it will not.")
    add_run_arguments(parser)
    parser.add_argument("--gpu-memory", type=memory_size, metavar="SIZE",
                        help="plan for a GPU with this much free memory (80GiB, 24G, ...; default: the GPU here)")
    parser.add_argument("--host-memory", type=memory_size, metavar="SIZE",
                        help="plan for a machine with this much RAM available (default: MemAvailable here)")
    parser.add_argument("--serve-on", metavar="GPU-NAME",
                        help="check vLLM kernels for the output on this GPU (H100, A100, L4, T4, B200, ...)")
    parser.set_defaults(func=run, options_from_flags=options_from_flags)
    return parser


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Print the plan; 0 when the run would go as asked, 1 when it would not."""
    from layerwise.planning.plan import plan_lines
    from layerwise.verbs.plan import plan

    out = out or sys.stdout
    if getattr(args, "process_ends", False):
        # the executable exits after printing: the meta model (~1M objects for DeepSeek-V3) is left to the
        # exit, not to a collection (0.55 s); a plan holds no tensor memory for it to reclaim
        gc.disable()
    if args.model is None:
        from layerwise.errors import InvalidArgumentError

        raise InvalidArgumentError("plan needs --model FOLDER (the model compress would read)")
    found = plan(args.model, with_kv_cache(args.recipe or "W4A16", args.kv_cache), dataset=args.dataset, output_dir=args.output_dir,
                 num_calibration_samples=args.num_samples, max_seq_length=args.max_seq_length, device=args.device,
                 overwrite=(("any" if args.overwrite_any else args.overwrite) or None),
                 options=args.options_from_flags(args), gpu_memory=args.gpu_memory, host_memory=args.host_memory,
                 serve_on=args.serve_on)
    print("\n".join(plan_lines(found)), file=out)
    return 0 if found.ok else 1
