"""What rests on the execution device: the plan (weights moved once, the cache's budget) and the cache keeping it."""

from __future__ import annotations

import torch

from layerwise.runtime.cache import IntermediatesCache
from layerwise.runtime.placement import DEVICE_MEMORY_FRACTION, plan_placement
from layerwise.testing import simulated_device

OWN_DEVICES = True  # LAYERWISE_TEST_DEVICE=simulated leaves this module's devices to it
GPU = torch.device("cuda", 0)
GIB = 2**30


def test_on_the_cpu_or_a_device_that_cannot_say_nothing_is_planned():
    for plan in (plan_placement(torch.device("cpu"), GIB, GIB, GIB, free_bytes=100 * GIB),
                 plan_placement(GPU, GIB, GIB, GIB, free_bytes=None)):
        assert not plan.weights_moved and plan.cache_budget == 0
    assert "not known" in plan.reason


def test_weights_that_fit_with_a_piece_move_once_and_what_is_left_holds_activations():
    plan = plan_placement(GPU, weight_bytes=10 * GIB, piece_weight_bytes=GIB, working_set=2 * GIB, free_bytes=80 * GIB)
    assert plan.weights_moved
    assert plan.cache_budget == int(80 * GIB * DEVICE_MEMORY_FRACTION) - 10 * GIB - 2 * GIB
    assert plan.reason.startswith("weights moved to cuda:0 once (10.00 GiB)")


def test_weights_that_do_not_fit_are_onloaded_and_the_cache_leaves_room_for_the_largest_piece():
    plan = plan_placement(GPU, weight_bytes=70 * GIB, piece_weight_bytes=GIB, working_set=2 * GIB, free_bytes=80 * GIB)
    assert not plan.weights_moved and plan.cache_budget == int(64 * GIB) - GIB - 2 * GIB
    assert "onloaded piece by piece (70.00 GiB > 80% of 80.00 GiB free" in plan.reason
    assert plan_placement(GPU, 70 * GIB, 40 * GIB, 30 * GIB, free_bytes=80 * GIB).cache_budget == 0
    streamed = plan_placement(GPU, GIB, GIB, GIB, free_bytes=80 * GIB, can_move=False)
    assert not streamed.weights_moved and "streamed" in streamed.reason


def test_the_cache_keeps_values_made_on_the_device_within_its_budget_and_spills_the_rest():
    nbytes = 4 * 16 * 4  # one (4, 16) float32 value
    with simulated_device("cuda:0") as gpu:
        cache = IntermediatesCache("cpu", execution_device="cuda", device_budget=2 * nbytes)
        values = [torch.randn(4, 16, device="cuda") for _ in range(3)]
        for batch, value in enumerate(values):
            cache.put(batch, "h", value)
        assert cache.device_bytes == 2 * nbytes and cache.spilled == 1 and gpu.moves["to cpu"] == 1
        assert cache.get(0, "h") is values[0]  # kept: nothing copied either way
        third = cache.get(2, "h")  # spilled: copied back
        assert third.device == GPU and third is not values[2] and gpu.moves["to device"] == 1
        cache.free(["h"], batch=0)  # its budget is free again
        cache.put(3, "h", values[0])
        assert cache.device_bytes == 2 * nbytes and cache.spilled == 1
        cache.put(4, "ids", torch.ones(2, dtype=torch.long))  # made on the CPU: rests there, as always
        assert cache.device_bytes == 2 * nbytes and gpu.moves["to cpu"] == 1
        assert torch.equal(third.cpu(), values[2].cpu())
        cache.close()


def test_on_the_cpu_the_cache_keeps_no_budget_and_moves_nothing():
    cache = IntermediatesCache("cpu", execution_device="cpu", device_budget=GIB)
    value = torch.randn(3)
    cache.put(0, "h", value)
    assert cache.device_budget == 0 and cache.get(0, "h") is value
