"""GUIDE.md is executable: its ``guide-test`` blocks run here as written, and every pasted
output block and DOT picture is produced again by docs/refresh_guide.py and compared: exactly on
the pinned transformers, by what the reader relies on (``reader_view``) on any other release.

A block is a fenced ```` ```python guide-test:<name> ```` block; it runs as a script
file (``guide_<name>.py``, so that ``inspect.getsource`` and autowrap work) in a fresh
temporary directory. Pasted output is a ```` ```text guide-output:<name> ```` block.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from layerwise.host.versions import TESTED_TRANSFORMERS, transformers_version
from tests.conftest import skip_unless_verified

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "GUIDE.md"


def _load_refresh_script():
    spec = importlib.util.spec_from_file_location("refresh_guide", ROOT / "docs" / "refresh_guide.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


refresh = _load_refresh_script()

#: every example the guide promises; removing one from GUIDE.md must be a conscious change here
EXAMPLES = {"tiny-folders", "trace-api", "targets", "discovery", "autowrap", "robust", "opaque", "dtypes", "shapes",
            "guards", "model-patch", "modifier", "pipeline", "recipes", "sparse", "pruning", "smoothquant", "autoround", "rotation",
            "streaming", "evaluate"}

TESTS = refresh.guide_blocks("test")
OUTPUTS = refresh.guide_blocks("output")
#: the pasted output is exactly what the newest tested transformers prints; elsewhere only what a reader needs
ON_THE_PIN = transformers_version() == TESTED_TRANSFORMERS.newest
_lines, _run_block, _cli = refresh.output_lines, refresh.run_block, refresh.run_cli


def test_the_guide_holds_every_example():
    assert set(TESTS) == EXAMPLES
    assert {"trace-tiny-llama", "verify-tiny-llama", "trace-tiny-qwen2-vl-image", "autowrap"} <= set(OUTPUTS)


@pytest.mark.parametrize("name", sorted(EXAMPLES - {"tiny-folders"} - {p.example for p in refresh.PASTED.values()}))
def test_guide_example_runs(name, tmp_path):
    """Each example's own asserts hold; those with pasted output run in ``produced`` below."""
    _run_block(name, tmp_path)


# -- the output pasted in the guide -----------------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    where = tmp_path_factory.mktemp("guide-folders")
    _run_block("tiny-folders", where)
    assert (where / "tiny-llama" / "config.json").is_file()
    assert (where / "tiny-qwen2-vl" / "config.json").is_file()
    return where


@pytest.fixture(scope="module")
def production(tmp_path_factory):
    """Every pasted block and picture as docs/refresh_guide.py produces it now, and what failed."""
    failures: dict[str, str] = {}
    return refresh.generate(tmp_path_factory.mktemp("guide-produced"), failures), failures


@pytest.fixture
def produced(production, request):
    """The produced text; a block that depends on a patch is skipped where that patch is not verified."""
    name = request.node.callspec.params["name"]
    if name in refresh.PASTED and refresh.PASTED[name].patch:
        from layerwise.host.plugin_manager import registry

        skip_unless_verified(registry("model_patches").get(refresh.PASTED[name].patch))
    texts, failures = production
    assert name not in failures, failures[name]
    return texts


def _pasted(name: str) -> str:
    return refresh.pasted_text(name, OUTPUTS)


def test_every_pasted_block_has_a_producer():
    assert set(OUTPUTS) == set(refresh.PASTED)
    for picture in refresh.PICTURES:
        assert f"(docs/{picture})" in GUIDE.read_text(encoding="utf-8")


def test_refreshing_changes_only_the_blocks():
    text = GUIDE.read_text(encoding="utf-8")
    assert refresh.rewrite_guide(text, OUTPUTS) == text
    changed = refresh.rewrite_guide(text, {"autowrap": "new line\n"})
    assert changed.replace("```text guide-output:autowrap\nnew line\n```", "") == \
        text.replace(f"```text guide-output:autowrap\n{OUTPUTS['autowrap']}```", "")


@pytest.mark.parametrize("name", sorted([*refresh.PASTED, *refresh.PICTURES]))
def test_pasted_output_holds_what_the_reader_relies_on(name, produced):
    """Pieces, targets, exact replay, cluster contents: the same on every supported transformers."""
    view = refresh.reader_view(name, _pasted(name))
    assert view, f"nothing a reader relies on was found in {name}"
    assert refresh.reader_view(name, produced[name]) == view


@pytest.mark.skipif(not ON_THE_PIN, reason=f"pasted output is exact on transformers {TESTED_TRANSFORMERS.newest} only")
@pytest.mark.parametrize("name", sorted([*refresh.PASTED, *refresh.PICTURES]))
def test_pasted_output_is_current_on_the_pinned_transformers(name, produced):
    assert produced[name] == _pasted(name), f"{name} is stale: run python docs/refresh_guide.py"


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


def test_the_architecture_map_names_only_folders_that_exist_and_every_package():
    """GUIDE section 12's table against the tree: each folder it names exists, each package is named."""
    text = GUIDE.read_text(encoding="utf-8")
    section = text[text.index("## 12. Architecture map"):]
    table = section[:section.index("What flows between them")]
    named = set(re.findall(r"^\| `([a-z_/]+(?:\.py)?)`", table, re.MULTILINE)) | set(re.findall(r", `([a-z_]+/)`", table))
    assert named, "the map's table was not found"
    for folder in named:
        assert (ROOT / folder).exists(), f"GUIDE's architecture map names {folder}, which does not exist"
    packages = {p.name for p in (ROOT / "core").iterdir() if (p / "__init__.py").is_file()}
    listed = {folder.removeprefix("core/").strip("/") for folder in named if folder.startswith("core/")}
    assert packages - {"texts"} <= listed, f"packages missing from the map: {sorted(packages - listed)}"
