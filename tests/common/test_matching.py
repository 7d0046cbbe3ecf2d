"""Module matching: pairs of layers found beside each other by their parent module."""

from __future__ import annotations

from layerwise.common.matching import paired_by_parent
from tests.conftest import build_tiny_llama


def test_pairs_are_found_by_their_parent_and_a_missing_partner_gives_none():
    model = build_tiny_llama()
    pairs, ups, downs = paired_by_parent(model, "re:.*up_proj$", "re:.*down_proj$")
    assert pairs == [(f"model.layers.{i}.mlp.up_proj", f"model.layers.{i}.mlp.down_proj") for i in range(2)]
    assert len(ups) == len(downs) == 2
    # q_proj sits in self_attn, down_proj in mlp: no pair shares a parent
    assert paired_by_parent(model, "re:.*q_proj$", "re:.*down_proj$")[0] is None
    # a first match left over: layer 1's q_proj has no o_proj asked for beside it
    assert paired_by_parent(model, "re:.*layers\\.\\d\\.self_attn\\.q_proj$", "re:.*layers\\.0\\.self_attn\\.o_proj$")[0] is None


def test_a_regex_that_does_not_compile_is_a_usage_error_naming_the_entry():
    import pytest

    from layerwise.common.matching import PatternError, find_modules
    from layerwise.errors import LayerwiseError

    with pytest.raises(PatternError, match=r"'re:\[' is not a valid regular expression") as raised:
        find_modules(build_tiny_llama(), ["Linear"], ["re:["])
    assert isinstance(raised.value, LayerwiseError)  # the CLI's exit 2 with one line, not "unexpected error"


def test_a_mistyped_entry_is_corrected_to_what_the_model_has():
    from layerwise.common.matching import closest_entries

    names = [name for name, _ in build_tiny_llama().named_modules() if name]
    assert closest_entries("re:.*down_prj", names, n=1) == ["re:.*down_proj"]
    assert closest_entries("re:.*mlp\\.down_prj", names, n=1) == ["re:.*mlp\\.down_proj"]
    assert closest_entries("re:.*self_atn\\.q_proj", names, n=1) == ["re:.*self_attn\\.q_proj"]
    assert closest_entries("model.layers.0.mlp.down_prj", names, n=1) == ["model.layers.0.mlp.down_proj"]
    assert closest_entries("re:.*", names) == []  # no words to correct
    assert closest_entries("re:.*zzzzzz", names) == []
