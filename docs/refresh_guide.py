"""Regenerate what GUIDE.md pastes: command output, example output and the DOT pictures in docs/.

    python docs/refresh_guide.py            # rewrite GUIDE.md's guide-output blocks and docs/*.dot
    python docs/refresh_guide.py --check    # change nothing; exit 1 and show what is stale

Nothing in GUIDE.md's output blocks is typed by hand: run this after moving the transformers
pin (GUIDE.md, section 9, "transformers releases: the tested range and moving the pin"). ``tests/test_guide.py`` uses the same
functions: on the pinned transformers it asks for the exact text, on any other release only for
:func:`reader_view`, the part a reader relies on (pieces, targets, exact replay), because internal
value names and node counts follow transformers' code.
"""

from __future__ import annotations

import argparse
import difflib
import io
import os
import re
import runpy
import sys
import tempfile
from collections.abc import Callable
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "GUIDE.md"
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(?P<lang>\w+) guide-(?P<kind>test|output):(?P<name>[\w-]+)\n(?P<body>.*?)^```[ \t]*$",
                   re.MULTILINE | re.DOTALL)
#: the line that stands for omitted output in a pasted block
ELIDED = "..."


def guide_blocks(kind: str, text: str | None = None) -> dict[str, str]:
    """The ``guide-test`` or ``guide-output`` blocks of GUIDE.md by name."""
    found: dict[str, str] = {}
    for match in FENCE.finditer(GUIDE.read_text(encoding="utf-8") if text is None else text):
        if match["kind"] == kind:
            if match["name"] in found:
                raise ValueError(f"two guide-{kind} blocks named {match['name']!r}")
            found[match["name"]] = match["body"]
    return found


def run_block(name: str, where: Path) -> str:
    """Run one guide-test block as a script file in ``where`` (so source lookups work); what it printed."""
    module = f"guide_{name.replace('-', '_')}"
    script = where / f"{module}.py"
    script.write_text(guide_blocks("test")[name], encoding="utf-8")
    before, buffer = Path.cwd(), io.StringIO()
    os.chdir(where)
    try:
        with redirect_stdout(buffer):
            runpy.run_path(str(script), run_name=module)
    finally:
        os.chdir(before)
        sys.modules.pop(module, None)
    return buffer.getvalue()


def run_cli(*argv: str, cwd: Path) -> tuple[int, str]:
    """``layerwise <argv>`` in-process, in ``cwd``: exit status and stdout."""
    from layerwise.cli.app import main

    before, buffer = Path.cwd(), io.StringIO()
    os.chdir(cwd)
    try:
        with redirect_stdout(buffer):
            code = main(list(argv))
    finally:
        os.chdir(before)
    return code, buffer.getvalue()


def output_lines(text: str) -> list[str]:
    """Non-empty-ended lines without trailing spaces, as pasted blocks are compared."""
    return [line.rstrip() for line in text.strip().splitlines()]


def _head(lines: list[str]) -> list[str]:
    """A trace report up to its table's end (before the wrapped statements)."""
    return lines[:next(i for i, line in enumerate(lines) if line.startswith("Wrapped statements:"))]


def _tail(lines: list[str]) -> list[str]:
    return lines[len(_head(lines)):]


@dataclass(frozen=True)
class Pasted:
    """One guide-output block: the command whose output it shows and the part of it shown."""

    argv: tuple[str, ...] = ()
    example: str = ""
    #: a function that returns the text, for output that needs more than one command
    producer: Callable[[], str] | None = None
    select: Callable[[list[str]], list[str]] = list
    #: the zoo patch the output depends on: tests skip the block outside that patch's verified span
    patch: str = ""


EXAMPLE_PLUGIN = ROOT / "examples" / "layerwise-starcoder2"


def example_plugin_listing() -> str:
    """``layerwise plugins`` as ``tox -e example-plugin`` prints it, cut to the example's own lines.

    Where the example is not installed, its module is registered as its entry point would be.
    """
    from layerwise.cli.plugins import collect, format_report
    from layerwise.host.plugin_manager import PluginHost

    host = PluginHost(strict=False)
    if "starcoder2" not in host.plugins:
        sys.path.insert(0, str(EXAMPLE_PLUGIN / "src"))
        import layerwise_starcoder2

        release = re.search(r'^version = "(.+)"$', (EXAMPLE_PLUGIN / "pyproject.toml").read_text(), re.MULTILINE)[1]
        info = host.register(layerwise_starcoder2, name="starcoder2", distribution="layerwise-starcoder2",
                             version=release)
        info.entry_point = "layerwise_starcoder2"
    lines = format_report(collect(host)).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layerwise-starcoder2 "))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return "\n".join(lines[start:end])


def support_matrix() -> str:
    """``layerwise plugins --check layerwise`` without the times: the kit on every zoo patch's tiny models."""
    from layerwise.testing.support_matrix import check_patches, format_matrix

    return format_matrix(check_patches(["layerwise"]), times=False)


QWEN2_VL_IMAGE = ("trace", "--model", "tiny-qwen2-vl", "--modality", "image", "--verify")

#: every guide-output block of GUIDE.md and where its text comes from
PASTED: dict[str, Pasted] = {
    "trace-tiny-llama": Pasted(argv=("trace", "--model", "tiny-llama")),
    "verify-tiny-llama": Pasted(argv=("trace", "--model", "tiny-llama", "--verify"),
                                select=lambda lines: [ELIDED, lines[-1]]),
    "trace-tiny-qwen2-vl-image": Pasted(argv=QWEN2_VL_IMAGE, select=_head, patch="qwen2_vl"),
    "trace-tiny-qwen2-vl-image-rest": Pasted(argv=QWEN2_VL_IMAGE, select=_tail, patch="qwen2_vl"),
    "autowrap": Pasted(example="autowrap"),
    "plugins-example": Pasted(producer=example_plugin_listing),
    "support-matrix": Pasted(producer=support_matrix),
}

#: the DOT pictures in docs/ and the extra ``layerwise trace --model tiny-llama`` flags that draw them
PICTURES: dict[str, tuple[str, ...]] = {
    "trace-tiny-llama.dot": (),
    "trace-tiny-llama-2-per-subgraph.dot": ("--targets-per-subgraph", "2"),
}


class GenerationError(RuntimeError):
    """A command behind a pasted block failed: nothing is written."""


def generate(where: Path, failures: dict[str, str] | None = None) -> dict[str, str]:
    """Every pasted block (by name) and picture (by file name), produced now in the folder ``where``.

    A command that exits non-zero raises :class:`GenerationError`, or with ``failures`` (a dict)
    is recorded there by block name and its output still produced, for tests that decide
    themselves whether that command must work on the running transformers.
    """
    def failed(name: str, argv: tuple[str, ...], code: int, printed: str) -> None:
        message = f"`layerwise {' '.join(argv)}` exited {code}:\n{printed}"
        if failures is None:
            raise GenerationError(message)
        failures[name] = message

    run_block("tiny-folders", where)
    outputs: dict[tuple[str, ...], tuple[int, str]] = {}
    produced: dict[str, str] = {}
    for name, pasted in PASTED.items():
        if pasted.producer is not None:
            printed = pasted.producer()
        elif pasted.example:
            printed = run_block(pasted.example, where).replace(f"{where}{os.sep}", "")
        else:
            if pasted.argv not in outputs:
                outputs[pasted.argv] = run_cli(*pasted.argv, cwd=where)
            code, printed = outputs[pasted.argv]
            if code != 0:
                failed(name, pasted.argv, code, printed)
        produced[name] = "\n".join(pasted.select(output_lines(printed))) + "\n"
    for picture, extra in PICTURES.items():
        argv = ("trace", "--model", "tiny-llama", *extra, "--graph", picture)
        code, printed = run_cli(*argv, cwd=where)
        if code != 0:
            failed(picture, argv, code, printed)
        produced[picture] = (where / picture).read_text(encoding="utf-8") if code == 0 else ""
    return produced


_TABLE_ROW = re.compile(r"^(?P<index>\d+)\s+(?P<target>\S+(?: \S+)?)\s+\d+\s")
_KEPT = ("Model:", "Inputs", "Targets", "Traced ", "Failed modules", "max abs diff:", ELIDED)
_CLUSTER = re.compile(r'subgraph cluster_(\d+) \{')
_BOX = re.compile(r'\[label="([^"]+)", shape=box')


def reader_view(name: str, text: str) -> list[str]:
    """What a reader of ``name`` relies on, the same on every transformers release layerwise supports.

    For a trace report: the model, inputs and targets, how many pieces, which target each piece
    ends at, that no module failed and that replay is exact. For a DOT picture: which module
    calls each cluster holds. Example output that only depends on layerwise is kept whole.
    """
    if name.endswith(".dot"):
        view, cluster = [], None
        for line in text.splitlines():
            if found := _CLUSTER.search(line):
                cluster = found[1]
            elif line.strip() == "}":
                cluster = None
            elif (box := _BOX.search(line)) and cluster is not None:
                view.append(f"cluster {cluster}: {box[1]}")
        return view
    if name == "support-matrix":  # which tiny models of which patches are checked; results follow transformers
        return [" ".join(line.split()[:2]) for line in output_lines(text) if line and not line.startswith(("✘", "patch"))
                and " of " not in line]
    if PASTED[name].example or PASTED[name].producer:
        return output_lines(text)
    view = []
    for line in output_lines(text):
        if row := _TABLE_ROW.match(line):
            view.append(f"{row['index']} {row['target']}")
        elif line.startswith(_KEPT):
            view.append(line)
    return view


def pasted_text(name: str, blocks: dict[str, str]) -> str:
    """What the guide shows now for ``name``: a picture file in docs/, or one of ``blocks``."""
    return (DOCS / name).read_text(encoding="utf-8") if name in PICTURES else blocks.get(name, "")


def stale(produced: dict[str, str]) -> dict[str, tuple[str, str]]:
    """``{name: (pasted, produced)}`` for every block or picture that differs from ``produced``."""
    blocks = guide_blocks("output")
    found = {}
    for name, text in produced.items():
        have = pasted_text(name, blocks)
        if have != text:
            found[name] = (have, text)
    return found


def rewrite_guide(text: str, produced: dict[str, str]) -> str:
    """GUIDE.md's text with every guide-output block replaced by what was produced."""
    def replace(match: re.Match[str]) -> str:
        if match["kind"] != "output" or match["name"] not in produced:
            return match[0]
        return f"```{match['lang']} guide-output:{match['name']}\n{produced[match['name']]}```"

    return FENCE.sub(replace, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when something is stale")
    args = parser.parse_args(argv)
    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as where:
        produced = generate(Path(where))
    missing = set(PASTED) - set(guide_blocks("output"))
    if missing:
        print(f"GUIDE.md has no guide-output block for {', '.join(sorted(missing))}", file=sys.stderr)
        return 1
    differences = stale(produced)
    for name, (have, want) in differences.items():
        print(f"{'stale' if args.check else 'refreshed'}: {name}")
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                                       f"pasted/{name}", f"now/{name}"))
    if args.check:
        print(f"{len(differences)} stale of {len(produced)} (transformers {transformers.__version__})")
        return 1 if differences else 0
    GUIDE.write_text(rewrite_guide(GUIDE.read_text(encoding="utf-8"), produced), encoding="utf-8")
    for picture in PICTURES:
        (DOCS / picture).write_text(produced[picture], encoding="utf-8")
    print(f"{len(differences)} of {len(produced)} refreshed with transformers {transformers.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
