"""Stacking a block's cached calls into one: what is concatenated, what is shared, what refuses."""

import torch

from layerwise.algorithms.quantization.stacked_calls import same_outputs, signature, stack_calls


def test_batched_tensors_are_concatenated_and_shared_values_passed_once():
    torch.manual_seed(0)
    mask = torch.zeros(1, 1, 4, 4)
    cos = torch.randn(7)  # no batch dimension: must be the same in every call
    calls = [((torch.randn(1, 4, 8),), {"mask": mask.clone(), "rope": (cos, cos + 1), "scale": 0.5, "cache": None}, 1)
             for _ in range(3)]
    args, kwargs = stack_calls(calls)
    assert torch.equal(args[0], torch.cat([c[0][0] for c in calls]))
    assert kwargs["mask"].shape == (3, 1, 4, 4)  # first dimension = the call's rows: batched
    assert kwargs["rope"][0] is calls[0][1]["rope"][0] and torch.equal(kwargs["rope"][1], cos + 1)
    assert kwargs["scale"] == 0.5 and kwargs["cache"] is None


def test_rows_of_different_counts_stack_and_signatures_tell_them_apart():
    first, second = torch.randn(2, 4, 8), torch.randn(3, 4, 8)
    assert signature((first,), {}, 2) == signature((second,), {}, 3)
    assert signature((first,), {}, 2) != signature((torch.randn(2, 5, 8),), {}, 2)
    args, _ = stack_calls([((first,), {}, 2), ((second,), {}, 3)])
    assert torch.equal(args[0], torch.cat([first, second]))


def test_calls_that_differ_in_a_shared_value_do_not_stack():
    x = torch.randn(1, 4, 8)
    assert stack_calls([((x,), {"scale": 0.5}, 1), ((x,), {"scale": 0.25}, 1)]) is None
    assert stack_calls([((x,), {"pos": torch.arange(4)}, 1), ((x,), {"pos": torch.arange(1, 5)}, 1)]) is None
    assert stack_calls([((x,), {"cache": object()}, 1), ((x,), {"cache": object()}, 1)]) is None
    shared = object()
    assert stack_calls([((x,), {"cache": shared}, 1), ((x,), {"cache": shared}, 1)]) is not None


def test_same_outputs_allows_rounding_and_refuses_a_different_result():
    torch.manual_seed(0)
    parts = [torch.randn(1, 4, 8) for _ in range(3)]
    together = torch.cat(parts)
    assert same_outputs(together * (1 + 1e-6), parts)
    assert not same_outputs(together + 0.1 * together.abs().max(), parts)
    assert not same_outputs(together[:2], parts)
    assert not same_outputs(together.mean(0, keepdim=True).expand(3, 4, 8), parts)  # a broadcast gone wrong
