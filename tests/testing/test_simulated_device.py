"""simulated_device: a second device on the CPU that fails every op mixing devices, as CUDA does."""

from __future__ import annotations

import pytest
import torch

from layerwise.errors import InvalidArgumentError
from layerwise.runtime.devices import free_memory, resolve_device
from layerwise.testing import DeviceMismatchError, simulated_device

OWN_DEVICES = True  # LAYERWISE_TEST_DEVICE=simulated leaves this module's devices to it
GPU = torch.device("cuda", 0)


def test_a_moved_tensor_reports_the_device_and_mixing_it_with_a_cpu_tensor_fails():
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    with simulated_device() as gpu:
        moved = x.to("cuda")
        assert moved.device == GPU and moved.is_cuda and not moved.is_cpu and moved.get_device() == 0
        assert x.device == torch.device("cpu") and gpu.moves["to device"] == 1
        with pytest.raises(DeviceMismatchError, match=r"same device.*linear.*\(4, 3\) on cpu"):
            torch.nn.functional.linear(moved, w)
        out = torch.nn.functional.linear(moved, w.cuda())
        assert out.device == GPU and torch.equal(out.cpu(), torch.nn.functional.linear(x, w))  # the CPU's values
        back = out.cpu()
        assert back.device.type == "cpu" and (back + x[:, :1]).device.type == "cpu"
        assert out.to(x).device.type == "cpu" and x.to(out).device == GPU  # .to(other): other's device
        with pytest.raises(DeviceMismatchError):
            out.numpy()


def test_cpu_scalars_copies_and_cpu_indices_mix_with_device_tensors_as_on_cuda():
    with simulated_device():
        y = torch.arange(6.0).cuda()
        assert (y * torch.tensor(2.0)).device == GPU  # a zero-dimensional CPU tensor is a scalar
        assert y[torch.tensor([0, 2])].device == GPU
        home = torch.zeros(6)
        home.copy_(y)
        assert home.device.type == "cpu" and home[5] == 5
        with pytest.raises(DeviceMismatchError):
            torch.cat([y, home])


def test_factories_and_results_follow_the_device_they_are_given():
    with simulated_device():
        y = torch.ones(3, device="cuda")
        assert y.device == GPU
        assert torch.zeros_like(y).device == GPU and y.new_zeros(2).device == GPU
        assert torch.arange(3, device=y.device).device == GPU
        assert torch.zeros_like(y, device="cpu").device.type == "cpu"
        assert torch.ones(2).pin_memory().device.type == "cpu"
        with pytest.raises(DeviceMismatchError, match="only CPU tensors can be pinned"):
            y.pin_memory()


def test_a_module_moved_in_place_keeps_its_parameters_and_check_home_names_what_stayed():
    layer = torch.nn.Linear(3, 2)
    weight = layer.weight
    with simulated_device() as gpu:
        layer.to("cuda")
        assert layer.weight is weight and weight.device == GPU  # param.data swapped, identity kept
        assert layer(torch.randn(1, 3).cuda()).device == GPU
        with pytest.raises(DeviceMismatchError):
            layer(torch.randn(1, 3))
        with pytest.raises(DeviceMismatchError, match="2 tensor.*weight, bias"):
            gpu.check_home(layer)
        layer.to("cpu")
        gpu.check_home(layer)


def test_the_simulated_device_exists_only_inside_the_block():
    with simulated_device("cuda:0", free_bytes=1 << 30):
        assert resolve_device("cuda") == GPU and resolve_device("cuda:0") == GPU
        assert free_memory(GPU) == 1 << 30
    assert free_memory(torch.device("cpu")) is None
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgumentError, match="torch sees no GPU"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="other than the CPU"), simulated_device("cpu"):
        pass


def test_what_a_simulation_cached_for_the_device_is_never_handed_to_a_later_one():
    """A cache keyed by the device (the Hadamard factors, the FP4 code table) holds a simulation's CPU tensor
    under ``cuda:0``: the next simulation saw a CPU tensor (a QuaRot run after another failed so), and a real
    GPU in the same process would get one."""
    from layerwise.algorithms.quantization.float_formats import fp4_codes
    from layerwise.algorithms.quantization.hadamard import fwht

    x, values = torch.randn(3, 16), torch.tensor([0.5, -6.0, 1.5])
    for _ in range(2):
        with simulated_device() as gpu:
            rotated, codes = fwht(x.cuda()), fp4_codes(values.cuda())
            assert gpu.on_device(rotated) and gpu.on_device(codes)
        assert torch.equal(rotated, fwht(x)) and torch.equal(codes, fp4_codes(values))
