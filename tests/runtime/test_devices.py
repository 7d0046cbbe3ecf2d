"""device=: checked before anything loads; the same cut and result on every device; out of memory is named.

Without a GPU, :func:`layerwise.testing.simulated_device` stands in for one: a tensor left on the
CPU while the pipeline calibrates on the (simulated) GPU fails the run as it would on CUDA.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import layerwise
from layerwise import Modifier
from layerwise.errors import InvalidArgumentError
from layerwise.host.recipe import parse_recipe
from layerwise.runtime.devices import (
    CalibrationOutOfMemoryError,
    DeviceErrorWarning,
    canonical,
    is_device_error,
    resolve_device,
)
from layerwise.testing import simulated_device
from tests.conftest import build_tiny_llama

OWN_DEVICES = True  # LAYERWISE_TEST_DEVICE=simulated leaves this module's devices to it
GPTQ_W4A16_G32 = "GPTQModifier:\n  scheme: W4A16\n  group_size: 32\n"  # groups of 128 > the tiny model's 64
#: calibrated input scales: every later layer calibrates on quantized activations
FP8_STATIC = "QuantizationModifier:\n  scheme: FP8\n  ignore: [lm_head]\n"
#: 8 steps on the 4 samples: every block keeps its tuned rounding (one kept round-to-nearest would equal the
#: CPU's whatever the steps computed on the device)
AUTOROUND = "AutoRoundModifier:\n  scheme: W4A16\n  group_size: 32\n  iters: 8\n  batch_size: 4\n"
#: QUAROT_GPTQ_W4A4's chain in groups of 32: rotated weights, online Hadamards on down_proj's inputs, 4-bit inputs
QUAROT_W4A4_G32 = "RotationModifier:\n  online: true\nGPTQModifier:\n  scheme: W4A4\n  group_size: 32\n"
#: (name, recipe, the cuts it runs at): AutoRound tunes each block against its own outputs, never at layers
FAMILIES = [("gptq", GPTQ_W4A16_G32, ("layers", "blocks")), ("fp8-static", FP8_STATIC, ("layers", "blocks")),
            ("autoround", AUTOROUND, ("blocks",)), ("quarot-w4a4", QUAROT_W4A4_G32, ("layers", "blocks"))]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
#: what a CUDA kernel says when it gets a CPU weight (the layer cut's failure on an H100)
CUDA_DEVICE_ERROR = ("Expected all tensors to be on the same device, but got mat2 is on cpu, different from other "
                     "tensors on cuda:0 (when checking argument in method wrapper_CUDA_mm)")


def _samples(count: int = 4, length: int = 32) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(i))}
            for i in range(count)]


def test_devices_a_user_can_name():
    assert resolve_device("cpu") == torch.device("cpu")
    gpu = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    assert resolve_device(None) == (gpu or torch.device("cpu"))  # a GPU with its index: what its tensors say
    assert canonical("cpu") == torch.device("cpu") and canonical(None) is None
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
    """On the default device: the CPU here, the GPU where there is one (the message names the one used)."""
    samples = [{"input_ids": torch.randint(0, 128, (1, 16))} for _ in range(2)]
    with pytest.raises(CalibrationOutOfMemoryError) as caught:
        layerwise.compress(build_tiny_llama(), [_RunsOutOfMemory(), *parse_recipe(GPTQ_W4A16_G32)],
                           dataset=samples, output_dir=tmp_path / "out", show_progress=False)
    message = str(caught.value)
    assert f"out of memory on {resolve_device(None)} " in message and "Tried to allocate 2.00 GiB" in message
    for fix in ("--max-seq-length", "--num-samples", "--offload disk"):
        assert fix in message
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)  # never a fall-back to another pipeline
    assert not (tmp_path / "out").exists()


# -- the same algorithm on every device ----------------------------------------------------------
@pytest.mark.parametrize(("recipe", "pieces"), [(r, p) for _, r, cuts in FAMILIES for p in cuts],
                         ids=[f"{p}-{n}" for n, _, cuts in FAMILIES for p in cuts])
def test_calibrating_on_a_second_device_cuts_and_computes_as_on_the_cpu(recipe, pieces):
    """The weights rest on the CPU, calibration runs on a (simulated) GPU: any tensor left behind fails.

    On the CPU every value is the CPU's own, so the result equals the CPU run's bit for bit, with the
    same cut; every weight is back home afterwards. (An H100 run cut at blocks here: each block's layers
    stayed on the CPU while the layer cut was checked against the block cut.)
    """
    results, cuts = {}, {}
    for device in ("cpu", "cuda"):
        model = build_tiny_llama()
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeviceErrorWarning)
            with simulated_device("cuda:0") as gpu:
                layerwise.compress(model, recipe, dataset=_samples(), device=device, show_progress=False, options=layerwise.CompressOptions.of(pieces=pieces))
        gpu.check_home(model)
        moved = gpu.moves["to device"]
        assert (moved > 0) == (device == "cuda")
        results[device], cuts[device] = model.state_dict(), model.layerwise_report.pieces
        # solved or tuned everywhere: a GPTQ layer or AutoRound block left to round to nearest would match anyway
        assert "rtn" not in {r.get("method") for r in model.layerwise_report.layer_log}
    assert cuts["cuda"] == cuts["cpu"] and cuts["cpu"].startswith(pieces)
    assert all(torch.equal(results["cpu"][k], results["cuda"][k]) for k in results["cpu"])


def test_a_model_already_on_the_device_is_cut_at_layers_and_gives_the_cpu_result():
    expected = build_tiny_llama(tie_word_embeddings=True)
    layerwise.compress(expected, GPTQ_W4A16_G32, dataset=_samples(), device="cpu", show_progress=False)
    model = build_tiny_llama(tie_word_embeddings=True)
    with simulated_device("cuda:0") as gpu:
        model.to("cuda")
        layerwise.compress(model, GPTQ_W4A16_G32, dataset=_samples(), device="cuda", show_progress=False)
        model.to("cpu")
    gpu.check_home(model)
    assert model.layerwise_report.pieces == expected.layerwise_report.pieces
    assert all(torch.equal(a, b) for a, b in zip(expected.state_dict().values(), model.state_dict().values()))


def test_a_device_error_that_changes_the_cut_is_a_loud_warning_naming_a_bug():
    model = build_tiny_llama()
    calls = []

    def wrong_device_once(module, args):  # the first forward of the final norm on data: the layer cut's check
        if type(args[0]) is torch.Tensor and args[0].device.type != "meta":  # not while tracing
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError(CUDA_DEVICE_ERROR)

    model.model.norm.register_forward_pre_hook(wrong_device_once)
    with pytest.warns(DeviceErrorWarning, match=r"cut at blocks instead of before the layers.*a bug.*wrapper_CUDA_mm"):
        layerwise.compress(model, GPTQ_W4A16_G32, dataset=_samples(2), device="cpu", show_progress=False)
    assert model.layerwise_report.pieces.startswith("blocks") and "a device error: a bug" in model.layerwise_report.pieces
    calls.clear()
    model = build_tiny_llama()
    model.model.norm.register_forward_pre_hook(wrong_device_once)
    with pytest.raises(InvalidArgumentError, match="pieces='layers' cannot be used.*wrapper_CUDA_mm"):
        layerwise.compress(model, GPTQ_W4A16_G32, dataset=_samples(2), device="cpu", show_progress=False, options=layerwise.CompressOptions.of(pieces="layers"))


def test_device_errors_are_told_apart_through_their_causes():
    try:
        try:
            raise RuntimeError(CUDA_DEVICE_ERROR)
        except RuntimeError as inner:
            raise ValueError("replaying the first batch failed") from inner
    except ValueError as outer:
        assert is_device_error(outer)
    assert not is_device_error(RuntimeError("shapes cannot be multiplied")) and not is_device_error(None)


@needs_cuda
def test_calibrating_on_the_gpu_gives_the_cpu_result(tmp_path):
    """GPTQ on the GPU against the CPU run: the same cut, and each layer as close to its original weights.

    Not the same integers: on an H200 (2026-11-27) the solver given one Hessian picked other grid points
    for some entries (a last-bit difference of a GPU matmul, carried into later columns by GPTQ's error
    feedback and into later layers by their inputs), and the dequantized weights differ in the scales' last
    bit, so ``==`` matched 30-50 % of them; each layer's relative error from its original weights was
    within 1 % of the CPU run's. The threshold here is 5 %."""
    samples = _samples()
    results, cuts, originals = {}, {}, {}
    for device in ("cpu", "cuda"):
        model = build_tiny_llama()
        originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeviceErrorWarning)
            layerwise.compress(model, GPTQ_W4A16_G32, dataset=samples,
                               device=device, show_progress=False)
        assert all(p.device.type == "cpu" for p in model.parameters())  # weights went home after each piece
        results[device] = {n: m.weight.detach().clone() for n, m in model.named_modules()
                           if getattr(m, "quantization_args", None) is not None}
        cuts[device] = model.layerwise_report.pieces
        if device == "cuda":
            assert model.layerwise_report.peak_gpu_bytes > 0
    assert cuts["cuda"] == cuts["cpu"] and cuts["cpu"].startswith("layers")
    assert results["cuda"].keys() == results["cpu"].keys() and results["cpu"]
    for name, weight in results["cpu"].items():
        original = originals[name]
        on_cpu = (weight - original).norm() / original.norm()
        on_gpu = (results["cuda"][name] - original).norm() / original.norm()
        assert abs(on_gpu / on_cpu - 1) < 0.05, f"{name}: error {on_gpu:.5f} on the GPU, {on_cpu:.5f} on the CPU"


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


def test_a_bert_reads_its_embeddings_buffers_and_tied_bias_on_the_device():
    """BERT's first piece reads embeddings.token_type_ids / position_ids, buffers of a container whose layers
    it calls (they were left on the CPU); its decoder bias is one tensor on two modules (it stayed on the GPU)."""
    from transformers import BertConfig, BertForMaskedLM

    def bert():
        torch.manual_seed(0)
        return BertForMaskedLM(BertConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=64)).eval()

    samples = [{"input_ids": torch.randint(4, 96, (1, 12), generator=torch.Generator().manual_seed(i))}
               for i in range(2)]
    recipe = "GPTQModifier:\n  scheme: W4A16\n  group_size: 32\n  ignore: [cls.predictions.decoder]\n"
    expected = bert()
    layerwise.compress(expected, recipe, dataset=samples, device="cpu", show_progress=False)
    model = bert()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeviceErrorWarning)
        with simulated_device("cuda:0") as gpu:
            layerwise.compress(model, recipe, dataset=samples, device="cuda", show_progress=False)
    gpu.check_home(model)
    assert model.layerwise_report.pipeline == "sequential"
    assert model.layerwise_report.pieces == expected.layerwise_report.pieces
    assert all(torch.equal(a, b) for a, b in zip(expected.state_dict().values(), model.state_dict().values()))


def test_a_model_that_fits_on_the_device_moves_once_and_its_activations_stay_there():
    """With room on the (simulated) GPU the weights move once and no cached activation goes back to the CPU;
    without a known budget every piece onloads its weights and caches on the CPU. Both give the CPU result."""
    expected = build_tiny_llama()
    layerwise.compress(expected, GPTQ_W4A16_G32, dataset=_samples(), device="cpu", show_progress=False)
    moves = {}
    for free in (None, 2**30):
        model = build_tiny_llama()
        with simulated_device("cuda:0", free_bytes=free) as gpu:
            layerwise.compress(model, GPTQ_W4A16_G32, dataset=_samples(), device="cuda", show_progress=False)
        gpu.check_home(model)
        moves[free] = gpu.moves["to device"]
        assert all(torch.equal(a, b) for a, b in zip(expected.state_dict().values(), model.state_dict().values()))
    model = build_tiny_llama()
    tensors = len(list(model.parameters())) + len(list(model.buffers()))
    assert moves[2**30] <= tensors + 2 * len(_samples())  # every weight once, the token ids (and the cut's check)
    assert moves[None] > 4 * moves[2**30]


class _MovesToItsDevice(torch.nn.Module):
    """Embeddings moved ``.to(self.device)`` as Idefics3's forward does: the trace reads the device as a value."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    @property
    def device(self) -> torch.device:  # as PreTrainedModel.device reads it: from the parameters, not a traced value
        return next(self.parameters()).device

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids).to(self.device)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


def test_a_device_the_trace_read_as_a_value_follows_the_inputs_when_replayed_on_the_gpu():
    """Traced with the weights on the CPU, ``.to(self.device)`` is ``.to(cpu)`` in the graph: replayed on a GPU
    it moved the embeddings back to the CPU before the first layer (Idefics3's layer cut failed so)."""
    from layerwise.runtime.cache import move_to
    from layerwise.tracing import trace

    torch.manual_seed(0)
    model = _MovesToItsDevice().eval()
    sample = {"input_ids": torch.randint(0, 16, (1, 5))}
    result = trace(model, sample, sequential_targets=["layers.0", "layers.1"])
    assert any(sub.device_nodes for sub in result.subgraphs)
    expected = model(**sample)
    with simulated_device("cuda:0") as gpu:
        model.to("cuda")
        got = result.replay(move_to(dict(sample), torch.device("cuda:0")))
        assert gpu.on_device(got)
        model.to("cpu")
    assert torch.equal(got.to("cpu"), expected)
    assert torch.equal(result.replay(sample), expected)  # and back on the CPU


@needs_cuda
def test_on_the_gpu_a_bfloat16_gram_is_taken_as_it_is_with_float32_sums():
    """The Hessians' inputs stay bfloat16 on a GPU, their products on the tensor cores with float32 output: the
    Gram is the float64 one of the same values to float32's precision."""
    from layerwise.algorithms.hessian import add_gram, gram_dtype

    x = (torch.randn(2048, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3).bfloat16()
    assert gram_dtype(x) == torch.bfloat16
    gram = add_gram(torch.zeros(1024, 1024, device="cuda"), x)
    exact = x.double().t() @ x.double()
    upper = torch.ones(1024, 1024, dtype=torch.bool, device="cuda").triu()
    assert ((gram.double() - exact).abs()[upper] <= 1e-5 * exact.abs().max()).all()
