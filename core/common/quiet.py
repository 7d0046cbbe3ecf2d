"""Library chatter off while layerwise runs a check that saves and reloads models.

transformers and compressed-tensors draw progress bars and loading reports on stderr; around
the plugin kit they would bury its one-line results. Everything else written to stderr
(warnings) is passed on when ``bars_only`` (the default).
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from collections.abc import Iterator

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
