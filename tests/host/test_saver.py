"""The saver contract: savers are plugins compress() and the CLI choose by name, sized and streamed by contract."""

from pathlib import Path

import pytest

import layerwise
from layerwise.cli import main
from layerwise.host.plugin_manager import get_host, registry
from layerwise.host.saver import FunctionSaver, Saver
from layerwise.model_io.streaming.stream import StreamingError
from layerwise.plugin import hookimpl
from layerwise.plugin.saving import atomic_output_dir
from tests.conftest import build_tiny_llama


class ListingSaver(Saver):
    """Writes the names of the compressed weights, one per line; says it takes 7 bytes."""

    def save(self, model, output_dir, *, tokenizer=None, recipe=None, extra_files=None, overwrite=False):
        with atomic_output_dir(output_dir, overwrite) as tmp:
            (tmp / "weights.txt").write_text("\n".join(name for name, _ in model.named_parameters()))
            for relative, content in (extra_files or {}).items():
                (tmp / relative).write_text(content)
        return Path(output_dir)

    def saved_bytes(self, model):
        return 7


def listing_function(model, output_dir, *, tokenizer=None, recipe=None, extra_files=None, overwrite=False):
    with atomic_output_dir(output_dir, overwrite) as tmp:
        (tmp / "function.txt").write_text("written")


class SaverPlugin:
    @hookimpl
    def layerwise_register_savers(self, register):
        register("listing", ListingSaver())
        register("listing-function", listing_function)


@pytest.fixture
def savers(register_plugin):
    register_plugin(SaverPlugin(), "test-savers")


def test_a_function_saver_is_wrapped_in_the_contract_at_registration(savers):
    wrapped = registry("savers").get("listing-function")
    assert isinstance(wrapped, FunctionSaver) and wrapped.function is listing_function
    assert isinstance(registry("savers").get("compressed-tensors"), Saver)


def test_compress_writes_with_the_saver_named_and_reports_its_size(savers, tmp_path):
    model = layerwise.compress(build_tiny_llama(), "W8A16", output_dir=tmp_path / "out", show_progress=False,
                               options=layerwise.CompressOptions.of(save_format="listing"))
    assert "model.layers.0.self_attn.q_proj.weight" in (tmp_path / "out" / "weights.txt").read_text()
    assert (tmp_path / "out" / "layerwise_summary.json").is_file()
    assert model.layerwise_report.bytes_after == 7


def test_the_cli_chooses_a_plugin_saver_with_save_format(savers, tiny_llama_dir, tmp_path, capsys):
    assert main(["compress", "--model", str(tiny_llama_dir), "--recipe", "W8A16", "--save-format",
                 "listing-function", "--output-dir", str(tmp_path / "out"), "--quiet"]) == 0
    assert (tmp_path / "out" / "function.txt").read_text() == "written"
    assert main(["compress", "--model", str(tiny_llama_dir), "--recipe", "W8A16", "--save-format", "lsting",
                 "--output-dir", str(tmp_path / "out2"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "'lsting'" in err and "listing" in err and "compressed-tensors" in err
    assert not (tmp_path / "out2").exists()


def test_a_streamed_run_with_a_saver_that_cannot_stream_is_refused_before_loading(savers, tiny_llama_dir, tmp_path):
    with pytest.raises(StreamingError, match="'listing' cannot write a run whose weights stream"):
        layerwise.compress(str(tiny_llama_dir), "W8A16", output_dir=tmp_path / "out", show_progress=False,
                           options=layerwise.CompressOptions.of(save_format="listing", weights="stream"))
    assert not (tmp_path / "out").exists()


def test_registering_something_that_is_no_saver_marks_the_plugin_broken(register_plugin):
    class Bad:
        @hookimpl
        def layerwise_register_savers(self, register):
            register("bad", 42)

    register_plugin(Bad(), "bad-saver")
    with pytest.warns(RuntimeWarning, match="bad-saver"):
        assert "bad" not in registry("savers").names()
    assert "takes a Saver" in get_host().plugins["bad-saver"].broken
