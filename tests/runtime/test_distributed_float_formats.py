"""The float formats on two gloo ranks write the very checkpoint one process writes, byte for byte.

NVFP4 (weights rounded to nearest, the global input scale calibrated: its maxima are max-reduced over the ranks)
and GPTQ to NVFP4 / MXFP4 weights (the Hessians summed over the ranks). One spawn of two ranks saves each
recipe's checkpoint (rank 0 writes); each test compresses the same batches in this process and compares the
``model.safetensors`` bytes. Kept light: the tiny Llama, four short samples.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch

from tests.conftest import build_tiny_llama, run_ranks

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
mp = pytest.importorskip("torch.multiprocessing")
#: four samples are few for GPTQ's statistics, and enough to compare the ranks with one process
pytestmark = pytest.mark.filterwarnings("ignore:4 calibration samples:UserWarning")

WORLD = 2
SAMPLES, LENGTH = 4, 16
#: name -> recipe: NVFP4 round-to-nearest with a calibrated global input scale; GPTQ NVFP4 / MXFP4 weights
RECIPES = {"nvfp4": "NVFP4", "gptq_nvfp4a16": "GPTQ_NVFP4A16", "gptq_mxfp4a16": "GPTQ_MXFP4A16"}


def batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    ids = [torch.randint(0, 128, (1, LENGTH), generator=g) for _ in range(SAMPLES)]
    return [{"input_ids": i, "attention_mask": torch.ones_like(i)} for i in ids]


def compress(recipe: str, output_dir: Path) -> None:
    import layerwise

    layerwise.compress(build_tiny_llama(), recipe, dataset=batches(), num_calibration_samples=SAMPLES,
                       output_dir=str(output_dir), show_progress=False, device="cpu")


def _worker(rank: int, store: str, folder: str) -> None:
    out = Path(folder)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    result: dict[str, str] = {}
    try:
        for name, recipe in RECIPES.items():
            compress(recipe, out / f"{name}-model")
    except Exception:  # noqa: BLE001 - surfaced by the test
        result["crash"] = traceback.format_exc()
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    return run_ranks(_worker, tmp_path_factory.mktemp("ranks"), WORLD)


@pytest.mark.parametrize("name", list(RECIPES))
def test_two_ranks_write_the_checkpoint_one_process_writes(ranks, name, tmp_path):
    from safetensors.torch import load_file

    compress(RECIPES[name], tmp_path / "one")
    one, two = tmp_path / "one" / "model.safetensors", ranks / f"{name}-model" / "model.safetensors"
    if one.read_bytes() != two.read_bytes():  # name the tensors that differ, not just the files
        a, b = load_file(one), load_file(two)
        differ = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
        pytest.fail(f"{name}: two ranks wrote another model.safetensors than one process: {differ[:8]}")
    from layerwise.reports.run_summary import read_summary

    assert read_summary(ranks / f"{name}-model").report.ranks == 2  # it was calibrated on two ranks
