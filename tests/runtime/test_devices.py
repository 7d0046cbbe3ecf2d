"""device=: checked before anything loads; running out of memory is a named error with the fixes."""

from __future__ import annotations

import pytest
import torch

import layerwise
from layerwise import Modifier
from layerwise.errors import InvalidArgumentError
from layerwise.host.recipe import parse_recipe
from layerwise.runtime.devices import CalibrationOutOfMemoryError, resolve_device
from tests.conftest import build_tiny_llama

GPTQ_W4A16_G32 = "GPTQModifier:\n  scheme: W4A16\n  group_size: 32\n"  # groups of 128 > the tiny model's 64
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_devices_a_user_can_name():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None) == (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    with pytest.raises(InvalidArgumentError, match="unknown device 'banana'.*--device"):
        resolve_device("banana")
    with pytest.raises(InvalidArgumentError, match="'cpu' or 'cuda'"):
        resolve_device("meta")


def test_a_gpu_asked_for_where_there_is_none_is_an_error_not_a_cpu_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InvalidArgumentError, match="torch sees no GPU.*--device cpu"):
        resolve_device("cuda")
    with pytest.raises(InvalidArgumentError, match="torch sees no GPU"):
        layerwise.compress(build_tiny_llama(), "W4A16", device="cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(InvalidArgumentError, match="sees 2 GPU.*cuda:0 to cuda:1"):
        resolve_device("cuda:2")


class _RunsOutOfMemory(Modifier):
    """Stands in for a piece that does not fit: the allocator's error, raised mid-calibration."""

    def on_sequential_epoch_end(self, state, modules):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_out_of_memory_in_a_piece_is_named_with_the_fixes_and_nothing_is_saved(tmp_path):
    samples = [{"input_ids": torch.randint(0, 128, (1, 16))} for _ in range(2)]
    with pytest.raises(CalibrationOutOfMemoryError) as caught:
        layerwise.compress(build_tiny_llama(), [_RunsOutOfMemory(), *parse_recipe(GPTQ_W4A16_G32)],
                           dataset=samples, output_dir=tmp_path / "out", show_progress=False)
    message = str(caught.value)
    assert "out of memory on cpu" in message and "Tried to allocate 2.00 GiB" in message
    for fix in ("--max-seq-length", "--num-samples", "--offload disk"):
        assert fix in message
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)  # never a fall-back to another pipeline
    assert not (tmp_path / "out").exists()


@needs_cuda
def test_calibrating_on_the_gpu_gives_the_cpu_result(tmp_path):
    """GPTQ on the GPU (weights onloaded piece by piece, Hessians and solves in fp32) against the CPU run."""
    samples = [{"input_ids": torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(i))}
               for i in range(4)]
    results = {}
    for device in ("cpu", "cuda"):
        model = build_tiny_llama()
        layerwise.compress(model, GPTQ_W4A16_G32, dataset=samples,
                           device=device, show_progress=False)
        assert all(p.device.type == "cpu" for p in model.parameters())  # weights went home after each piece
        results[device] = {n: m.weight.detach().clone() for n, m in model.named_modules()
                           if getattr(m, "quantization_args", None) is not None}
        if device == "cuda":
            assert model.layerwise_report.peak_gpu_bytes > 0
    for name, weight in results["cpu"].items():
        same = (results["cuda"][name] == weight).float().mean().item()
        assert same >= 0.99, f"{name}: only {same:.4f} of the quantized weights equal the CPU run's"


@needs_cuda
def test_streamed_weights_on_the_gpu_write_the_in_memory_gpu_runs_checkpoint(tmp_path):
    from safetensors.torch import load_file

    build_tiny_llama().save_pretrained(tmp_path / "model")
    samples = [{"input_ids": torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(i))}
               for i in range(4)]
    for weights in ("memory", "stream"):
        layerwise.compress(str(tmp_path / "model"), GPTQ_W4A16_G32, dataset=samples, device="cuda", output_dir=tmp_path / weights, show_progress=False, options=layerwise.CompressOptions.of(weights=weights))
    a, b = (load_file(tmp_path / w / "model.safetensors") for w in ("memory", "stream"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
