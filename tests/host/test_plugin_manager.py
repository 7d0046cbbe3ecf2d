"""The plugin host's rules, with plugins installed as real distributions (no mocked importlib.metadata)."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from layerwise.errors import DuplicateNameError, PluginError, UnknownNameError
from layerwise.host.hookspecs import hookimpl
from layerwise.host.lifecycle import Lifecycle
from layerwise.host.modifier import Modifier
from layerwise.host.patch_selection import find_patch, resolve_patch
from layerwise.host.pipeline_selection import DEFAULT_CHAIN, run_pipeline, select_pipeline
from layerwise.host.plugin_manager import (
    DISABLE_ENV,
    STRICT_ENV,
    PluginHost,
    get_host,
    registry,
    reset_host,
)
from layerwise.host.recipe import parse_recipe
from layerwise.host.state import CompressionState
from tests.conftest import build_tiny_llama
from tests.fake_dists import write_dist

#: a complete third-party plugin: a modifier, a pipeline, a model patch and a pipeline choice
TOY_PLUGIN = '''
from dataclasses import dataclass

from layerwise import ModelPatch, Modifier, hookimpl
from layerwise.host.pipeline import Pipeline


@dataclass
class ToyModifier(Modifier):
    bits: int = 8

    def __post_init__(self):
        super().__post_init__()
        self.events = []

    def on_calibration_start(self, state):
        self.events.append("calibration_start")

    def on_sequential_epoch_end(self, state, modules):
        self.events.append(("epoch", tuple(modules)))

    def on_calibration_end(self, state):
        self.events.append("calibration_end")


class ToyPipeline(Pipeline):
    name = "toy"

    def run(self, model, batches, lifecycle, options):
        with lifecycle.calibrating():
            for batch in batches:
                model(**batch)
            lifecycle.sequential_epoch_end(["transformer.h.0"])


TOY_PATCH = ModelPatch(name="toy-gpt2", model_types=("gpt2",), architectures=("GPT2LMHeadModel",),
                       sequential_targets=("GPT2Block",), ignore=("lm_head",))


@hookimpl
def layerwise_register_modifiers(register):
    register("ToyModifier", ToyModifier)


@hookimpl
def layerwise_register_pipelines(register):
    register("toy", ToyPipeline)


@hookimpl
def layerwise_register_model_patches(register):
    register(TOY_PATCH)


@hookimpl
def layerwise_select_pipeline(model, modifiers):
    return "toy" if any(isinstance(m, ToyModifier) for m in modifiers) else None
'''


def plugin_source(*hooks: str) -> str:
    """A plugin module made of the given hook implementations (source snippets)."""
    return "from layerwise import ModelPatch, hookimpl\n\n" + "\n\n".join(hooks)


def registers(kind: str, name: str) -> str:
    if kind == "model_patches":
        return f"@hookimpl\ndef layerwise_register_model_patches(register):\n" \
               f"    register(ModelPatch(name={name!r}, model_types=({name!r},)))\n"
    return f"@hookimpl\ndef layerwise_register_{kind}(register):\n    register({name!r}, object)\n"


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=0, eos_token_id=1)
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(autouse=True)
def fresh_host(monkeypatch):
    """Every test starts from a host built from the environment it sets up, and leaves none behind."""
    monkeypatch.delenv(STRICT_ENV, raising=False)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    reset_host()
    yield
    reset_host()


def host_quietly() -> PluginHost:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        host = get_host()
        host.registries  # noqa: B018 - registration hooks run here
    return host


def assert_builtins_work():
    assert "QuantizationModifier" in registry("modifiers")
    assert {"sequential", "layer_sequential", "basic", "datafree"} <= set(registry("pipelines").names())
    assert find_patch(build_tiny_llama()).name == "llama"
    assert [type(m).__name__ for m in parse_recipe("W4A16")] == ["QuantizationModifier"]


# -- a third-party plugin found through a real entry point -------------------------------------------
def test_third_party_plugin_is_discovered_through_its_entry_point_and_usable(fake_dist):
    fake_dist("layerwise-toy", "0.3.1", entry_points={"toy": "lw_toy"}, files={"lw_toy/__init__.py": TOY_PLUGIN})

    host = get_host()
    info = host.plugins["toy"]
    assert (info.distribution, info.version, info.entry_point, info.broken) == \
        ("layerwise-toy", "0.3.1", "lw_toy", None)
    assert "toy" in registry("pipelines") and registry("pipelines").owner("toy").startswith("layerwise-toy 0.3.1")
    assert info.registered == {"modifiers": ["ToyModifier"], "pipelines": ["toy"], "model_patches": ["toy-gpt2"]}

    model = tiny_gpt2()
    patch = find_patch(model)  # chosen automatically among the zoo's patches and the plugin's
    assert patch is not None and patch.name == "toy-gpt2" and patch.sequential_targets == ("GPT2Block",)
    assert find_patch(build_tiny_llama()).name == "llama"  # the zoo is untouched

    (modifier,) = parse_recipe({"stage": {"ToyModifier": {"bits": 3}}})
    assert type(modifier).__module__ == "lw_toy" and modifier.bits == 3
    assert [type(m).__name__ for m in parse_recipe("ToyModifier")] == ["ToyModifier"]

    # the plugin's pipeline choice is honoured, and its pipeline calibrates the model
    assert select_pipeline(model, [modifier]) == ["toy", *DEFAULT_CHAIN]
    lifecycle = Lifecycle(CompressionState(model=model, modifiers=[modifier], patch=patch,
                                           sequential_targets=list(patch.sequential_targets)))
    lifecycle.initialize()
    batches = [{"input_ids": torch.tensor([[1, 2, 3]])}]
    assert run_pipeline(model, batches, lifecycle) == "toy"
    assert modifier.events == ["calibration_start", ("epoch", ("transformer.h.0",)), "calibration_end"]
    # ... and only for its own modifiers
    assert select_pipeline(model, [Modifier()]) == list(DEFAULT_CHAIN)


def test_a_distribution_installed_after_the_host_loaded_is_found_after_reset_host(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "late" not in get_host().plugins
    write_dist(tmp_path, "lw-late", entry_points={"late": "lw_late"},
               files={"lw_late.py": plugin_source(registers("modifiers", "LateModifier"))})
    try:
        reset_host()
        assert get_host().plugins["late"].distribution == "lw-late"
        assert "LateModifier" in registry("modifiers")
    finally:
        sys.modules.pop("lw_late", None)


def test_two_distributions_with_the_same_entry_point_name_both_load(fake_dist):
    fake_dist("lw-one", entry_points={"extra": "lw_one"},
              files={"lw_one.py": plugin_source(registers("modifiers", "OneModifier"))})
    fake_dist("lw-two", entry_points={"extra": "lw_two"},
              files={"lw_two.py": plugin_source(registers("modifiers", "TwoModifier"))})
    host = host_quietly()
    assert {"OneModifier", "TwoModifier"} <= set(registry("modifiers").names())
    assert not host.broken()
    mine = {name: info.distribution for name, info in host.plugins.items() if info.entry_point in {"lw_one", "lw_two"}}
    assert len(mine) == 2 and "extra" in mine  # the first found keeps the plain name ...
    second = next(dist for name, dist in mine.items() if name != "extra")
    assert f"{second}:extra" in mine  # ... the other is told apart by its distribution


def test_loading_entry_points_again_changes_nothing(fake_dist):
    fake_dist("layerwise-toy", entry_points={"toy": "lw_toy"}, files={"lw_toy/__init__.py": TOY_PLUGIN})
    host = get_host()
    before = dict(host.plugins)
    host.load_entry_points()
    assert host.plugins == before and not host.broken()
    assert "ToyModifier" in registry("modifiers") and "QuantizationModifier" in registry("modifiers")


# -- a broken plugin is reported and skipped ---------------------------------------------------------
def test_plugin_failing_on_import_is_reported_and_the_rest_keeps_working(fake_dist):
    fake_dist("lw-broken", "2.0", entry_points={"broken_import": "lw_broken"},
              files={"lw_broken.py": "raise ImportError('needs the frobnicator backend')\n"})
    fake_dist("layerwise-toy", entry_points={"toy": "lw_toy"}, files={"lw_toy/__init__.py": TOY_PLUGIN})

    with pytest.warns(RuntimeWarning, match=r"lw-broken 2\.0 \(plugin 'broken_import'\) is broken and was skipped: "
                                            r"import failed: ImportError: needs the frobnicator backend"):
        host = get_host()
    info = host.plugins["broken_import"]
    assert info.distribution == "lw-broken" and info.status == "broken"
    assert info.broken == "import failed: ImportError: needs the frobnicator backend"
    assert host.broken() == [info] and info.registered == {}
    assert_builtins_work()
    assert "ToyModifier" in registry("modifiers")  # the other third-party plugin too


def test_plugin_failing_in_a_registration_hook_is_reported_and_leaves_nothing_behind(fake_dist):
    source = plugin_source(registers("pipelines", "half-pipe"), '''
@hookimpl
def layerwise_register_modifiers(register):
    raise RuntimeError("config file missing")
''')
    fake_dist("lw-halfway", entry_points={"halfway": "lw_halfway"}, files={"lw_halfway.py": source})
    with pytest.warns(RuntimeWarning, match=r"lw-halfway 1\.0 \(plugin 'halfway'\) is broken and was skipped: "
                                            r"layerwise_register_modifiers raised RuntimeError: config file missing"):
        host = get_host()  # registration hooks run when the host loads
    info = host.plugins["halfway"]
    assert info.broken == "layerwise_register_modifiers raised RuntimeError: config file missing"
    assert "half-pipe" not in registry("pipelines")  # what it registered before failing is gone
    assert info.registered == {}
    assert_builtins_work()


def test_plugin_with_a_hook_signature_pluggy_rejects_is_reported(fake_dist):
    source = plugin_source('''
@hookimpl
def layerwise_register_modifiers(register, device):
    pass
''')
    fake_dist("lw-badsig", entry_points={"badsig": "lw_badsig"}, files={"lw_badsig.py": source})
    with pytest.warns(RuntimeWarning, match="badsig"):
        host = get_host()
    assert host.plugins["badsig"].broken.startswith("registration failed: PluginValidationError")
    assert "device" in host.plugins["badsig"].broken
    assert_builtins_work()


def test_model_patch_registered_the_wrong_way_is_a_clear_registration_error(fake_dist):
    source = plugin_source('''
@hookimpl
def layerwise_register_model_patches(register):
    register("mymodel", ModelPatch(name="mymodel"))
''')
    fake_dist("lw-wrongpatch", entry_points={"wrongpatch": "lw_wrongpatch"}, files={"lw_wrongpatch.py": source})
    host = host_quietly()
    assert "register() for model patches takes one ModelPatch" in host.plugins["wrongpatch"].broken
    assert "llama" in registry("model_patches")


def test_strict_mode_makes_an_import_failure_an_error_naming_plugin_distribution_and_cause(fake_dist, monkeypatch):
    fake_dist("lw-broken", "2.0", entry_points={"broken_import": "lw_broken"},
              files={"lw_broken.py": "raise ImportError('needs the frobnicator backend')\n"})
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(PluginError) as caught:
        get_host()
    message = str(caught.value)
    assert "'broken_import'" in message and "lw-broken 2.0" in message
    assert "ImportError: needs the frobnicator backend" in message
    assert isinstance(caught.value.__cause__, ImportError)


def test_strict_mode_makes_a_registration_failure_an_error(fake_dist, monkeypatch):
    source = plugin_source('''
@hookimpl
def layerwise_register_savers(register):
    raise RuntimeError("no disk")
''')
    fake_dist("lw-nodisk", entry_points={"nodisk": "lw_nodisk"}, files={"lw_nodisk.py": source})
    monkeypatch.setenv(STRICT_ENV, "true")
    with pytest.raises(PluginError, match=r"'nodisk' from distribution lw-nodisk 1\.0 is broken: "
                                          r"layerwise_register_savers raised RuntimeError: no disk"):
        get_host()
    with pytest.raises(PluginError, match="nodisk"):  # an own host: when its registries are first used
        PluginHost().registries  # noqa: B018


def test_strict_mode_without_broken_plugins_loads_normally(fake_dist, monkeypatch):
    fake_dist("layerwise-toy", entry_points={"toy": "lw_toy"}, files={"lw_toy/__init__.py": TOY_PLUGIN})
    monkeypatch.setenv(STRICT_ENV, "1")
    assert "ToyModifier" in registry("modifiers")
    assert_builtins_work()


# -- disabling ---------------------------------------------------------------------------------------
def test_disable_by_entry_point_name_never_imports_the_plugin(fake_dist, monkeypatch):
    fake_dist("lw-broken", entry_points={"broken_import": "lw_broken"},
              files={"lw_broken.py": "raise ImportError('must not be imported')\n"})
    fake_dist("layerwise-toy", entry_points={"toy": "lw_toy"}, files={"lw_toy/__init__.py": TOY_PLUGIN})
    monkeypatch.setenv(DISABLE_ENV, " broken_import , toy")
    monkeypatch.setenv(STRICT_ENV, "1")  # a disabled plugin is not broken: strict mode has nothing to say
    host = get_host()
    assert "lw_broken" not in sys.modules and "lw_toy" not in sys.modules
    for name in ("broken_import", "toy"):
        assert host.plugins[name].disabled and host.plugins[name].status == "disabled"
        assert host.plugins[name].broken is None
    assert "ToyModifier" not in registry("modifiers") and "toy" not in registry("pipelines")
    assert_builtins_work()


def test_disable_a_builtin_by_entry_point_name(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "zoo_llama")
    assert get_host().plugins["zoo_llama"].disabled
    assert "llama" not in registry("model_patches") and "bert" in registry("model_patches")
    assert find_patch(build_tiny_llama()) is None


def test_disable_by_distribution_name_blocks_all_its_entry_points(fake_dist, monkeypatch):
    fake_dist("lw-many_Plugins", entry_points={"first": "lw_many.first", "second": "lw_many.second"},
              files={"lw_many/__init__.py": "",
                     "lw_many/first.py": plugin_source(registers("modifiers", "FirstModifier")),
                     "lw_many/second.py": plugin_source(registers("pipelines", "second"))})
    monkeypatch.setenv(DISABLE_ENV, "LW.Many-plugins")  # distribution names compare PEP 503 normalised
    host = get_host()
    assert host.plugins["first"].disabled and host.plugins["second"].disabled
    assert "lw_many" not in sys.modules
    assert "FirstModifier" not in registry("modifiers") and "second" not in registry("pipelines")
    assert_builtins_work()


# -- name conflicts ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, name", [("pipelines", "fast"), ("modifiers", "FastModifier"),
                                        ("model_patches", "fastmodel")])
def test_two_plugins_registering_one_name_is_an_error_naming_both_distributions(fake_dist, kind, name):
    fake_dist("lw-alpha", "1.2", entry_points={"alpha": "lw_alpha"},
              files={"lw_alpha.py": plugin_source(registers(kind, name))})
    fake_dist("lw-beta", "3.4", entry_points={"beta": "lw_beta"},
              files={"lw_beta.py": plugin_source(registers(kind, name))})
    with pytest.raises(DuplicateNameError) as caught:
        registry(kind)
    message = str(caught.value)
    assert f"{name!r} is registered twice" in message
    assert "lw-alpha 1.2 (plugin 'alpha')" in message and "lw-beta 3.4 (plugin 'beta')" in message
    assert DISABLE_ENV in message


def test_a_plugin_taking_a_builtin_name_is_an_error_naming_layerwise_and_the_plugin(fake_dist):
    fake_dist("lw-shadow", entry_points={"shadow": "lw_shadow"},
              files={"lw_shadow.py": plugin_source(registers("model_patches", "llama"))})
    with pytest.raises(DuplicateNameError, match=r"model patch 'llama' is registered twice: by "
                                                 r"(layerwise 0\.1\.0 \(plugin 'zoo_llama'\) and by lw-shadow 1\.0"
                                                 r"|lw-shadow 1\.0 \(plugin 'shadow'\) and by layerwise)"):
        registry("model_patches")


def test_disabling_one_side_of_a_conflict_resolves_it(fake_dist, monkeypatch):
    fake_dist("lw-alpha", entry_points={"alpha": "lw_alpha"},
              files={"lw_alpha.py": plugin_source(registers("modifiers", "FastModifier"))})
    fake_dist("lw-beta", entry_points={"beta": "lw_beta"},
              files={"lw_beta.py": plugin_source(registers("modifiers", "FastModifier"))})
    monkeypatch.setenv(DISABLE_ENV, "beta")
    assert registry("modifiers").owner("FastModifier").startswith("lw-alpha")


def test_survey_lists_every_conflict_without_raising(fake_dist):
    fake_dist("lw-alpha", entry_points={"alpha": "lw_alpha"},
              files={"lw_alpha.py": plugin_source(registers("modifiers", "FastModifier"),
                                                  registers("pipelines", "fast"))})
    fake_dist("lw-beta", entry_points={"beta": "lw_beta"},
              files={"lw_beta.py": plugin_source(registers("modifiers", "FastModifier"),
                                                 registers("pipelines", "fast"))})
    with pytest.raises(DuplicateNameError):  # the process-wide host refuses to load
        get_host()
    host = PluginHost()
    registries, conflicts = host.survey()
    assert len(conflicts) == 2 and all("lw-alpha" in c and "lw-beta" in c for c in conflicts)
    assert host.plugins["beta"].registered == {"pipelines": ["fast"], "modifiers": ["FastModifier"]}
    assert "QuantizationModifier" in registries["modifiers"]
    with pytest.raises(DuplicateNameError):  # compression still refuses
        registry("modifiers")


# -- pipeline selection hook ------------------------------------------------------------------------
CHOOSER = '''
from layerwise import hookimpl

@hookimpl
def layerwise_select_pipeline(model, modifiers):
    return {choice!r} if type(model).__name__ == {model!r} else None
'''


def test_plugins_agreeing_or_abstaining_on_the_pipeline(fake_dist):
    fake_dist("lw-a", entry_points={"a": "lw_a"},
              files={"lw_a.py": CHOOSER.format(choice="basic", model="LlamaForCausalLM")})
    fake_dist("lw-b", entry_points={"b": "lw_b"},
              files={"lw_b.py": CHOOSER.format(choice="basic", model="LlamaForCausalLM")})
    fake_dist("lw-c", entry_points={"c": "lw_c"},
              files={"lw_c.py": CHOOSER.format(choice="layer_sequential", model="GPT2LMHeadModel")})
    assert get_host().select_pipeline(build_tiny_llama(), []) == "basic"
    assert get_host().select_pipeline(tiny_gpt2(), []) == "layer_sequential"
    assert get_host().select_pipeline(torch.nn.Linear(2, 2), []) is None


def test_plugins_choosing_different_pipelines_is_an_error_naming_both(fake_dist):
    fake_dist("lw-a", entry_points={"a": "lw_a"},
              files={"lw_a.py": CHOOSER.format(choice="basic", model="LlamaForCausalLM")})
    fake_dist("lw-b", entry_points={"b": "lw_b"},
              files={"lw_b.py": CHOOSER.format(choice="layer_sequential", model="LlamaForCausalLM")})
    with pytest.raises(PluginError) as caught:
        get_host().select_pipeline(build_tiny_llama(), [])
    message = str(caught.value)
    assert "disagree" in message and "LlamaForCausalLM" in message
    assert "lw-a 1.0 (plugin 'a') chose 'basic'" in message
    assert "lw-b 1.0 (plugin 'b') chose 'layer_sequential'" in message


@pytest.mark.parametrize("body, reason", [
    ("raise RuntimeError('oops')", "layerwise_select_pipeline raised RuntimeError: oops"),
    ("return 'warp-drive'", "layerwise_select_pipeline chose 'warp-drive', which is no registered pipeline"),
])
def test_a_failing_pipeline_choice_is_ignored_with_a_warning_or_an_error_in_strict_mode(fake_dist, monkeypatch,
                                                                                         body, reason):
    source = f"from layerwise import hookimpl\n\n@hookimpl\ndef layerwise_select_pipeline(model):\n    {body}\n"
    fake_dist("lw-chooser", entry_points={"chooser": "lw_chooser"}, files={"lw_chooser.py": source})
    with pytest.warns(RuntimeWarning, match=r"lw-chooser 1\.0 \(plugin 'chooser'\): " + reason):
        assert select_pipeline(build_tiny_llama(), [Modifier()]) == list(DEFAULT_CHAIN)
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(PluginError, match=r"'chooser' from distribution lw-chooser 1\.0: " + reason):
        select_pipeline(build_tiny_llama(), [Modifier()])


# -- smaller rules -----------------------------------------------------------------------------------
def test_a_hook_no_hookspec_knows_is_warned_about_but_the_plugin_loads(fake_dist):
    source = plugin_source(registers("modifiers", "TypoModifier"), '''
@hookimpl
def layerwise_register_modifier(register):
    register("Never", object)
''')
    fake_dist("lw-typo", entry_points={"typo": "lw_typo"}, files={"lw_typo.py": source})
    with pytest.warns(RuntimeWarning, match=r"implements 'layerwise_register_modifier', which is no layerwise hook"):
        host = get_host()
    info = host.plugins["typo"]
    assert info.broken is None and info.warnings and "layerwise_register_modifier" in info.warnings[0]
    assert "TypoModifier" in registry("modifiers") and "Never" not in registry("modifiers")


def test_register_refuses_a_taken_name_and_keeps_the_first_plugin():
    host = PluginHost(load_entry_points=False)

    class First:
        @hookimpl
        def layerwise_register_observers(self, register):
            register("first", object)

    host.register(First(), name="same")
    with pytest.raises(ValueError, match="'same' is already registered"):
        host.register(First(), name="same")
    assert host.registries["observers"].names() == ["first"]


def test_unknown_model_patch_name_is_reported_with_its_kind():
    with pytest.raises(UnknownNameError, match=r"unknown model patch 'nope'; valid model patches: .*llama"):
        resolve_patch(build_tiny_llama(), "nope")
    assert registry("model_patches").kind == "model patch"
