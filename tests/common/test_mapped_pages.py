"""Pages of a weight viewing a file map are handed back; values (and the process's own writes) stay."""

import mmap
import sys

import pytest
import torch

from layerwise.common.mapped_pages import release_mapped_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap")


def _resident_kb(address: int) -> int:
    """Resident kB of the map holding ``address`` (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("address not mapped")


def _mapped_tensor(tmp_path, values: torch.Tensor) -> tuple[torch.Tensor, mmap.mmap]:
    path = tmp_path / "weights.bin"
    path.write_bytes(values.numpy().tobytes())
    with open(path, "r+b") as file:
        mapped = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE)  # copy-on-write, as transformers loads
    return torch.frombuffer(mapped, dtype=values.dtype), mapped


def test_file_pages_are_dropped_and_read_back(tmp_path):
    values = torch.arange(256 * 1024, dtype=torch.float32)  # 1 MiB
    tensor, _ = _mapped_tensor(tmp_path, values)
    assert float(tensor.sum()) == float(values.sum())  # every page read: resident
    address = tensor.data_ptr()
    before = _resident_kb(address)
    assert before >= 1024
    released = release_mapped_pages(tensor)
    assert released >= 1024 * 1024 - 2 * mmap.PAGESIZE
    assert _resident_kb(address) <= before - 1000
    assert torch.equal(tensor, values)  # read from the file again


def test_pages_the_process_wrote_are_kept(tmp_path):
    values = torch.zeros(256 * 1024, dtype=torch.float32)
    tensor, _ = _mapped_tensor(tmp_path, values)
    tensor[: 1024 * 16].fill_(7.0)  # 16 pages copied on write: the process's own
    tensor.sum()
    release_mapped_pages(tensor)
    assert bool((tensor[: 1024 * 16] == 7.0).all())
    assert bool((tensor[1024 * 16:] == 0.0).all())


def test_torch_allocations_are_left_alone():
    tensor = torch.ones(1 << 20)
    assert release_mapped_pages(tensor) == 0
    assert bool((tensor == 1).all())
    assert release_mapped_pages(torch.empty(0)) == 0


def test_a_compressed_model_does_not_hold_its_replaced_weights_twice(tmp_path):
    """A model loaded from safetensors views the file; quantizing swaps each Linear's storage and
    hands the file's pages of the old values back (their mapping would otherwise stay resident)."""
    from transformers import BertConfig, BertModel

    from layerwise import compress
    from layerwise.model_io.loading import load_model

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=1024)
    BertModel(config).save_pretrained(tmp_path / "bert")
    model = load_model(str(tmp_path / "bert"))
    query = model.encoder.layer[0].attention.self.query
    param, address = query.weight, query.weight.data_ptr()
    if query.weight.untyped_storage().resizable():
        pytest.skip("this transformers release copies weights at load: nothing views the file")
    model(input_ids=torch.tensor([[1, 2, 3]]))  # touch every weight
    resident = _resident_kb(address)
    compress(model, "W8A8", show_progress=False, device="cpu")
    assert query.weight is param and query.weight.data_ptr() != address
    linear_kb = 2 * (4 * 256 * 256 + 2 * 256 * 1024) * 4 // 1024  # 2 layers of q, k, v, o, up, down in fp32
    assert _resident_kb(address) < resident - 0.9 * linear_kb
