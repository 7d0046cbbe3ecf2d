"""The tested transformers range, said at run time: one warning outside it, `layerwise env`, patch spans."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from importlib.metadata import version

import pytest
import torch

import layerwise
from layerwise import ModelPatch
from layerwise.cli import main
from layerwise.host import versions
from layerwise.host.versions import (
    TESTED_TRANSFORMERS,
    UntestedVersionWarning,
    describe_span,
    span_covers,
)
from tests.conftest import build_tiny_llama

LOWEST, NEWEST = TESTED_TRANSFORMERS.releases


@pytest.fixture
def running(monkeypatch):
    """``running("9.0.0")`` makes layerwise see that transformers release; warnings not yet given."""
    monkeypatch.setattr(versions, "_warned", set())

    def pretend(release: str) -> None:
        monkeypatch.setattr(versions, "transformers_version", lambda: release)

    return pretend


def _untested_warnings(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if issubclass(w.category, UntestedVersionWarning)]


def test_the_range_holds_its_ends_and_nothing_outside():
    assert TESTED_TRANSFORMERS.covers(LOWEST) and TESTED_TRANSFORMERS.covers(NEWEST)
    assert TESTED_TRANSFORMERS.covers(f"{NEWEST}+cpu")               # a local build label is the same release
    major, minor, _ = (int(p) for p in NEWEST.split("."))
    assert not TESTED_TRANSFORMERS.covers(f"{major}.{minor + 1}.0")
    assert not TESTED_TRANSFORMERS.covers(f"{major}.{minor + 1}.0.dev0")  # a development build of the next one
    assert not TESTED_TRANSFORMERS.covers("4.57.6")
    assert not TESTED_TRANSFORMERS.covers("not-a-version")
    assert str(TESTED_TRANSFORMERS) == f"{LOWEST} to {NEWEST}"


def test_a_patch_span_runs_from_its_lowest_to_its_newest_release():
    assert span_covers(("5.3.0", "5.1.0"), "5.2.1") and not span_covers(("5.3.0",), "5.3.1")
    assert not span_covers((), "5.3.0")
    assert describe_span(("5.10.0", "5.9.0")) == "5.9.0 to 5.10.0"
    assert describe_span(("5.3.0",)) == "5.3.0" and describe_span(()) == "not stated"


def test_compress_outside_the_range_warns_once_naming_the_range_and_verify(running):
    running("99.1.0")
    model = build_tiny_llama()
    first = _untested_warnings(lambda: layerwise.compress(model, "W8A16", show_progress=False))
    assert len(first) == 1
    assert f"transformers 99.1.0 is outside the range layerwise was tested on ({LOWEST} to {NEWEST})" in first[0]
    assert "layerwise trace --model <folder> --verify" in first[0]
    again = _untested_warnings(lambda: layerwise.compress(build_tiny_llama(), "W8A16", show_progress=False))
    assert again == []  # once per process, not once per call


def test_trace_outside_the_range_warns_before_tracing(running):
    running("5.0.0rc1")
    model = build_tiny_llama()
    inputs = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    (message,) = _untested_warnings(lambda: layerwise.trace(model, inputs))
    assert message.startswith("transformers 5.0.0rc1 is outside the range")


def test_inside_the_range_nothing_is_said(running):
    running(NEWEST)
    assert _untested_warnings(lambda: layerwise.compress(build_tiny_llama(), "W8A16", show_progress=False)) == []


def test_a_patch_verified_on_other_releases_is_named(running):
    running(NEWEST)
    old = ModelPatch(name="old-llama", architectures=("LlamaForCausalLM",), sequential_targets=("LlamaDecoderLayer",),
                     verified_transformers=("5.1.0", "5.2.0"))
    (message,) = _untested_warnings(lambda: layerwise.compress(build_tiny_llama(), "W8A16", show_progress=False, options=layerwise.CompressOptions.of(patch=old)))
    assert f"model patch 'old-llama' was verified on transformers 5.1.0 to 5.2.0, not on the running {NEWEST}" \
        in message
    unstated = ModelPatch(name="unstated", architectures=("LlamaForCausalLM",))
    assert _untested_warnings(lambda: versions.warn_if_untested(unstated)) == []


def test_env_lists_the_versions_a_bug_report_needs(capsys, running):
    running(NEWEST)
    assert main(["env"]) == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert lines["layerwise"] == layerwise.__version__
    assert lines["torch"] == torch.__version__
    assert lines["compressed-tensors"] == version("compressed-tensors")
    assert lines["transformers"].startswith(version("transformers"))  # the installed one, not the pretended one
    assert f"{LOWEST} to {NEWEST}" in lines["transformers"]
    assert lines["accelerator"] in ("none (CPU only)",) or lines["accelerator"].startswith("CUDA")
    assert "layerwise " + layerwise.__version__ in lines["plugins"]


def test_env_json_says_whether_the_running_release_was_tested(capsys, monkeypatch):
    monkeypatch.setattr(versions, "installed_version",
                        lambda name: "99.0.0" if name == "transformers" else version(name))
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["versions"]["transformers"] == "99.0.0"
    assert report["transformers_tested"] == {"lowest": LOWEST, "newest": NEWEST, "running_is_tested": False}
    assert main(["env"]) == 0
    assert "NOT in the tested range" in capsys.readouterr().out


def test_plugins_shows_what_each_patch_was_verified_on(capsys):
    assert main(["plugins"]) == 0
    llama = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("llama "))
    assert llama.endswith(f"; verified on transformers {LOWEST} to {NEWEST}")
    assert main(["plugins", "--json"]) == 0
    patches = [p for plugin in json.loads(capsys.readouterr().out)["plugins"] for p in plugin["model_patches"]]
    spans = {p["name"]: tuple(p["verified_transformers"]) for p in patches}
    assert spans["llama"] == (LOWEST, NEWEST) and spans["qwen2_vl"] == ("5.23.0", NEWEST)
    assert all(span[-1] == NEWEST for span in spans.values())


def test_the_command_line_says_it_in_one_plain_line(tmp_path):
    """What a user of `layerwise trace` sees on stderr on an untested release: the message, no source lines."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=64).save_pretrained(tmp_path)
    script = ("import sys, layerwise.host.versions as v; v.transformers_version = lambda: '99.0.0'\n"
              "from layerwise.cli.app import main; sys.exit(main(['trace', '--model', sys.argv[1]]))")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    warned = [line for line in run.stderr.splitlines() if "99.0.0" in line]
    assert warned == [f"layerwise: warning: {versions.untested_message('99.0.0')}"]
    assert "warn_if_untested(" not in run.stderr
