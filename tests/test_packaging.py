"""The distribution maps core/, plugins/ and model_zoo/ into one `layerwise` namespace."""

import subprocess
import sys
import zipfile
from importlib.metadata import distribution, entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_only_the_layerwise_namespace(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("layerwise-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"layerwise", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    names = zipfile.ZipFile(wheel).namelist()
    assert "layerwise/plugins/pipelines/__init__.py" in names
    assert "layerwise/model_zoo/llama.py" in names
    assert "layerwise/texts/demo_calibration.txt" in names


def test_builtins_register_through_the_entry_point_group():
    ours = {ep.name: ep.value for ep in entry_points(group="layerwise") if ep.dist.name == "layerwise"}
    assert ours["builtin_pipelines"] == "layerwise.plugins.pipelines"
    assert ours["zoo_llama"] == "layerwise.model_zoo.llama"


def test_console_script_is_declared():
    scripts = [ep for ep in distribution("layerwise").entry_points if ep.group == "console_scripts"]
    assert [ep.value for ep in scripts] == ["layerwise.cli:console"]
