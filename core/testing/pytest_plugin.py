"""pytest fixtures for plugin authors, loaded by pytest itself (the ``pytest11`` entry point).

A plugin's test suite gets them without importing anything::

    def test_my_modifier_keeps_the_contract(layerwise_check_modifier):
        layerwise_check_modifier(MyModifier, {"strength": 0.5})
"""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture
def layerwise_check_modifier() -> Callable[..., None]:
    """:func:`layerwise.testing.check_modifier`: every step of the modifier contract."""
    from layerwise.testing import check_modifier

    return check_modifier


@pytest.fixture
def layerwise_tiny_llama() -> Callable[..., object]:
    """A factory of seeded 2-layer Llama models built offline (``layerwise_tiny_llama(seed=0)``)."""
    from layerwise.testing import tiny_llama

    return tiny_llama


@pytest.fixture
def layerwise_check_model_patch() -> Callable[..., None]:
    """:func:`layerwise.testing.check_model_patch`: ignore entries, targets, trace and replay, GPTQ, reload."""
    from layerwise.testing import check_model_patch

    return check_model_patch


@pytest.fixture
def layerwise_check_pipeline() -> Callable[..., None]:
    """:func:`layerwise.testing.check_pipeline`: events, every sample, nothing changed, errors propagate."""
    from layerwise.testing import check_pipeline

    return check_pipeline


@pytest.fixture
def layerwise_check_saver() -> Callable[..., None]:
    """:func:`layerwise.testing.check_saver`: writes, refuses, overwrites, all or nothing."""
    from layerwise.testing import check_saver

    return check_saver
