"""GUIDE.md is executable: its ``guide-test`` blocks run here as written, its pasted
command output is compared with what the commands print now, and its DOT pictures are
regenerated and compared.

A block is a fenced ```` ```python guide-test:<name> ```` block; it runs as a script
file (``guide_<name>.py``, so that ``inspect.getsource`` and autowrap work) in a fresh
temporary directory. Pasted output is a ```` ```text guide-output:<name> ```` block.
"""

from __future__ import annotations

import io
import os
import re
import runpy
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "GUIDE.md"
FENCE = re.compile(r"^```(?P<lang>\w+) guide-(?P<kind>test|output):(?P<name>[\w-]+)\n(?P<body>.*?)^```\s*$",
                   re.MULTILINE | re.DOTALL)

#: every example the guide promises; removing one from GUIDE.md must be a conscious change here
EXAMPLES = {"tiny-folders", "trace-api", "targets", "autowrap", "robust", "opaque", "dtypes", "shapes",
            "model-patch", "modifier", "pipeline", "recipes"}


def _blocks(kind: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for match in FENCE.finditer(GUIDE.read_text(encoding="utf-8")):
        if match["kind"] != kind:
            continue
        assert match["name"] not in found, f"two guide-{kind} blocks named {match['name']!r}"
        found[match["name"]] = match["body"]
    return found


TESTS = _blocks("test")
OUTPUTS = _blocks("output")


def _run_block(name: str, where: Path) -> str:
    """Run one guide-test block as a script in ``where``; returns what it printed."""
    script = where / f"guide_{name.replace('-', '_')}.py"
    script.write_text(TESTS[name], encoding="utf-8")
    before = Path.cwd()
    buffer = io.StringIO()
    os.chdir(where)
    try:
        with redirect_stdout(buffer):
            runpy.run_path(str(script), run_name=f"guide_{name.replace('-', '_')}")
    finally:
        os.chdir(before)
        sys.modules.pop(f"guide_{name.replace('-', '_')}", None)
    return buffer.getvalue()


def _cli(*argv: str, cwd: Path) -> tuple[int, str]:
    from layerwise.cli import main

    buffer = io.StringIO()
    before = Path.cwd()
    os.chdir(cwd)
    try:
        with redirect_stdout(buffer):
            code = main(list(argv))
    finally:
        os.chdir(before)
    return code, buffer.getvalue()


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def test_the_guide_holds_every_example():
    assert set(TESTS) == EXAMPLES
    assert {"trace-tiny-llama", "trace-tiny-qwen2-vl-image", "autowrap"} <= set(OUTPUTS)


@pytest.mark.parametrize("name", sorted(EXAMPLES - {"tiny-folders"}))
def test_guide_example_runs(name, tmp_path):
    printed = _run_block(name, tmp_path)
    if name in OUTPUTS:  # what the guide says the example prints (file paths may differ)
        got = _lines(printed)
        want = _lines(OUTPUTS[name])
        assert len(got) == len(want), printed
        for have, expected in zip(got, want):
            assert have.endswith(expected), (have, expected)


# -- the CLI output pasted in the guide --------------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    where = tmp_path_factory.mktemp("guide-folders")
    _run_block("tiny-folders", where)
    assert (where / "tiny-llama" / "config.json").is_file()
    assert (where / "tiny-qwen2-vl" / "config.json").is_file()
    return where


def test_trace_output_is_the_pasted_one(folders):
    code, out = _cli("trace", "--model", "tiny-llama", cwd=folders)
    assert code == 0
    assert _lines(out) == _lines(OUTPUTS["trace-tiny-llama"])


def test_verify_line_is_the_pasted_one(folders):
    code, out = _cli("trace", "--model", "tiny-llama", "--verify", cwd=folders)
    assert code == 0
    guide = GUIDE.read_text(encoding="utf-8")
    assert _lines(out)[-1] in guide


def test_multimodal_output_is_the_pasted_one(folders):
    code, out = _cli("trace", "--model", "tiny-qwen2-vl", "--modality", "image", "--verify", cwd=folders)
    assert code == 0
    got = _lines(out)
    pasted = _lines(OUTPUTS["trace-tiny-qwen2-vl-image"])
    assert got[:len(pasted)] == pasted
    guide = GUIDE.read_text(encoding="utf-8")
    wrapped = next(line for line in got if line.startswith("Wrapped statements:"))
    assert f"\n{wrapped}\n" in guide          # the count quoted in the shortened excerpt
    assert got[-1] in guide                   # the verify line


def test_text_only_vlm_leaves_the_vision_tower_out(folders):
    code, out = _cli("trace", "--model", "tiny-qwen2-vl", cwd=folders)
    assert code == 0
    assert re.search(r"not run by these inputs, left out: model\.visual\.blocks", out)
    assert re.search(r"^Never called.*: model\.visual$", out, re.MULTILINE)


def test_finer_targets_paragraph_is_true(folders):
    """GUIDE.md section 3: LlamaMLP targets trace inside the blocks and replay exactly."""
    code, out = _cli("trace", "--model", "tiny-llama", "--targets", "LlamaMLP", "--verify", cwd=folders)
    assert code == 0
    lines = _lines(out)
    assert lines[-1].startswith("max abs diff: 0.000e+00")
    assert any(line.startswith("Opaque calls:") and "sdpa_attention_forward" in line for line in lines)
    assert "--targets LlamaMLP --verify` ends with `max abs diff: 0.000e+00`" in GUIDE.read_text(encoding="utf-8")


@pytest.mark.parametrize(("picture", "extra"), [("trace-tiny-llama.dot", ()),
                                                ("trace-tiny-llama-2-per-subgraph.dot",
                                                 ("--targets-per-subgraph", "2"))])
def test_pictures_in_docs_are_current(folders, picture, extra):
    target = folders / picture
    code, _ = _cli("trace", "--model", "tiny-llama", *extra, "--graph", str(target), cwd=folders)
    assert code == 0
    assert target.read_text() == (ROOT / "docs" / picture).read_text()
    assert f"(docs/{picture})" in GUIDE.read_text(encoding="utf-8")
