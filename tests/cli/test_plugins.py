"""`layerwise plugins`: what is installed, what it registered, what is broken and why."""

from __future__ import annotations

import json

import pytest

from layerwise.cli import main
from layerwise.host.plugin_manager import DISABLE_ENV, KINDS, STRICT_ENV

PATCH_PLUGIN = '''
from layerwise import ModelPatch, hookimpl

@hookimpl
def layerwise_register_model_patches(register):
    register(ModelPatch(name="toy-gpt2", model_types=("gpt2",), architectures=("GPT2LMHeadModel",)))

@hookimpl
def layerwise_register_modifiers(register):
    register("ToyModifier", object)
'''

BROKEN = "raise ImportError('needs the frobnicator backend')\n"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(STRICT_ENV, raising=False)
    monkeypatch.delenv(DISABLE_ENV, raising=False)


@pytest.fixture
def installed(fake_dist):
    """One working third-party plugin and one that fails to import."""
    fake_dist("layerwise-toy", "0.3.1", entry_points={"toy": "lw_toy"}, files={"lw_toy.py": PATCH_PLUGIN})
    fake_dist("lw-broken", "2.0", entry_points={"broken_import": "lw_broken"}, files={"lw_broken.py": BROKEN})


def run(capsys, *argv):
    code = main(["plugins", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_lists_builtins_and_third_party_plugins_with_what_they_registered(installed, capsys):
    code, out, err = run(capsys)
    assert code == 0 and "Traceback" not in out + err
    lines = out.splitlines()
    assert lines[0].endswith("ok, 1 broken, 0 disabled") and int(lines[0].split()[0]) >= 18  # built-ins + 2
    assert "layerwise-toy 0.3.1" in lines and "lw-broken 2.0" in lines and "layerwise 0.1.0" in lines
    toy = lines.index("layerwise-toy 0.3.1")
    assert lines[toy + 1].split() == ["toy", "lw_toy"]
    block = lines[toy + 1:toy + 6]
    assert "    modifiers: ToyModifier" in block and "    model patches:" in block
    assert any(line.split() == ["toy-gpt2", "architectures", "GPT2LMHeadModel;", "model_types", "gpt2;",
                                "verified", "on:", "not", "stated"]
               for line in block)
    # built-ins, with the architectures each zoo patch matches
    assert any(line.strip().startswith("llama  architectures LlamaForCausalLM") and "model_types llama" in line
               for line in lines)
    assert any(line.strip().startswith("pipelines:") and "sequential" in line for line in lines)


def test_broken_plugins_are_marked_with_their_error_and_summarised(installed, capsys):
    code, out, _ = run(capsys)
    assert code == 0  # broken plugins are reported, not fatal
    lines = out.splitlines()
    broken = lines.index("lw-broken 2.0")
    assert lines[broken + 1].split() == ["broken_import", "lw_broken", "BROKEN", "(skipped)"]
    assert lines[broken + 2] == "    error: import failed: ImportError: needs the frobnicator backend"
    tail = out[out.index("1 broken plugin(s), skipped"):]
    assert f"{STRICT_ENV}=1" in tail
    assert "broken_import (lw-broken 2.0): import failed: ImportError: needs the frobnicator backend" in tail


def test_strict_flag_or_environment_makes_broken_plugins_exit_1(installed, capsys, monkeypatch):
    assert run(capsys, "--strict")[0] == 1
    monkeypatch.setenv(STRICT_ENV, "1")
    code, out, _ = run(capsys)
    assert code == 1 and "BROKEN" in out  # still lists everything


def test_strict_without_broken_plugins_exits_0(fake_dist, capsys):
    fake_dist("layerwise-toy", "0.3.1", entry_points={"toy": "lw_toy"}, files={"lw_toy.py": PATCH_PLUGIN})
    code, out, _ = run(capsys, "--strict")
    assert code == 0 and "0 broken" in out.splitlines()[0]


def test_every_scheme_and_the_recipe_presets_are_listed(installed, capsys):
    from layerwise.algorithms.quantization.presets import PRESETS

    code, out, _ = run(capsys)
    lines = out.splitlines()
    start = lines.index("schemes (--recipe NAME: round-to-nearest; or scheme: NAME in a modifier):")
    listed = [line.split()[0] for line in lines[start + 1:start + 1 + len(PRESETS)]]
    assert code == 0 and listed == list(PRESETS)
    assert "  W4AFP8       weights int4 group 128, inputs float8 token dynamic" in lines
    assert any(line.startswith("recipe presets: <ALGORITHM>_<SCHEME> for ") and "GPTQ (GPTQModifier)" in line
               and line.endswith("e.g. GPTQ_W4A16") for line in lines)


def test_json_report_has_stable_keys_and_the_same_content(installed, capsys):
    code, out, _ = run(capsys, "--json")
    assert code == 0
    report = json.loads(out)
    assert list(report) == ["group", "summary", "plugins", "conflicts", "schemes", "recipe_presets"]
    assert report["schemes"]["NVFP4A16"] == "weights nvfp4 (blocks of 16)"
    assert report["recipe_presets"]["algorithms"]["GPTQ"] == "GPTQModifier"
    assert report["recipe_presets"]["chains"]["QUAROT_GPTQ_W4A4"] == ["RotationModifier", "GPTQModifier"]
    assert report["group"] == "layerwise" and report["conflicts"] == []
    assert set(report["summary"]) == {"plugins", "ok", "broken", "disabled", "conflicts"}
    assert report["summary"]["broken"] == 1 and report["summary"]["plugins"] == len(report["plugins"])
    keys = {"name", "distribution", "version", "entry_point", "status", "broken", "disabled", "warnings",
            "registered", "model_patches"}
    for plugin in report["plugins"]:
        assert set(plugin) == keys and list(plugin["registered"]) == list(KINDS)
    by_name = {p["name"]: p for p in report["plugins"]}
    toy = by_name["toy"]
    assert (toy["distribution"], toy["version"], toy["entry_point"], toy["status"]) == \
        ("layerwise-toy", "0.3.1", "lw_toy", "ok")
    assert toy["registered"]["modifiers"] == ["ToyModifier"] and toy["registered"]["model_patches"] == ["toy-gpt2"]
    assert toy["model_patches"] == [{"name": "toy-gpt2", "architectures": ["GPT2LMHeadModel"],
                                     "model_types": ["gpt2"], "verified_transformers": []}]
    broken = by_name["broken_import"]
    assert broken["status"] == "broken" and broken["distribution"] == "lw-broken" and broken["version"] == "2.0"
    assert broken["broken"] == "import failed: ImportError: needs the frobnicator backend"
    assert by_name["zoo_llama"]["model_patches"][0]["model_types"] == ["llama"]
    assert "sequential" in by_name["builtin_pipelines"]["registered"]["pipelines"]


def test_disabled_plugins_are_listed_as_disabled(installed, capsys, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "broken_import,zoo_bert")
    code, out, _ = run(capsys, "--json")
    by_name = {p["name"]: p for p in json.loads(out)["plugins"]}
    assert code == 0
    assert by_name["broken_import"]["status"] == "disabled" and by_name["broken_import"]["broken"] is None
    assert by_name["zoo_bert"]["status"] == "disabled" and by_name["zoo_bert"]["registered"]["model_patches"] == []
    code, out, _ = run(capsys, "--strict")  # disabled is not broken
    assert code == 0 and "0 broken, 2 disabled" in out.splitlines()[0]
    assert ["zoo_bert", "layerwise.model_zoo.bert", "disabled", f"({DISABLE_ENV})"] in \
        [line.split() for line in out.splitlines()]


def test_name_conflicts_are_listed_with_both_distributions_and_exit_1(fake_dist, capsys):
    source = "from layerwise import hookimpl\n\n@hookimpl\ndef layerwise_register_modifiers(register):\n" \
             "    register('FastModifier', object)\n"
    fake_dist("lw-alpha", entry_points={"alpha": "lw_alpha"}, files={"lw_alpha.py": source})
    fake_dist("lw-beta", entry_points={"beta": "lw_beta"}, files={"lw_beta.py": source})
    code, out, err = run(capsys)
    assert code == 1 and "Traceback" not in err
    tail = out[out.index("1 name conflict(s)"):]
    assert "modifier 'FastModifier' is registered twice" in tail and "lw-alpha 1.0" in tail and "lw-beta 1.0" in tail
    # both plugins still show what they tried to register
    assert out.count("modifiers: FastModifier") == 2
    code, out, _ = run(capsys, "--json")
    conflicts = json.loads(out)["conflicts"]
    assert code == 1 and len(conflicts) == 1 and "lw-alpha" in conflicts[0] and "lw-beta" in conflicts[0]


def test_help_documents_the_exit_status(capsys):
    with pytest.raises(SystemExit):
        main(["plugins", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--json" in out and "--strict" in out and "Exit status 0 even with broken plugins" in out
