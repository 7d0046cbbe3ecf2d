"""The plain module walk lists what ``named_modules`` / ``parameters`` list, in their order; a cached walk is one
walk, and only inside its block."""

import torch
from torch import nn

from layerwise.common.module_walk import all_parameters, walk_modules, walks_cached


def _model_with_sharing() -> nn.Module:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(
        nn.Linear(4, 4),
        nn.Sequential(shared, nn.ReLU(), nn.ModuleList([nn.Linear(4, 4), shared])),
        nn.ModuleDict({"a": nn.LayerNorm(4), "b": shared}),
    )
    model.head = nn.Linear(4, 4)
    model.head.weight = model[0].weight  # tied
    model.register_module("missing", None)
    return model


def test_the_walk_lists_named_modules_in_their_order_each_module_once():
    model = _model_with_sharing()
    assert [(n, id(m)) for n, m in walk_modules(model)] == [(n, id(m)) for n, m in model.named_modules()]


def test_all_parameters_are_the_models_parameters_tied_ones_once():
    model = _model_with_sharing()
    assert [id(p) for p in all_parameters(model)] == [id(p) for p in model.parameters()]


def test_a_cached_walk_is_made_once_and_forgotten_after_its_block():
    model = _model_with_sharing()
    with walks_cached(model):
        first = walk_modules(model)
        model.extra = nn.Linear(4, 4)  # a change inside the block is not seen: the block promises none
        assert walk_modules(model) is first and "extra" not in dict(first)
        other = nn.Linear(2, 2)
        assert walk_modules(other) is not walk_modules(other)  # other roots are walked as usual
    assert "extra" in dict(walk_modules(model))
