"""The intermediates cache: offload, nested structures, freeing, disk files."""

from __future__ import annotations

import os
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from layerwise.runtime.cache import IntermediatesCache, move_to, tensor_bytes


@dataclass
class Pair:
    left: torch.Tensor
    right: object = None


Point = namedtuple("Point", "x y")


def nested_value():
    torch.manual_seed(0)
    return {
        "t": (torch.randn(2, 3), [torch.arange(4), None], 7),
        "dc": Pair(torch.randn(3), right={"k": torch.ones(2)}),
        "mo": BaseModelOutputWithPast(last_hidden_state=torch.randn(1, 2, 4)),
        "nt": Point(torch.zeros(1), "label"),
        "none": None,
    }


def assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif hasattr(a, "__dataclass_fields__"):
        for k in a.__dataclass_fields__:
            assert_same(getattr(a, k), getattr(b, k))
    else:
        assert a == b


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_round_trips_nested_structures(offload, tmp_path):
    value = nested_value()
    with IntermediatesCache(offload=offload, offload_dir=tmp_path) as cache:
        cache.update(0, {"v": value, "plain": torch.ones(3)})
        got = cache.fetch(0, ["v", "plain"])
    assert_same(got["v"], value)
    assert isinstance(got["v"]["mo"], BaseModelOutputWithPast)
    assert got["v"]["mo"].past_key_values is None
    assert torch.equal(got["plain"], torch.ones(3))


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_free_drops_consumed_values_and_size_falls(offload, tmp_path):
    with IntermediatesCache(offload=offload, offload_dir=tmp_path) as cache:
        for batch in range(3):
            cache.update(batch, {"a": torch.randn(64, 64), "b": torch.randn(8)})
        full = cache.size_bytes()
        assert full >= 3 * 64 * 64 * 4
        cache.free(["a"])
        after = cache.size_bytes()
        assert after < full - 3 * 64 * 64 * 4 + 1024  # the big values are gone
        assert all("a" not in cache.names(b) for b in range(3))
        with pytest.raises(KeyError, match="freed before its last consumer"):
            cache.get(1, "a")
        assert torch.equal(cache.get(2, "b"), cache.get(2, "b"))


def test_the_peak_is_the_most_held_at_once_not_the_sum_of_everything_stored():
    """What a plan's cache forecast is checked against: a value freed before the next is stored does not add up."""
    with IntermediatesCache() as cache:
        for batch in range(4):
            cache.put(batch, "wide", torch.full((16, 64), float(batch)))  # 4 KiB each
        held = cache.memory_bytes()
        cache.free(["wide"])
        for batch in range(4):
            cache.put(batch, "narrow", torch.full((16, 16), float(batch)))
        assert cache.peak_bytes == held == 4 * 16 * 64 * 4


def test_a_value_equal_to_the_one_stored_last_under_its_name_is_held_once():
    """Rotary cos/sin are the same for every window of one length: held once for all batches, counted once,
    freed with the last batch that holds them; a value that differs anywhere is stored on its own."""
    torch.manual_seed(0)
    cos, sin = torch.randn(1, 8, 4), torch.randn(1, 8, 4)  # 128 bytes each
    with IntermediatesCache() as cache:
        for batch in range(4):
            cache.update(batch, {"rotary": (cos.clone(), sin.clone()), "hidden": torch.randn(1, 8, 4)})
        assert cache.memory_bytes() == cache.peak_bytes == 2 * 128 + 4 * 128
        assert all(torch.equal(cache.get(b, "rotary")[1], sin) for b in range(4))
        cache.free(["rotary"], batch=0)
        cache.free(["hidden"])
        assert cache.memory_bytes() == 2 * 128 and cache._held == 2 * 128
        moved = sin.clone()
        moved[0, 7, 3] += 1
        for batch, value in ((4, (cos.clone(), moved)), (5, (cos.clone(), sin.double())), (6, [cos, sin])):
            cache.put(batch, "rotary", value)
        assert cache.memory_bytes() == 2 * 128 + 2 * 128 + (128 + 256) + 2 * 128  # each stored apart
        cache.free(["rotary"])
        assert cache.memory_bytes() == cache._held == 0 and not cache._last and not cache._uses


def _value_files(folder: str) -> list[str]:
    """A disk cache's value files (beside them: the owner file)."""
    return [name for name in os.listdir(folder) if name.endswith(".pt")]


def test_disk_cache_writes_files_loads_lazily_and_removes_them(tmp_path):
    cache = IntermediatesCache(offload="disk", offload_dir=tmp_path)
    folder = cache.directory
    cache.put(0, "x", torch.randn(128, 128))
    cache.put(0, "y", (torch.randn(4), None))
    assert cache.memory_bytes() == 0  # nothing held in RAM
    assert cache.disk_bytes() >= 128 * 128 * 4
    assert len(_value_files(folder)) == 2
    cache.free(["x"])
    assert len(_value_files(folder)) == 1  # freed value's file is gone at once
    cache.close()
    assert not os.path.exists(folder)


def test_replacing_a_value_keeps_one_file(tmp_path):
    with IntermediatesCache(offload="disk", offload_dir=tmp_path) as cache:
        cache.put(0, "x", torch.zeros(2))
        cache.put(0, "x", torch.ones(2))
        assert len(_value_files(cache.directory)) == 1
        assert torch.equal(cache.get(0, "x"), torch.ones(2))


def test_fetch_moves_to_execution_device():
    # "meta" stands in for an accelerator: fetch must hand back tensors on the execution device
    cache = IntermediatesCache(execution_device="meta")
    cache.put(0, "h", (torch.randn(2), {"m": torch.ones(1)}))
    got = cache.get(0, "h")
    assert got[0].device.type == "meta" and got[1]["m"].device.type == "meta"
    assert cache._values[0]["h"][0].device.type == "cpu"  # rests on the offload device


def test_shared_storage_counted_once():
    t = torch.randn(100)
    assert tensor_bytes([t, t, t[:10]]) == 400
    assert move_to({"a": t}, None)["a"] is t


def test_bad_offload_is_a_clear_error():
    with pytest.raises(ValueError, match="offload must be"):
        IntermediatesCache(offload="floppy")


def test_a_killed_processs_disk_cache_is_removed_by_the_next_one(tmp_path):
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    stale = tmp_path / f"layerwise-cache-{child.pid}-abc"
    live = tmp_path / f"layerwise-cache-{os.getpid()}-abc"  # another cache of a running process: kept
    for folder in (stale, live):
        folder.mkdir()
        (folder / "b0-1.pt").write_bytes(b"x")
    with IntermediatesCache(offload="disk", offload_dir=tmp_path) as cache:
        assert os.path.basename(cache.directory).startswith(f"layerwise-cache-{os.getpid()}-")
        assert not stale.exists() and live.is_dir()


def test_a_disk_cache_another_machine_writes_is_kept(tmp_path):
    import subprocess
    import sys

    from layerwise.common.processes import process_identity
    from layerwise.runtime.cache import OWNER_FILE

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its PID is dead here, but the cache says it is another machine's
    theirs = tmp_path / f"layerwise-cache-{child.pid}-abc"
    theirs.mkdir()
    identity = {**process_identity(), "host": "gpu-node-7"}
    (theirs / OWNER_FILE).write_text(f"{child.pid}\n" + "".join(f"{k}={v}\n" for k, v in identity.items()))
    with IntermediatesCache(offload="disk", offload_dir=tmp_path) as cache:
        assert (Path(cache.directory) / OWNER_FILE).read_text().startswith(f"{os.getpid()}\n")
        assert theirs.is_dir()


def test_a_disk_cache_is_removed_when_the_pipeline_is_interrupted(tiny_llama, tmp_path, monkeypatch):
    import tempfile

    import layerwise

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def interrupted(self, batch, names=None):
        assert self.directory and _value_files(self.directory)  # the cache was on disk when it stopped
        raise KeyboardInterrupt

    monkeypatch.setattr(IntermediatesCache, "fetch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        layerwise.compress(tiny_llama, "GPTQ_W8A16", dataset=[{"input_ids": [[1, 2, 3, 4]]}], show_progress=False, options=layerwise.CompressOptions.of(offload="disk", pipeline="sequential"))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("layerwise-cache-")] == []


def _disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")  # what torch.save writing to an open file raises


def test_a_full_disk_names_the_cache_folder_the_sizes_and_where_else_it_can_go(tmp_path, monkeypatch):
    from layerwise.errors import DiskFullError

    with IntermediatesCache(offload="disk", offload_dir=tmp_path) as cache:
        cache.put(0, "kept", torch.zeros(256))  # 1 KiB held before the disk fills
        monkeypatch.setattr(torch, "save", _disk_full)
        with pytest.raises(DiskFullError) as info:
            cache.put(0, "hidden", torch.zeros(1024))
        message = str(info.value)
        assert f"'{cache.directory}'" in message and "No space left on device" in message
        assert "needed 4096 bytes more" in message and "held" in message
        assert f"offload_dir on a disk with room (now '{tmp_path}')" in message and "--offload cpu" in message
        assert sorted(os.listdir(cache.directory)) == [".owner", "b0-1.pt"]  # no part of the refused file


def test_a_full_temporary_folder_says_to_point_TMPDIR_elsewhere(tmp_path, monkeypatch):
    from layerwise.errors import DiskFullError

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir reads TMPDIR again
    monkeypatch.setattr(torch, "save", _disk_full)
    with IntermediatesCache(offload="disk") as cache, pytest.raises(DiskFullError) as info:
        cache.put(0, "hidden", torch.zeros(4))
    assert f"temporary folder ('{tmp_path}'), so set TMPDIR to a folder on another disk" in str(info.value)


@pytest.mark.parametrize("pieces", ["layers", "blocks"])
def test_a_llama_run_holds_its_rotary_cos_and_sin_once_for_samples_of_one_length(pieces, monkeypatch):
    """The traced pipeline caches the rotary embedding's (cos, sin) per batch; for windows of one length they are
    equal, so every batch after the first shares the first's: the cache holds them once."""
    import layerwise
    from tests.conftest import build_tiny_llama

    shared: list[str] = []
    original = IntermediatesCache._equal_to_last

    def equal_to_last(self, name, value):
        found = original(self, name, value)
        if found is not None:
            shared.append(name)
        return found

    monkeypatch.setattr(IntermediatesCache, "_equal_to_last", equal_to_last)
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 128, (1, 32), generator=generator)} for _ in range(8)]
    layerwise.compress(build_tiny_llama(), "{GPTQModifier: {scheme: W4A16, group_size: 32}}", dataset=data,
                       options=layerwise.CompressOptions.of(pieces=pieces), show_progress=False)
    every_batch = [name for name in set(shared) if shared.count(name) == 7]  # batches 1..7 share batch 0's
    assert len(every_batch) >= 2, f"cos and sin are not both shared by every batch: {sorted(set(shared))}"
