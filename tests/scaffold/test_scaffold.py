"""`layerwise new-patch`: a generated package passes the plugin kit as written; bad input writes nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import layerwise
from layerwise.cli import main
from layerwise.host.versions import transformers_version
from layerwise.scaffold import KitResult
from layerwise.scaffold.check import load_generated, registered_patches
from layerwise.scaffold.tiny_config import tiny_config_fields
from layerwise.testing import check_model_patch

#: three families that trace: two Llama-shaped, one not (parallel attention + MLP, one fused qkv Linear)
FAMILIES = {
    "Qwen2ForCausalLM": ("qwen2", "Qwen2DecoderLayer", ("Qwen2ForCausalLM", "Qwen2Model")),
    "MistralForCausalLM": ("mistral", "MistralDecoderLayer", ("MistralForCausalLM", "MistralModel")),
    "GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXLayer", ("GPTNeoXForCausalLM", "GPTNeoXModel")),
}


def new_patch(capsys, *argv):
    code = main(["new-patch", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def qwen2_package(tmp_path_factory):
    """One generated package (no kit run) shared by the tests that only read it."""
    folder = tmp_path_factory.mktemp("scaffold") / "layerwise-qwen2"
    assert main(["new-patch", "Qwen2ForCausalLM", "--output-dir", str(folder), "--no-check"]) == 0
    return folder


@pytest.mark.parametrize("architecture", FAMILIES)
def test_generated_patch_passes_the_kit(architecture, tmp_path, capsys):
    slug, block, architectures = FAMILIES[architecture]
    code, out, err = new_patch(capsys, architecture, "--output-dir", tmp_path / "pkg", "--no-check")
    assert code == 0, err
    assert f"wrote layerwise-{slug.replace('_', '-')} to {tmp_path / 'pkg'}" in out
    (patch,) = registered_patches(load_generated(tmp_path / "pkg", f"layerwise_{slug}"))
    assert patch.name == slug and patch.model_types == (slug,) and patch.architectures == architectures
    assert patch.sequential_targets == (block,) and patch.ignore == ("lm_head",)
    assert patch.verified_transformers == (transformers_version(),) * 2
    (build,) = patch.tiny_models
    model = build()
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 256
    check_model_patch(patch, model)


def test_the_command_runs_the_kit_and_says_how_long_it_took(tmp_path, capsys):
    code, out, _ = new_patch(capsys, "Qwen2ForCausalLM", "--output-dir", tmp_path / "pkg")
    assert code == 0
    passed = next(line for line in out.splitlines() if line.startswith("plugin kit: passed"))
    assert "tiny_qwen2()" in passed and passed.split(" in ")[1].split()[1] == "s"
    assert "next: cd" in out


def test_no_check_skips_the_kit(tmp_path, capsys, monkeypatch):
    def kit_must_not_run(*args):
        raise AssertionError("the kit ran despite --no-check")

    monkeypatch.setattr("layerwise.cli.new_patch.run_kit", kit_must_not_run)
    code, out, _ = new_patch(capsys, "MistralForCausalLM", "--output-dir", tmp_path / "pkg", "--no-check")
    assert code == 0 and "plugin kit: skipped (--no-check)" in out


def test_a_failing_kit_exits_1_naming_the_fix_and_keeps_the_package(tmp_path, capsys, monkeypatch):
    message = "check_model_patch(mistral): trace (text): tracing failed. add it to opaque_functions"
    monkeypatch.setattr("layerwise.cli.new_patch.run_kit",
                        lambda path, module: KitResult("mistral", ("tiny_mistral",), 0.5, message))
    code, out, _ = new_patch(capsys, "MistralForCausalLM", "--output-dir", tmp_path / "pkg")
    assert code == 1
    assert message in out and "FAILED" in out and "was written" in out
    assert (tmp_path / "pkg" / "src" / "layerwise_mistral" / "__init__.py").is_file()


def test_pyproject_parses_with_the_entry_point(qwen2_package):
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((qwen2_package / "pyproject.toml").read_text())["project"]
    assert project["name"] == "layerwise-qwen2"
    assert project["entry-points"]["layerwise"] == {"qwen2": "layerwise_qwen2"}
    assert project["dependencies"] == [f"layerwise>={layerwise.__version__}"]
    assert project["optional-dependencies"]["test"] == ["pytest>=8"]
    assert sorted(str(p.relative_to(qwen2_package)) for p in qwen2_package.rglob("*") if p.is_file()) == [
        "README.md", "pyproject.toml", "src/layerwise_qwen2/__init__.py", "tests/test_patch.py"]


def test_the_tiny_config_is_an_editable_keyword_dict(qwen2_package):
    source = (qwen2_package / "src" / "layerwise_qwen2" / "__init__.py").read_text()
    assert "TINY_CONFIG: dict[str, Any] = dict(\n    hidden_size=64,  # default 4096\n" in source
    assert "    vocab_size=256,  # default 151936\n" in source
    assert "tie_word_embeddings" not in source  # only what differs from the defaults
    compile(source, "__init__.py", "exec")


@pytest.mark.slow
def test_the_generated_tests_pass_from_the_source_tree(qwen2_package):
    env = {**os.environ, "PYTHONPATH": str(qwen2_package / "src")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                         cwd=qwen2_package, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout


def test_unknown_architecture_is_named_with_a_suggestion(tmp_path, capsys):
    code, _, err = new_patch(capsys, "MistralForCasualLM", "--output-dir", tmp_path / "pkg")
    assert code == 2 and "Traceback" not in err
    assert "no architecture 'MistralForCasualLM'" in err and "did you mean 'MistralForCausalLM'?" in err
    assert not (tmp_path / "pkg").exists()


def test_a_class_that_is_not_a_model_names_the_models_of_its_family(tmp_path, capsys):
    code, _, err = new_patch(capsys, "LlamaConfig", "--output-dir", tmp_path / "pkg")
    assert code == 2
    assert "LlamaConfig is not a model class (it is a configuration class)" in err and "LlamaForCausalLM" in err


def test_multimodal_architectures_are_refused_with_what_to_do(tmp_path, capsys):
    code, _, err = new_patch(capsys, "LlavaForConditionalGeneration", "--output-dir", tmp_path / "pkg")
    assert code == 2 and "vision_config" in err and "by hand" in err
    assert not (tmp_path / "pkg").exists()


def test_no_repeated_blocks_is_an_error(tmp_path, capsys, monkeypatch):
    from layerwise.tracing.discovery import DiscoveredBlocks

    monkeypatch.setattr("layerwise.tracing.discovery.discover_blocks", lambda model: DiscoveredBlocks())
    code, _, err = new_patch(capsys, "Qwen2ForCausalLM", "--output-dir", tmp_path / "pkg")
    assert code == 2 and "no repeated blocks to discover" in err and "sequential_targets by hand" in err
    assert not (tmp_path / "pkg").exists()


def test_an_existing_folder_is_kept_without_overwrite(tmp_path, capsys):
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "mine.txt").write_text("keep me")
    code, _, err = new_patch(capsys, "Qwen2ForCausalLM", "--output-dir", folder, "--no-check")
    assert code == 2 and "already exists" in err and "--overwrite" in err
    assert [p.name for p in folder.iterdir()] == ["mine.txt"] and (folder / "mine.txt").read_text() == "keep me"
    code, _, err = new_patch(capsys, "Qwen2ForCausalLM", "--output-dir", folder, "--no-check", "--overwrite")
    assert code == 2 and "was not written by layerwise" in err and "--overwrite-any" in err
    assert (folder / "mine.txt").read_text() == "keep me"
    assert new_patch(capsys, "Qwen2ForCausalLM", "--output-dir", folder, "--no-check", "--overwrite-any")[0] == 0
    assert not (folder / "mine.txt").exists() and (folder / "pyproject.toml").is_file()
    # a package it generated is its own to replace with --overwrite
    assert new_patch(capsys, "Qwen2ForCausalLM", "--output-dir", folder, "--no-check", "--overwrite")[0] == 0


def test_default_folder_and_name_come_from_the_model_type(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, _ = new_patch(capsys, "GPTNeoXForCausalLM", "--no-check")
    assert code == 0 and (tmp_path / "layerwise-gpt-neox" / "src" / "layerwise_gpt_neox").is_dir()
    code, _, _ = new_patch(capsys, "GPTNeoXForCausalLM", "--no-check", "--name", "My-NeoX")
    assert code == 0 and (tmp_path / "layerwise-my-neox" / "src" / "layerwise_my_neox").is_dir()


def test_a_bad_name_is_refused(tmp_path, capsys):
    code, _, err = new_patch(capsys, "Qwen2ForCausalLM", "--output-dir", tmp_path / "pkg", "--name", "9lives")
    assert code == 2 and "--name '9lives'" in err


def test_a_covered_architecture_gets_a_note_and_its_name_is_not_reused(tmp_path, capsys):
    code, _, err = new_patch(capsys, "LlamaForCausalLM", "--output-dir", tmp_path / "pkg", "--no-check")
    assert code == 2 and "model patch named 'llama' is already registered" in err and "--name" in err
    code, out, _ = new_patch(capsys, "LlamaForCausalLM", "--output-dir", tmp_path / "pkg", "--no-check",
                             "--name", "llama_mine")
    assert code == 0
    assert "note: LlamaForCausalLM is already covered by the installed model patch 'llama'" in out
    tests = (tmp_path / "pkg" / "tests" / "test_patch.py").read_text()
    assert "@pytest.mark.xfail(" in tests  # layerwise may pick either of two class-name matches


def test_tiny_configs_shrink_other_spellings_and_keep_token_ids_inside_the_vocabulary():
    from transformers import GPT2Config, Phi3Config

    gpt2 = tiny_config_fields(GPT2Config)
    assert {gpt2[k] for k in ("n_embd", "n_layer", "n_head", "n_positions")} == {64, 2, 4, 256}
    assert gpt2["bos_token_id"] == gpt2["eos_token_id"] == 255  # both were 50256: equal ids stay equal
    phi3 = tiny_config_fields(Phi3Config)
    assert phi3["num_key_value_heads"] == 2 and max(phi3["eos_token_id"], phi3["pad_token_id"]) < 256
