"""The import contracts hold, and the checker that says so catches what it should."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checker():
    spec = importlib.util.spec_from_file_location("check_imports", ROOT / "tools" / "check_imports.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_imports"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["check_imports"]


def test_layerwise_keeps_its_import_contracts(checker):
    assert checker.check() == []


def test_a_cycle_is_found_and_shown_as_a_path(checker):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert checker.cycles(graph) == [["a", "b", "c", "a"]]
    assert checker.cycles({"a": {"b"}, "b": set()}) == []


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_upward_imports_plugin_leaks_and_cycles_are_each_reported(checker, tmp_path, monkeypatch):
    for package in ("", "algorithms/", "host/", "plugin/", "common/"):
        write(tmp_path, f"core/{package}__init__.py", "")
    write(tmp_path, "core/algorithms/solver.py", "def f():\n    from layerwise.host.thing import x\n")
    write(tmp_path, "core/host/thing.py", "from layerwise.plugins.mine import y\nx = 1\n")
    write(tmp_path, "core/common/a.py", "from layerwise.common import b\n")
    write(tmp_path, "core/common/b.py", "from layerwise.common.a import z\n")
    write(tmp_path, "plugins/__init__.py", "")
    write(tmp_path, "plugins/mine.py", "from layerwise.host.thing import x\nfrom layerwise.plugin import y\n")
    (tmp_path / "model_zoo").mkdir()
    (tmp_path / "bench").mkdir()
    monkeypatch.setattr(checker, "ROOT", tmp_path)
    monkeypatch.setattr(checker, "EXTERNAL_PLUGINS", {})
    problems = "\n".join(checker.check())
    assert "layerwise.algorithms.solver imports layerwise.host.thing, a layer above" in problems
    assert "layerwise.host.thing imports the plugin module layerwise.plugins.mine" in problems
    assert "plugin module layerwise.plugins.mine imports layerwise.host.thing" in problems
    assert "plugin module layerwise.plugins.mine imports layerwise.plugin;" not in problems
    assert "import cycle: layerwise.common.a -> layerwise.common.b -> layerwise.common.a" in problems


def test_type_checking_imports_do_not_count(checker, tmp_path, monkeypatch):
    write(tmp_path, "core/__init__.py", "")
    write(tmp_path, "core/algorithms/__init__.py", "")
    write(tmp_path, "core/algorithms/solver.py",
          "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from layerwise.host.thing import x\n")
    for folder in ("plugins", "model_zoo", "bench"):
        (tmp_path / folder).mkdir()
    monkeypatch.setattr(checker, "ROOT", tmp_path)
    monkeypatch.setattr(checker, "EXTERNAL_PLUGINS", {})
    assert checker.check() == []
