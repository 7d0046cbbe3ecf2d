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
