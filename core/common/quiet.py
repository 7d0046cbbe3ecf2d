"""Library chatter off while layerwise runs a check that saves and reloads models.

transformers and compressed-tensors draw progress bars and loading reports on stderr; around
the plugin kit they would bury its one-line results. Everything else written to stderr
(warnings) is passed on when ``bars_only`` (the default).
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: a tqdm bar's text (``Compressing model: 100%|####| 14/14 [00:00<00:00, ...]``)
_BAR = re.compile(r"\|\s*\d+/\d+ \[")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' logging at error level only (config warnings, loading reports)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def bars_wanted(show_progress: bool) -> bool:
    """Progress bars only when asked for and stderr is a terminal: redirected to a log, every redraw of a
    bar is a line of its own."""
    return show_progress and sys.stderr.isatty()


def command_line_bars(show_progress: bool) -> None:
    """For a command-line process (it ends with the command): transformers' bars off for good unless wanted
    (:func:`bars_wanted`), including the loads made outside layerwise's own verbs."""
    if not bars_wanted(show_progress):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


@contextlib.contextmanager
def library_bars_hidden(hidden: bool) -> Iterator[None]:
    """transformers' progress bars (loading weights, writing shards) off for the block when ``hidden``, then
    as they were: layerwise's own bars follow ``show_progress``, and so should the ones drawn inside its calls
    (never turned on here: a caller who switched them off keeps them off)."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled()
    if hidden:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if hidden and before:
            hf_logging.enable_progress_bar()


def library_bars_follow_show_progress(function: F) -> F:
    """Decorates a verb taking a keyword-only ``show_progress``: transformers' bars inside the call are hidden
    where layerwise's own are (not asked for, or stderr not a terminal)."""
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with library_bars_hidden(not bars_wanted(kwargs.get("show_progress", True))):
            return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def without_progress_bars(bars_only: bool = True) -> Iterator[None]:
    """No progress bars (transformers' or any tqdm on stderr) and transformers at error level; other
    stderr lines are written out afterwards unless ``bars_only`` is False."""
    from transformers.utils import logging as hf_logging

    bars, captured = hf_logging.is_progress_bar_enabled(), io.StringIO()
    hf_logging.disable_progress_bar()
    try:
        with quiet_transformers(), contextlib.redirect_stderr(captured):
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        kept = [line for line in captured.getvalue().splitlines() if line.strip() and not _BAR.search(line)]
        if kept and bars_only:
            print("\n".join(kept), file=sys.stderr)
