"""Resuming an interrupted run: a checkpoint after every finished piece, in the output's temporary folder.

A run whose weights stream from disk writes each finished piece's tensors to part files in the
output's locked temporary sibling (``.out.incomplete-XXXX/``). After each piece it also saves,
atomically, :data:`STATE_FILE`: which piece was last finished, the cached inputs of the next
one, the stream's and writer's bookkeeping, each modifier's state (:func:`modifier_state`), the
run log and the compressed modules' attributes, with a :func:`fingerprint` of model, recipe,
data and versions. ``compress(..., resume=True)`` adopts such a folder left by a dead process and
continues after its last piece; the result equals an uninterrupted run's. A folder whose
fingerprint differs is an error that says what changed; without ``resume`` a checkpoint is
reported, never reused or deleted silently.

A modifier's state is its dataclass fields and attributes holding plain data (numbers, strings,
tensors, and lists / dicts / sets / dataclasses of them); references to modules, hooks and other
objects are rebuilt by its ``on_initialize`` / ``on_calibration_start``. A modifier that needs
more defines ``resume_state() -> dict`` and ``restore_state(state)``.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from layerwise.common.files import replace_file, write_through
from layerwise.common.user_warnings import warn_user
from layerwise.errors import LayerwiseError
from layerwise.model_io.streaming.shards import PART_PREFIX, missing_files

STATE_FOLDER = ".layerwise-resume"
STATE_FILE = "state.pt"
#: attributes a compressed module carries that the saved config is built from
MODULE_ATTRIBUTES = ("quantization_args", "input_quantization_args", "sparsity_structure")


class ResumeError(LayerwiseError, RuntimeError):
    """A checkpoint cannot be used (another run's, or left where a fresh run was asked for)."""


class ResumeWarning(UserWarning):
    """``resume=True`` found nothing to resume: the run starts from the first piece."""


def has_checkpoint(folder: Path) -> bool:
    return (folder / STATE_FOLDER / STATE_FILE).is_file()


def describe(folder: Path) -> str:
    """``piece 7 of 65, saved 2026-11-25 02:41``, or ``""`` when unreadable."""
    try:
        meta = json.loads((folder / STATE_FOLDER / "progress.json").read_text())
    except (OSError, ValueError):
        return ""
    return f"after piece {meta['finished'] + 1} of {meta['pieces']}, saved {meta['saved']}"


# -- fingerprint -------------------------------------------------------------------------
def fingerprint(model_folder: str, recipe: str, batches: list[dict[str, Any]], options: dict[str, Any]) -> dict[str, str]:
    """What must be equal for a checkpoint to be continued: one hash or value per thing that can change."""
    from layerwise import __version__

    folder = Path(model_folder).expanduser()
    model = hashlib.sha256((folder / "config.json").read_bytes())
    for file in sorted(folder.glob("*.safetensors")):
        model.update(f"{file.name}:{file.stat().st_size}:{int(file.stat().st_mtime)}".encode())
    data = hashlib.sha256()
    for batch in batches:
        for name in sorted(batch):
            value = batch[name]
            data.update(name.encode())
            if isinstance(value, torch.Tensor):
                data.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                data.update(repr(value).encode())
    import transformers

    return {"model": model.hexdigest()[:16], "recipe": hashlib.sha256(recipe.encode()).hexdigest()[:16],
            "dataset": data.hexdigest()[:16], "options": json.dumps(options, sort_keys=True, default=str),
            "layerwise": __version__, "transformers": transformers.__version__, "torch": torch.__version__}


def check_fingerprint(saved: dict[str, str], current: dict[str, str], folder: Path) -> None:
    changed = [k for k in current if saved.get(k) != current[k]]
    if changed:
        details = "; ".join(f"{k}: {saved.get(k)!r} then, {current[k]!r} now"
                            if k in ("options", "layerwise", "transformers", "torch") else f"{k} differs"
                            for k in changed)
        raise ResumeError(f"the checkpoint in '{folder}' is from a different run ({details}): it cannot be "
                          f"continued. Run again with what it was started with, or delete '{folder}' to start over")


# -- modifier state ------------------------------------------------------------------------
def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor, torch.dtype)):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return all(_plain(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def modifier_state(modifier: Any) -> dict[str, Any]:
    """What a modifier knows after a piece, in a form ``torch.save`` keeps (see the module docstring)."""
    custom = getattr(modifier, "resume_state", None)
    if callable(custom):
        return {"custom": custom()}
    return {"fields": {k: v for k, v in vars(modifier).items() if k != "_hooks" and _plain(v)}}


def restore_modifier(modifier: Any, state: dict[str, Any]) -> None:
    if "custom" in state:
        modifier.restore_state(state["custom"])
    else:
        vars(modifier).update(state["fields"])


# -- the checkpoint ---------------------------------------------------------------------------
class PieceCheckpoint:
    """Saves and restores the state of a streamed run between pieces, in ``folder/.layerwise-resume``."""

    def __init__(self, folder: Path, fingerprint: dict[str, str], resume: bool) -> None:
        self.folder = Path(folder)
        self.path = self.folder / STATE_FOLDER / STATE_FILE
        self.fingerprint = fingerprint
        self.saved: dict[str, Any] | None = None
        #: when this process took over, and the seconds the interrupted run(s) had spent before
        self.started = time.perf_counter()
        self.earlier_seconds = 0.0
        #: the first piece this process ran after restoring a checkpoint (0-based); None: not resumed
        self.resumed_from: int | None = None
        #: the pieces of the interrupted run (``None``: not resumed, or a checkpoint that did not record them)
        self.pieces: int | None = None
        if resume and self.path.is_file():
            self.saved = torch.load(self.path, weights_only=False)
            check_fingerprint(self.saved["fingerprint"], fingerprint, self.folder)
            _check_parts(self.folder, self.saved["writer"]["parts"])
            self.earlier_seconds = float(self.saved.get("seconds", 0.0))
        elif resume:
            warn_user(f"resume=True, but no interrupted run of this output left a checkpoint (no "
                      f"'{self.folder.name}' with {STATE_FOLDER}/{STATE_FILE} beside it): starting from the first "
                      f"piece", ResumeWarning)

    def save(self, finished: int, pieces: int, stream: Any, cache: Any, num_batches: int, dropped: set[int],
             lifecycle: Any, reference: Any = None) -> None:
        """Record that piece ``finished`` (0-based) is done; written atomically. ``reference``: the
        uncompressed model's stream of inputs, when a modifier reads it (GPTAQ, AutoRound)."""
        state = lifecycle.state
        values = _cached_values(cache, num_batches)
        modules = {name: {a: getattr(m, a) for a in MODULE_ATTRIBUTES if a in vars(m)}
                   for name, m in state.model.named_modules() if name in stream.retired}
        payload = {
            "fingerprint": self.fingerprint, "finished": finished, "pieces": pieces, "cache": values, "dropped": sorted(dropped),
            "reference": None if reference is None else _cached_values(reference, num_batches),
            "stream": {"retired": sorted(stream.retired), "covered": sorted(stream.covered),
                       "sparsity_counts": dict(stream.sparsity_counts), "final_bytes": stream.final_bytes},
            "seconds": self.earlier_seconds + time.perf_counter() - self.started,
            "writer": {"parts": list(stream.writer.parts), "weight_map": dict(stream.writer.weight_map),
                       "total_bytes": stream.writer.total_bytes},
            "modifiers": [modifier_state(m) for m in lifecycle.modifiers],
            "log": list(state.log), "modules": modules,
        }
        self.path.parent.mkdir(exist_ok=True)
        tmp = self.path.with_name(STATE_FILE + ".tmp")
        write_through(tmp, lambda handle: torch.save(payload, handle))  # a full disk is named, not opaque
        os.replace(tmp, self.path)
        progress = {"finished": finished, "pieces": pieces,
                    "saved": datetime.datetime.now().isoformat(timespec="seconds")}
        replace_file(self.path.parent / "progress.json", json.dumps(progress))

    def restore(self, stream: Any, cache: Any, lifecycle: Any, reference: Any = None) -> tuple[int, set[int]]:
        """Put a saved run back; returns the first piece still to run and the batches dropped so far."""
        saved = self.saved
        if saved is None:
            return 0, set()
        stream.retired.update(saved["stream"]["retired"])
        stream.covered.update(saved["stream"]["covered"])
        stream.sparsity_counts.update(saved["stream"]["sparsity_counts"])
        stream.final_bytes = saved["stream"].get("final_bytes", 0)  # the pieces written before, counted once
        writer = saved["writer"]
        stream.writer.restore(writer["parts"], writer["weight_map"], writer["total_bytes"])
        if not stream.writer.complete_merge():  # an interrupted final merge is finished from what is there
            for part in self.folder.glob(f"{PART_PREFIX}*.safetensors"):  # written after the last checkpoint: redone
                if part.name not in writer["parts"]:
                    part.unlink()
        _refill(cache, saved["cache"])
        if reference is not None:
            _refill(reference, saved.get("reference") or {})
        for modifier, state in zip(lifecycle.modifiers, saved["modifiers"]):
            restore_modifier(modifier, state)
        lifecycle.state.log[:] = saved["log"]
        model = lifecycle.state.model
        for name, attributes in saved["modules"].items():
            vars(model.get_submodule(name)).update(attributes)
        self.resumed_from, self.pieces = saved["finished"] + 1, saved.get("pieces")
        return saved["finished"] + 1, set(saved["dropped"])

    def discard(self) -> None:
        """Remove the checkpoint (the run is complete; it must not end up in the output)."""
        shutil.rmtree(self.folder / STATE_FOLDER, ignore_errors=True)


def _check_parts(folder: Path, parts: list[str]) -> None:
    """A checkpoint whose part files are gone cannot be continued: say so before any work, naming the folder."""
    missing = missing_files(folder, parts)
    if missing:
        raise ResumeError(f"the checkpoint in '{folder}' cannot be continued: {len(missing)} of the part files it "
                          f"lists are gone ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}). "
                          f"Delete '{folder}' and run again without --resume (resume=True) to start over")


def _cached_values(cache: Any, num_batches: int) -> dict[int, dict[str, Any]]:
    """Every batch's cached values, on the CPU (what ``torch.save`` writes)."""
    from layerwise.runtime.cache import move_to

    return {b: {n: move_to(cache.get(b, n), "cpu") for n in cache.names(b)} for b in range(num_batches)}


def _refill(cache: Any, saved: dict[int, dict[str, Any]]) -> None:
    cache.clear()
    for batch, values in saved.items():
        cache.update(batch, values)
