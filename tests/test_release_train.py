"""The tested transformers range is stated once in code and agrees with every place an install happens.

``layerwise.host.versions.TESTED_TRANSFORMERS`` is the source: its lowest release is pyproject's floor
and what tox's ``transformers-lowest`` env installs; its newest is pinned in constraints.txt, which
README's commands and .ci/run install with, so they give the same result on any day.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from layerwise.host.versions import TESTED_TRANSFORMERS

ROOT = Path(__file__).resolve().parents[1]
#: the libraries whose internals layerwise reads or whose behaviour its results depend on
PINNED = ("torch", "transformers", "compressed-tensors", "huggingface-hub", "tokenizers", "safetensors")


def _pins(path: Path) -> dict[str, str]:
    """``name==version`` lines of a constraints file, following its ``-c`` includes."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-c "):
            pins.update(_pins(path.parent / line[3:].strip()))
        elif "==" in line:
            name, _, release = line.partition("==")
            pins[name.strip().lower()] = release.strip()
    return pins


def _tox() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "tox.ini")
    return parser


def test_constraints_pin_the_newest_tested_release_and_its_companions():
    pins = _pins(ROOT / "constraints.txt")
    assert set(PINNED) <= set(pins), f"constraints.txt must pin {sorted(set(PINNED) - set(pins))}"
    assert pins["transformers"] == TESTED_TRANSFORMERS.newest
    assert _pins(ROOT / "constraints-torch.txt") == {"torch": pins["torch"]}


def test_pyproject_floor_is_the_lowest_tested_release():
    (transformers,) = re.findall(r'^\s*"(transformers\b[^"]*)",$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert transformers == f"transformers>={TESTED_TRANSFORMERS.lowest}"


def test_tox_tests_the_lowest_release_and_todays_newest_past_the_pin():
    tox = _tox()
    (section,) = [s for s in tox.sections() if s.startswith("testenv:transformers-")]
    assert section == "testenv:transformers-{lowest,latest}"
    env = tox[section]
    assert "constraints-torch.txt" in env["install_command"] and "constraints.txt" not in env["install_command"]
    deps = dict(line.split(": ", 1) for line in env["deps"].strip().splitlines())
    assert deps == {"lowest": f"transformers=={TESTED_TRANSFORMERS.lowest}", "latest": "transformers"}
    assert re.search(r"^latest: python -m pip install .*--upgrade transformers$", env["commands_pre"], re.MULTILINE)
    assert "constraints.txt" in tox["testenv"]["install_command"]


def test_readme_and_ci_install_through_the_constraints_and_state_the_range():
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("pip install ")]
    assert len(commands) == 2 and all(" -c constraints.txt " in c for c in commands)
    assert f"transformers {TESTED_TRANSFORMERS.lowest} to {TESTED_TRANSFORMERS.newest}" in readme
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
