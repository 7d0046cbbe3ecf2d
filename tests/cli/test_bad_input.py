"""Bad input, as a new user types it: every case is one clear error, exit status 2, nothing on disk.

Each case runs the real command line (``layerwise.cli.app.main``) on a tiny saved model, and
checks that the message names the thing that is wrong and the fix, that no traceback
reaches the user, and that the output folder was not created. GUIDE.md's troubleshooting
table lists the same cases; keep the two together.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import layerwise
from layerwise.cli import main
from layerwise.errors import DatasetError, InvalidArgumentError, ModelLoadError, RecipeError
from layerwise.host.pipeline import PipelineFailed
from layerwise.model_io import saving
from layerwise.verbs import compression
from tests.conftest import build_tiny_llama, make_word_tokenizer

TEXT = "\n".join(" ".join(f"w{(7 * line + i) % 120}" for i in range(24)) for line in range(12))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """One tiny saved Llama for the module; cases that break it work on a copy."""
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    model = build_tiny_llama()
    model.save_pretrained(folder)
    make_word_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


def run_cli(argv: list[str]) -> int:
    """``main``'s exit status, also when argparse exits (a bad flag value)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


# -- ways to break a model folder (each returns the broken copy) --------------------------------------
def _copy(model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model_dir, tmp_path / "model"))


def truncated_safetensors(model_dir: Path, tmp_path: Path) -> Path:
    folder = _copy(model_dir, tmp_path)
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # an interrupted download
    return folder


def corrupt_safetensors_header(model_dir: Path, tmp_path: Path) -> Path:
    folder = _copy(model_dir, tmp_path)
    with open(folder / "model.safetensors", "r+b") as f:
        f.write(b"\xff" * 8)
    return folder


class _RunsCode:
    """A pickle that runs a shell command when loaded; the test checks it never ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def malicious_pickle(model_dir: Path, tmp_path: Path) -> Path:
    folder = _copy(model_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": _RunsCode(tmp_path / "RAN")}, folder / "pytorch_model.bin")
    return folder


def garbage_pickle(model_dir: Path, tmp_path: Path) -> Path:
    folder = _copy(model_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(bytes(300))
    return folder


def remote_code(model_dir: Path, tmp_path: Path) -> Path:
    folder = _copy(model_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="my-llama", architectures=["MyLlamaForCausalLM"],
                  auto_map={"AutoConfig": "configuration_my.MyConfig",
                            "AutoModelForCausalLM": "modeling_my.MyLlamaForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    for module in ("configuration_my.py", "modeling_my.py"):
        (folder / module).write_text(f"from pathlib import Path\nPath({str(tmp_path / 'RAN')!r}).touch()\n")
    return folder


def unknown_model_type(model_dir: Path, tmp_path: Path) -> Path:
    folder = _copy(model_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="llama9", architectures=["Llama9ForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def config_not_json(model_dir: Path, tmp_path: Path) -> Path:
    folder = _copy(model_dir, tmp_path)
    config = folder / "config.json"
    config.write_text(config.read_text()[:300])  # cut short, as `head -c 300` leaves it
    return folder


def nan_weight(model_dir: Path, tmp_path: Path) -> Path:
    from safetensors.torch import load_file, save_file

    folder = _copy(model_dir, tmp_path)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _file(name: str, content: str | bytes) -> Callable[[Path], str]:
    def write(tmp_path: Path) -> str:
        path = tmp_path / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        return str(path)
    return write


STAGED_TYPO = """\
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      scheme: W8A16
      ignore: [lm_head]
    GPTQmodifier:
      scheme: W4A16
"""
BINARY = b"w1 w2 w3\n" + bytes(range(256))
LLMC_FP6 = """\
QuantizationModifier:
  ignore: [lm_head]
  config_groups:
    group_0:
      targets: [Linear]
      weights: {num_bits: 6, type: float, strategy: group, group_size: 32}
"""
CHAT = json.dumps({"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]}) + "\n"

#: (case, model folder breaker or None, flags after --model/--output-dir, fragments the error must hold);
#: "{...}" in a flag is a file written into tmp_path first
CASES = [
    # -- refused with a traceback before this battery: now one named error each
    ("staged recipe with a misspelt modifier", None,
     ["--recipe", _file("recipe.yaml", STAGED_TYPO), "--dataset", _file("calib.txt", TEXT)],
     ["unknown modifier 'GPTQmodifier'", "did you mean 'GPTQModifier'?",
      "recipe.quant_stage.quant_modifiers.GPTQmodifier"]),
    ("--max-seq-length 0", None, ["--recipe", "GPTQ_W8A16", "--max-seq-length", "0"],
     ["argument --max-seq-length", "must be 1 or more, got 0"]),
    ("--max-seq-length -5", None, ["--recipe", "GPTQ_W8A16", "--max-seq-length", "-5"],
     ["argument --max-seq-length", "must be 1 or more, got -5"]),
    ("--num-samples 0", None, ["--recipe", "GPTQ_W8A16", "--num-samples", "0"],
     ["argument --num-samples", "must be 1 or more, got 0"]),
    ("--num-samples -3", None, ["--recipe", "GPTQ_W8A16", "--num-samples", "-3"],
     ["argument --num-samples", "must be 1 or more, got -3"]),
    ("--targets-per-subgraph 0", None, ["--recipe", "GPTQ_W8A16", "--targets-per-subgraph", "0"],
     ["argument --targets-per-subgraph", "must be 1 or more, got 0"]),
    ("binary dataset file", None, ["--recipe", "GPTQ_W8A16", "--dataset", _file("calib.txt", BINARY)],
     ["calib.txt' is not UTF-8 text", "byte 0x80 at offset 137", "a .txt file", ".jsonl"]),
    ("truncated model.safetensors", truncated_safetensors, ["--recipe", "W8A16"],
     ["model.safetensors' is truncated or corrupt", "download it again", "save_pretrained"]),
    ("corrupt model.safetensors header", corrupt_safetensors_header, ["--recipe", "W8A16"],
     ["model.safetensors' is truncated or corrupt", "header"]),
    ("pickle that runs code", malicious_pickle, ["--recipe", "W8A16"],
     ["refused to load", "pytorch_model.bin", "asks to call", "system", "weights-only",
      "never runs code", "convert it to safetensors"]),
    ("config.json that is not JSON", config_not_json, ["--recipe", "W8A16"],
     ["config.json' is not valid JSON (", "repair it, or copy or download the model's config.json again"]),
    ("corrupt pytorch_model.bin", garbage_pickle, ["--recipe", "W8A16"],
     ["pytorch_model.bin' is truncated or corrupt"]),
    ("config that needs trust_remote_code", remote_code, ["--recipe", "W8A16"],
     ["refused to load", "modeling_my.MyLlamaForCausalLM", "trust_remote_code off on purpose",
      "load_model(path, trust_remote_code=True)", "layerwise.compress()"]),
    ("unknown model_type", unknown_model_type, ["--recipe", "W8A16"],
     ["model_type 'llama9'", "does not know", "load the model yourself"]),
    ("weight holding NaN", nan_weight, ["--recipe", "W8A16"],
     ["1 parameter(s) holding NaN or inf: 'model.layers.0.self_attn.q_proj.weight'", "--skip-non-finite"]),
    # -- clear before this battery; kept here so they stay so
    ("unknown modifier as the recipe", None, ["--recipe", "FooModifier"],
     ["unknown recipe 'FooModifier'", "GPTQModifier", "a YAML file"]),
    ("unknown preset", None, ["--recipe", "W5A16"],
     ["unknown recipe 'W5A16'", "did you mean 'W2A16' or 'W3A16' or 'W4A16' or 'W8A16'?"]),
    ("unknown scheme in YAML", None, ["--recipe", "QuantizationModifier: {scheme: W5A16}"],
     ["unknown scheme 'W5A16'", "valid schemes: FP8, FP8_BLOCK, FP8_DYNAMIC, INT8, MXFP4, MXFP4A16, MXFP8, MXFP8A16, NVFP4"]),
    ("unknown modifier field", None,
     ["--recipe", _file("recipe.yaml", "GPTQModifier:\n  blocksize: 64\n"), "--dataset", _file("c.txt", TEXT)],
     ["'blocksize' (did you mean 'block_size'?)", "valid fields:"]),
    ("recipe that is not YAML", None, ["--recipe", _file("recipe.yaml", "GPTQModifier:\n  scheme: [W4A16\n")],
     ["recipe.yaml' is not valid YAML"]),
    ("missing recipe file", None, ["--recipe", "gptq.yaml"], ["recipe file 'gptq.yaml' does not exist"]),
    ("missing model folder", None, ["--model", "./no/such/model", "--recipe", "W8A16"],
     ["model folder './no/such/model' does not exist"]),
    ("folder without config.json", None, ["--model", ".", "--recipe", "W8A16"],
     ["has no config.json", "save_pretrained"]),
    ("GPTQ without a dataset", None, ["--recipe", "GPTQ_W8A16"],
     ["GPTQModifier needs calibration data", ".txt/.jsonl"]),
    ("empty dataset", None, ["--recipe", "GPTQ_W8A16", "--dataset", _file("calib.txt", "")],
     ["calib.txt' is empty", "give it some text"]),
    ("missing dataset file", None, ["--recipe", "GPTQ_W8A16", "--dataset", "calib.txt"],
     ["calibration file 'calib.txt' does not exist"]),
    ("dataset of an unknown kind", None, ["--recipe", "GPTQ_W8A16", "--dataset", _file("calib.csv", TEXT)],
     ["no dataset loader understands", "calib.csv", ".txt/.jsonl file"]),
    ("JSONL with a broken line", None,
     ["--recipe", "GPTQ_W8A16", "--dataset", _file("calib.jsonl", '{"text": "w1 w2"\n')],
     ["calib.jsonl:1 is not valid JSON"]),
    ("sequential target that matches nothing", None, ["--recipe", "W8A16", "--targets", "LlamaDecodrLayer"],
     ["sequential target 'LlamaDecodrLayer' matches no module", "did you mean 'LlamaDecoderLayer'"]),
    ("ignore entry that matches nothing", None, ["--recipe", "W8A16", "--ignore", "lm_haed"],
     ["ignore entry 'lm_haed' matches no module", "did you mean 'lm_head'?"]),
    ("regex ignore entry with a typo", None, ["--recipe", "W8A16", "--ignore", "re:.*down_prj"],
     ["ignore entry 're:.*down_prj' matches no module", "did you mean 're:.*down_proj'"]),
    ("ignore entry that is no regular expression", None, ["--recipe", "W8A16", "--ignore", "re:["],
     ["'re:[' is not a valid regular expression", "matched in full against qualified module names"]),
    ("model-free ignore entry with a typo", None, ["--recipe", "W8A16", "--model-free", "--ignore", "re:.*down_prj"],
     ["ignore entry 're:.*down_prj' matches no layer", "did you mean 're:.*down_proj'"]),
    ("model-free with sequential targets", None, ["--recipe", "W8A16", "--model-free", "--targets", "LlamaDecoderLayer"],
     ["sequential targets ['LlamaDecoderLayer'] (--targets)", "model-free run builds no model"]),
    ("pipeline that runs no data for a recipe that needs it", None,
     ["--recipe", "GPTQ_W8A16", "--dataset", _file("c.txt", TEXT), "--pipeline", "datafree"],
     ["pipeline 'datafree' runs no calibration data, and GPTQModifier needs it", "drop --pipeline"]),
    ("ignore entries that leave nothing to compress", None, ["--recipe", "W8A16", "--ignore", "re:.*_proj$"],
     ["every layer its targets ['Linear'] select is ignored", "drop or narrow an ignore entry"]),
    ("missing --eval file", None, ["--recipe", "W8A16", "--eval", "heldout.txt"],
     ["evaluation file 'heldout.txt' does not exist"]),
    ("unknown pipeline", None, ["--recipe", "GPTQ_W8A16", "--dataset", _file("c.txt", TEXT), "--pipeline", "fast"],
     ["unknown pipeline 'fast'", "valid pipelines: basic"]),
    ("group size that does not divide the layer", None,
     ["--recipe", "GPTQ_W4A16", "--dataset", _file("c.txt", TEXT), "--num-samples", "2", "--max-seq-length", "8"],
     ["group_size 128 does not divide in_features 64", "strategy: channel"]),
    ("unknown --offload", None, ["--recipe", "W8A16", "--offload", "gpu"],
     ["argument --offload: invalid choice: 'gpu'"]),
    # -- coming from llm-compressor
    ("config group layerwise cannot express", None,
     ["--recipe", _file("recipe.yaml", LLMC_FP6), "--dataset", _file("c.txt", TEXT)],
     ["recipe.QuantizationModifier.config_groups.group_0.weights: type float with num_bits 6",
      "num_bits 8 (FP8 E4M3) or 4 (FP4 E2M1"]),
    ("llm-compressor field with a layerwise equivalent", None,
     ["--recipe", _file("recipe.yaml", "GPTQModifier:\n  scheme: W8A16\n  sequential_targets: [LlamaDecoderLayer]\n"),
      "--dataset", _file("c.txt", TEXT)],
     ["recipe.GPTQModifier.sequential_targets: an llm-compressor field layerwise does not take", "(CLI: --targets)"]),
    ("chat rows and a tokenizer without a chat template", None,
     ["--recipe", "GPTQ_W8A16", "--dataset", _file("chat.jsonl", CHAT)],
     ["holds chat rows (messages) but the tokenizer", "no chat template", "--chat-template off"]),
    ("--chat-template on with text rows", None,
     ["--recipe", "GPTQ_W8A16", "--dataset", _file("c.txt", TEXT), "--chat-template", "on"],
     ["chat_template='on' (CLI: --chat-template on) but", "holds no chat rows"]),
    ("unknown --chat-template", None, ["--recipe", "W8A16", "--chat-template", "yes"],
     ["argument --chat-template: invalid choice: 'yes'"]),
]


def _argv(model: Path, out: Path, flags: list, tmp_path: Path) -> list[str]:
    given = [flag(tmp_path) if callable(flag) else flag for flag in flags]
    head = [] if "--model" in given else ["--model", str(model)]
    return ["compress", *head, *given, "--output-dir", str(out), "--quiet"]


@pytest.mark.parametrize(("breaker", "flags", "fragments"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_named_error_and_leaves_nothing(breaker, flags, fragments, model_dir, tmp_path, capsys,
                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = breaker(model_dir, tmp_path) if breaker else model_dir
    out = tmp_path / "outputs" / "out"
    assert run_cli(_argv(model, out, flags, tmp_path)) == 2
    captured = capsys.readouterr()
    for fragment in fragments:
        assert fragment in captured.err
    assert "Traceback" not in captured.err and "Do you wish to run the custom code" not in captured.out
    assert not (tmp_path / "outputs").exists()  # neither the folder nor a half-written one beside it
    assert not (tmp_path / "RAN").exists()  # no code from the model folder ran


def test_an_existing_output_folder_is_kept_as_it_was(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert run_cli(["compress", "--model", str(model_dir), "--recipe", "W8A16", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already exists and is not empty" in err and "--overwrite" in err
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("where", ["under a file", "read-only"])
def test_an_unwritable_output_is_refused_before_loading(where, model_dir, tmp_path, capsys, monkeypatch):
    parent = tmp_path / "parent"
    if where == "under a file":
        parent.write_text("a file")
    else:
        parent.mkdir()
        real = saving.tempfile.mkdtemp

        def read_only(*args, dir=None, **kwargs):  # root writes through chmod; refuse like a read-only mount
            if Path(dir) == parent:
                raise OSError(30, "Read-only file system")
            return real(*args, dir=dir, **kwargs)

        monkeypatch.setattr(saving.tempfile, "mkdtemp", read_only)
    monkeypatch.setattr(compression, "load_model", _never)
    assert run_cli(["compress", "--model", str(model_dir), "--recipe", "W8A16",
                    "--output-dir", str(parent / "out")]) == 2
    err = capsys.readouterr().err
    expected = "is a file, not a folder" if where == "under a file" else "is not writable (Read-only file system)"
    assert f"'{parent}' {expected}" in err and "choose" in err and "Traceback" not in err
    assert not (parent / "out").exists() and (not parent.is_dir() or list(parent.iterdir()) == [])


def test_an_output_another_run_is_writing_is_refused_before_loading(model_dir, tmp_path, capsys, monkeypatch):
    from layerwise.model_io.output_lock import LOCK_FILE

    other = tmp_path / ".out.incomplete-other"
    other.mkdir()
    (other / LOCK_FILE).write_text(f"{os.getpid()}\n")  # a live owner that is not this run
    monkeypatch.setattr(compression, "load_model", _never)
    assert run_cli(["compress", "--model", str(model_dir), "--recipe", "W8A16", "--quiet",
                    "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"'{tmp_path / 'out'}' is being written by another run (process {os.getpid()}" in err
    assert "choose another output_dir" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name]


def test_compress_model_without_output_dir_is_an_error_unless_no_save(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["compress", "--model", str(model_dir), "--recipe", "W8A16", "--quiet"]
    monkeypatch.setattr(compression, "load_model", _never)
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert "nowhere to save" in err and "--output-dir" in err and "--no-save" in err
    assert run_cli([*argv, "--no-save", "--output-dir", "out"]) == 2  # one or the other
    assert "not allowed with argument" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert run_cli([*argv, "--no-save"]) == 0
    assert "modules compressed:" in capsys.readouterr().out and list(tmp_path.iterdir()) == []


def _never(*args, **kwargs):
    raise AssertionError("the model was loaded before the output location was checked")


def test_debug_shows_the_traceback_before_the_error(model_dir, tmp_path, capsys):
    argv = ["compress", "--model", str(model_dir), "--recipe", "W5A16", "--output-dir", str(tmp_path / "out")]
    for spelled in (["--debug", *argv], [*argv, "--debug"]):
        assert run_cli(spelled) == 2
        err = capsys.readouterr().err
        assert err.index("Traceback (most recent call last)") < err.index("layerwise: error: unknown recipe 'W5A16'")


def test_an_unexpected_error_is_one_line_that_says_how_to_see_more(model_dir, tmp_path, capsys, monkeypatch):
    def bug(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(compression, "load_model", bug)
    argv = ["compress", "--model", str(model_dir), "--recipe", "W8A16", "--no-save"]
    assert run_cli(argv) == 1
    err = capsys.readouterr().err
    assert "layerwise: error: unexpected ZeroDivisionError: division by zero" in err and "--debug" in err
    assert "Traceback" not in err
    assert run_cli([*argv, "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err


# -- the Python API: the same errors, as LayerwiseError subclasses, the library's error chained ---------
@pytest.mark.parametrize(("breaker", "error"), [
    (truncated_safetensors, ModelLoadError), (corrupt_safetensors_header, ModelLoadError),
    (malicious_pickle, ModelLoadError), (garbage_pickle, ModelLoadError), (remote_code, ModelLoadError),
    (unknown_model_type, ModelLoadError),
])
def test_compress_raises_model_load_errors_with_the_cause_chained(breaker, error, model_dir, tmp_path):
    with pytest.raises(error) as info:
        layerwise.compress(breaker(model_dir, tmp_path), "W8A16", output_dir=tmp_path / "out", show_progress=False)
    assert info.value.__cause__ is not None and not isinstance(info.value.__cause__, ModelLoadError)
    assert not (tmp_path / "out").exists() and not (tmp_path / "RAN").exists()


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"max_seq_length": 0}, InvalidArgumentError, "max_seq_length (CLI: --max-seq-length) must be an integer >= 1"),
    ({"num_calibration_samples": -1}, InvalidArgumentError, "num_calibration_samples (CLI: --num-samples)"),
    ({"targets_per_subgraph": 0}, InvalidArgumentError, "targets_per_subgraph"),
    ({"recipe": {"stage": {"GPTQmodifier": {"scheme": "W4A16"}}}}, RecipeError, "did you mean 'GPTQModifier'?"),
    ({"recipe": "W5A16"}, RecipeError, "unknown recipe 'W5A16'"),
    ({"dataset": "binary.txt"}, DatasetError, "is not UTF-8 text"),
])
def test_compress_refuses_bad_arguments_before_loading(kwargs, error, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "binary.txt").write_bytes(BINARY)
    monkeypatch.setattr(compression, "load_model", _never)
    (tmp_path / "any-model").mkdir()
    (tmp_path / "any-model" / "config.json").write_text("{}")  # a folder, never loaded
    arguments = {"recipe": "GPTQ_W8A16", "dataset": ["w1 w2"], **kwargs}
    settings = {name: arguments.pop(name) for name in list(arguments) if name == "targets_per_subgraph"}
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        layerwise.compress("any-model", **arguments, output_dir=tmp_path / "out",
                           options=layerwise.CompressOptions.of(**settings))
    assert not (tmp_path / "out").exists()


def test_a_pipeline_asked_for_by_name_that_cannot_run_says_how_to_let_layerwise_choose():
    from tests.host.test_pipeline_selection import Untraceable

    with pytest.raises(PipelineFailed) as info:
        layerwise.compress(Untraceable().eval(), "GPTQ_W8A16", dataset=[{"input_ids": [[1, 2, 3, 4]]}], show_progress=False, options=layerwise.CompressOptions.of(pipeline="sequential"))
    message = str(info.value)
    assert "pipeline 'sequential', asked for by name, cannot calibrate Untraceable" in message
    assert "Leave out pipeline= (CLI: --pipeline)" in message and info.value.__cause__ is not None


def test_the_guide_troubleshooting_table_lists_every_case():
    guide = (Path(__file__).resolve().parents[2] / "GUIDE.md").read_text()
    section = guide.split("## 10. Troubleshooting")[1].split("\n## ")[0]
    rows = [line.split(" | ")[0].replace("`", "") for line in section.splitlines() if line.startswith("| ")]
    missing = [name for name, *_ in CASES if not any(name in row for row in rows)]
    assert not missing, f"GUIDE.md section 10 has no row for: {missing}"


@pytest.mark.parametrize("breaker", [truncated_safetensors, corrupt_safetensors_header])
def test_layerwise_trace_names_a_corrupt_model_like_compress(breaker, model_dir, tmp_path, capsys):
    folder = breaker(model_dir, tmp_path)
    assert run_cli(["trace", "--model", str(folder), "--verify"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors' is truncated or corrupt" in err and "Traceback" not in err


@pytest.mark.parametrize("command", [["plan"], ["trace"], ["compress", "--no-save"]])
def test_a_config_that_is_not_json_is_the_same_named_error_for_plan_trace_and_compress(command, model_dir, tmp_path,
                                                                                        capsys):
    folder = config_not_json(model_dir, tmp_path)
    assert run_cli([command[0], "--model", str(folder), *command[1:]]) == 2
    err = capsys.readouterr().err
    assert f"layerwise: error: cannot load model '{folder}': its config file '{folder / 'config.json'}' is not valid " \
           f"JSON (" in err
    assert "unexpected" not in err and "Traceback" not in err


def _cli_in_a_process(argv: list[str], stdin: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "layerwise.cli.app", *argv], input=stdin, capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def test_remote_code_never_runs_even_with_yes_on_standard_input(model_dir, tmp_path):
    """A pipeline or CI job answering 'y' to transformers' prompt must not run the folder's code."""
    folder = remote_code(model_dir, tmp_path)
    out = tmp_path / "out"
    done = _cli_in_a_process(["compress", "--model", str(folder), "--recipe", "W8A16", "--output-dir", str(out),
                              "--quiet"], "y\ny\ny\n", tmp_path)
    assert done.returncode == 2, done.stderr
    assert "trust_remote_code off on purpose" in done.stderr and "--trust-remote-code" in done.stderr
    assert "Do you wish to run the custom code" not in done.stdout + done.stderr
    assert not (tmp_path / "RAN").exists() and not out.exists()


def test_trust_remote_code_is_the_users_explicit_choice(model_dir, tmp_path):
    folder = remote_code(model_dir, tmp_path)
    _cli_in_a_process(["compress", "--model", str(folder), "--recipe", "W8A16", "--no-save", "--quiet",
                       "--trust-remote-code"], "", tmp_path)
    assert (tmp_path / "RAN").exists()  # asked for by name: transformers ran the folder's code
