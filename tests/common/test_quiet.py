"""transformers' progress bars inside layerwise's verbs follow ``show_progress`` and the terminal."""

import sys

import pytest
from transformers.utils import logging as hf_logging

from layerwise.common.quiet import (
    bars_wanted,
    library_bars_follow_show_progress,
    library_bars_hidden,
)


@pytest.fixture(autouse=True)
def bars_on_afterwards():
    yield
    hf_logging.enable_progress_bar()


def test_hidden_for_the_block_then_as_they_were():
    hf_logging.enable_progress_bar()
    with library_bars_hidden(True):
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()


def test_never_turned_on_for_a_caller_who_turned_them_off():
    hf_logging.disable_progress_bar()
    with library_bars_hidden(False):
        assert not hf_logging.is_progress_bar_enabled()
    with library_bars_hidden(True):
        pass
    assert not hf_logging.is_progress_bar_enabled()


@pytest.mark.parametrize(("terminal", "show_progress", "wanted"),
                         [(True, True, True), (True, False, False), (False, True, False)])
def test_a_verb_sees_bars_only_when_asked_for_on_a_terminal(monkeypatch, terminal, show_progress, wanted):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    seen = []

    @library_bars_follow_show_progress
    def verb(*, show_progress: bool = True) -> str:
        seen.append(hf_logging.is_progress_bar_enabled())
        return "done"

    hf_logging.enable_progress_bar()
    assert verb(show_progress=show_progress) == "done"
    assert seen == [wanted] and bars_wanted(show_progress) == wanted
    assert hf_logging.is_progress_bar_enabled()  # restored after the call


def test_compress_with_show_progress_off_draws_no_loading_bar(tiny_llama_dir, capfd, monkeypatch):
    import layerwise

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    hf_logging.enable_progress_bar()
    layerwise.compress(str(tiny_llama_dir), "W8A16", show_progress=False)
    assert "Loading weights" not in capfd.readouterr().err
    layerwise.compress(str(tiny_llama_dir), "W8A16")
    assert "Loading weights" in capfd.readouterr().err
