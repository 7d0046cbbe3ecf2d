"""``layerwise eval ORIGINAL COMPRESSED --dataset FILE``: how much the compressed model lost, as a report card.

Prints the metrics (perplexity of both, KL divergence, top-1 / top-5 agreement; embedding cosine and
nearest-neighbour agreement for encoders; task accuracy with ``--tasks``) and the KL divergence per
window and per position as text charts. When COMPRESSED is a layerwise output folder, the card is
saved with it (its ``layerwise_summary.json``, ``README.md`` unless the user wrote that one, and the
SVG pictures) unless ``--no-record``. Also ``compress --eval FILE``'s options and the step it runs
after compressing (:func:`add_compress_options`, :func:`check_compress_eval`, :func:`evaluate_after_compress`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from layerwise.cli.arguments import positive_int
from layerwise.common.quiet import command_line_bars


def add_parser(sub: argparse._SubParsersAction) -> None:
    from layerwise.verbs.evaluation import PLACEMENTS

    p = sub.add_parser("eval", help="compare a compressed model with its original: perplexity, KL divergence, "
                                    "agreement; saved as a model card",
                       description="Run the original and the compressed model over the same held-out windows of "
                                   "--dataset and report perplexity of both, the KL divergence of the compressed "
                                   "model's next-token distribution from the original's (mean, median, p99, max) "
                                   "and top-1 / top-5 agreement (causal LMs); embedding cosine and nearest-"
                                   "neighbour agreement (encoders); both (seq2seq). A layerwise output folder "
                                   "gets the results in its layerwise_summary.json and model card (README.md).")
    p.add_argument("original", metavar="ORIGINAL", help="the uncompressed model: folder or hub id")
    p.add_argument("compressed", metavar="COMPRESSED", help="the compressed model's folder (e.g. a compress "
                                                            "--output-dir)")
    p.add_argument("--dataset", required=True, metavar="FILE",
                   help="held-out text: .txt (documents separated by blank lines, else one per line) or .jsonl "
                        "({\"text\": ...} records); never the calibration data")
    p.add_argument("--window-length", type=positive_int, metavar="N",
                   help="tokens per window (default: the model's context, at most 2048)")
    p.add_argument("--stride", type=positive_int, metavar="N",
                   help="tokens between window starts (default: the window length; shorter windows overlap and "
                        "score only the tokens no earlier window scored)")
    p.add_argument("--max-windows", type=positive_int, metavar="N", help="evaluate at most N windows (default: all)")
    p.add_argument("--batch-size", type=positive_int, default=1, metavar="N", help="windows per forward (default 1)")
    p.add_argument("--device", help="where the models run: cpu, cuda or cuda:N (default: the first GPU, else cpu)")
    p.add_argument("--placement", choices=PLACEMENTS, default="auto",
                   help="run the models side by side (both resident) or one at a time (the original's "
                        "predictions wait on disk); auto: side by side when both fit (default)")
    p.add_argument("--tasks", metavar="LIST",
                   help="also lm-evaluation-harness task accuracy, comma-separated task names (needs "
                        "pip install 'layerwise[eval]' and the tasks' data on this machine)")
    p.add_argument("--task-path", metavar="DIR", help="a folder of lm-eval task YAML files (local data)")
    p.add_argument("--task-limit", type=positive_int, metavar="N", help="at most N examples per task")
    p.add_argument("--num-fewshot", type=int, metavar="N", help="few-shot examples per task prompt")
    p.add_argument("--json", action="store_true", help="print the report card as JSON instead of text")
    p.add_argument("--svg", metavar="FILE", help="also write the KL divergence picture to FILE")
    p.add_argument("--no-record", action="store_true",
                   help="leave COMPRESSED as it is (by default a layerwise output folder gets the card)")
    p.add_argument("--ascii", action="store_true", help="draw the charts with '#' instead of block characters")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run Python shipped with the models (their config's auto_map)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from layerwise.verbs.evaluation import evaluate

    command_line_bars(not args.quiet)  # transformers' bars too (a log gets a line per redraw)
    svg = _check_svg(args) if args.svg else None  # before the windows run: minutes, then the path refused
    quality = evaluate(args.original, args.compressed, args.dataset, window_length=args.window_length,
                       stride=args.stride, max_windows=args.max_windows, batch_size=args.batch_size,
                       device=args.device, placement=args.placement, tasks=args.tasks, task_path=args.task_path,
                       task_limit=args.task_limit, num_fewshot=args.num_fewshot, show_progress=not args.quiet,
                       trust_remote_code=args.trust_remote_code)
    if svg is not None:
        _write_svg(quality, svg)
    notes = [] if args.no_record else record_if_ours(args.compressed, quality, args.original)
    if args.json:
        print(json.dumps(quality.to_dict(), indent=1))
    else:
        print_quality(quality, ascii_only=args.ascii)
    for note in notes + ([f"KL divergence picture written to {args.svg}"] if args.svg else []):
        print(note, file=sys.stderr if args.json else sys.stdout)
    return 0


def print_quality(quality: Any, ascii_only: bool = False) -> None:
    """The metrics, then the KL charts (ASCII where the terminal cannot print blocks)."""
    from layerwise.reports.quality_text import kl_charts, quality_lines
    from layerwise.reports.text import supports_blocks

    print("\n".join(quality_lines(quality)))
    charts = kl_charts(quality, ascii_only=ascii_only or not supports_blocks(sys.stdout))
    if charts:
        print()
        print("\n".join(charts))


def record_if_ours(folder: str, quality: Any, original: str | None = None) -> list[str]:
    """Save the card with ``folder`` when it is a layerwise output compressed from ``original`` (as far as the
    folder's summary tells); the lines that say what happened."""
    from layerwise.model_io.saving import written_by_layerwise
    from layerwise.reports.run_summary import SUMMARY_FILE, read_summary
    from layerwise.verbs.evaluation import record_evaluation

    path = Path(folder).expanduser()
    if not (path.is_dir() and written_by_layerwise(path)):
        return [f"not recorded: '{folder}' is not a layerwise output (no {SUMMARY_FILE}); --json prints the card"]
    source = read_summary(path).report.model
    if original is not None and source and _other_local_folder(source, original):
        return [f"not recorded: '{folder}' was compressed from '{source}', not '{original}': its card would call "
                f"this comparison 'quality against the original'; compare with '{source}' to record it"]
    summary, card = record_evaluation(path, quality)
    lines = [f"{'recorded in:':<20}{summary}"]
    lines.append(f"{'model card:':<20}{card}" if card is not None else
                 f"{'model card:':<20}not written: {path / 'README.md'} is yours (it lacks layerwise's mark) and "
                 f"was kept; the metrics are in {SUMMARY_FILE}")
    return lines


def _other_local_folder(source: str, original: str) -> bool:
    """Both name folders on this machine, and not the same one (a hub id, or a folder that moved, cannot tell)."""
    first, second = Path(source).expanduser(), Path(original).expanduser()
    return first.is_dir() and second.is_dir() and first.resolve() != second.resolve()


#: what ``eval --svg`` writes, in its errors
KL_PICTURE = "the KL picture"


def _check_svg(args: argparse.Namespace) -> Path:
    """``--svg FILE`` must be a new file outside both model folders (a file there changes what the folder holds)."""
    from layerwise.model_io.output_file import check_output_file

    return check_output_file(args.svg, KL_PICTURE, [("original model folder", args.original),
                                                    ("compressed model folder", args.compressed)])


def _write_svg(quality: Any, path: Path) -> None:
    from layerwise.model_io.output_file import write_output_file
    from layerwise.reports.kl_svg import kl_svg

    write_output_file(path, kl_svg(quality), KL_PICTURE)


# -- compress --eval FILE ------------------------------------------------------------------------------
def add_compress_options(p: argparse.ArgumentParser) -> None:
    """``--eval FILE`` (and its window options) on the ``compress`` parser."""
    p.add_argument("--eval", metavar="FILE",
                   help="after compressing, compare the result with the original on this held-out text "
                        "(layerwise eval) and save the report card with the output")
    p.add_argument("--eval-max-windows", type=positive_int, metavar="N", help="with --eval: at most N windows")
    p.add_argument("--eval-window-length", type=positive_int, metavar="N", help="with --eval: tokens per window")


def check_compress_eval(args: argparse.Namespace) -> None:
    """A bad ``--eval`` file is an error before the model loads, and so is one inside the output folder: writing
    the output would replace it (an input, like the dataset and the recipe)."""
    if getattr(args, "eval", None):
        from layerwise.model_io.saving import check_not_an_input
        from layerwise.reports.eval_text import read_eval_text

        read_eval_text(args.eval)
        if getattr(args, "output_dir", None):
            check_not_an_input(args.output_dir, [("evaluation file", args.eval)])


def evaluate_after_compress(args: argparse.Namespace, model: Any, output_dir: str | None = None) -> Any:
    """``compress --eval``: the saved output (``output_dir``, else the model's own report's) or, with
    ``--no-save``, the model in memory, against ``--model``; printed, and recorded in the output folder.
    ``None`` without ``--eval``."""
    if not getattr(args, "eval", None):
        return None
    from layerwise.verbs.evaluation import evaluate, evaluate_output

    options = dict(window_length=args.eval_window_length, max_windows=args.eval_max_windows, device=args.device,
                   show_progress=not args.quiet, trust_remote_code=args.trust_remote_code)
    output_dir = output_dir or model.layerwise_report.output_dir
    if output_dir:
        quality = evaluate_output(output_dir, args.model, args.eval, **options)
    else:
        quality = evaluate(args.model, model, args.eval, **options)
    print()
    print_quality(quality)
    return quality
