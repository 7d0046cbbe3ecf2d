"""ModuleOffloader: only the current piece's modules sit on the execution device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layerwise.runtime.offload import ModuleOffloader


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(4)


def recording_move(log):
    # "meta" plays the accelerator: moving there and back keeps shapes, logs every transfer
    def move(tensor, device):
        log.append((tuple(tensor.shape), tensor.device.type, device.type))
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    return move


def devices(module):
    return {t.device.type for t in list(module.parameters()) + list(module.buffers())}


def test_onloads_one_target_and_sends_it_home():
    net, log = Net(), []
    weight = net.layers[0].fc.weight
    off = ModuleOffloader(net, "meta", protected=["layers.0", "layers.1"], move=recording_move(log))
    with off.onloaded(["layers.0"]):
        assert devices(net.layers[0]) == {"meta"}
        assert devices(net.layers[1]) == {"cpu"} and devices(net.embed) == {"cpu"}
        net.layers[0].fc.register_buffer("weight_scale", torch.ones(4, 1, device="meta"))  # a modifier adds one
    assert devices(net) == {"cpu"}
    # cpu <-> cuda swaps param.data (identity kept); meta cannot share a tensor type with cpu
    if torch._has_compatible_shallow_copy_type(weight, torch.empty(0, device="meta")):
        assert net.layers[0].fc.weight is weight
    assert net.layers[0].fc.weight_scale.device.type == "cpu"
    assert len(log) == 3 + 4  # weight, bias, buffer out; the same three plus weight_scale back


def test_onloading_the_root_skips_protected_targets():
    net, log = Net(), []
    off = ModuleOffloader(net, "meta", protected=["layers.0", "layers.1"], move=recording_move(log))
    with off.onloaded([""]):
        assert devices(net.embed) == {"meta"} and devices(net.norm) == {"meta"}
        assert devices(net.layers) == {"cpu"}
    assert devices(net) == {"cpu"}


def test_sent_home_on_error():
    net = Net()
    off = ModuleOffloader(net, "meta", move=recording_move([]))
    with pytest.raises(RuntimeError), off.onloaded(["layers.1"]):
        raise RuntimeError("boom")
    assert devices(net) == {"cpu"}


def test_no_transfer_when_already_on_execution_device():
    net, log = Net(), []
    off = ModuleOffloader(net, "cpu", move=recording_move(log))
    assert off.is_noop()
    with off.onloaded([""]):
        pass
    assert log == []


def test_unknown_module_is_an_error():
    with pytest.raises(KeyError, match="no module, parameter or buffer named 'nope'"), \
            ModuleOffloader(Net(), "cpu").onloaded(["nope"]):
        pass


def test_one_buffer_of_a_container_moves_without_its_layers():
    """A piece that reads a container's own buffer (BERT's embeddings.token_type_ids) while its layers run in
    other pieces: the buffer alone goes to the execution device and back."""
    from layerwise.testing import simulated_device

    net = Net()
    net.register_buffer("table", torch.arange(4.0))
    with simulated_device("cuda:0") as gpu:
        offloader = ModuleOffloader(net, "cuda")  # the device with its index, as its tensors report it
        assert offloader.execution_device == torch.device("cuda", 0)
        with offloader.onloaded(["table"]):
            assert net.table.device.type == "cuda" and all(p.device.type == "cpu" for p in net.parameters())
        gpu.check_home(net)
        net.to("cuda")
        assert offloader.is_noop()
        net.to("cpu")


def test_parameter_identity_kept_when_tensor_types_allow():
    from layerwise.runtime.offload import _replace

    lin = nn.Linear(2, 2)
    weight = lin.weight
    _replace(lin._parameters, "weight", weight, torch.zeros(2, 2))  # like cpu <-> cuda
    assert lin.weight is weight and torch.equal(lin.weight, torch.zeros(2, 2))


def test_buffer_identity_kept_when_tensor_types_allow():
    from layerwise.runtime.offload import _replace

    block = Block()
    scale = block.scale
    _replace(block._buffers, "scale", scale, torch.zeros(4))
    assert block.scale is scale and torch.equal(scale, torch.zeros(4))


def test_a_tensor_two_modules_share_goes_home_once_both_let_go():
    """Tied weights: onloading both owners at once (a whole-model pipeline) must not leave the shared tensor
    on the device because the second owner found it there already."""
    from layerwise.testing import simulated_device

    net = Net()
    head = nn.Linear(4, 10, bias=False)
    head.weight = net.embed.weight  # tied, as lm_head and embed_tokens
    net.head = head
    with simulated_device("cuda:0") as gpu:
        with ModuleOffloader(net, "cuda").onloaded([""]):
            assert net.head.weight.device.type == "cuda"
        gpu.check_home(net)
