"""Old module paths still import, as the very module at its new place, with a warning naming it."""

import importlib
import sys

import pytest

from layerwise.common.moved_modules import MOVED, new_name


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_old_path_imports_the_module_at_its_new_place(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_a_module_inside_a_moved_package_is_one_module_not_two():
    for name in ("layerwise.quantization", "layerwise.quantization.qmath"):
        sys.modules.pop(name, None)
    with pytest.warns(DeprecationWarning):
        old = importlib.import_module("layerwise.quantization.qmath")
    assert old is importlib.import_module("layerwise.algorithms.quantization.qmath")
    assert new_name("layerwise.streaming.stream") == "layerwise.model_io.streaming.stream"
    assert new_name("layerwise.tracing.api") is None  # tracing stayed where it was
