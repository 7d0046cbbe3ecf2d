"""One pass through the pieces that loads, compresses and writes: the weights stream through memory.

:class:`WeightStream` is what the pipelines' :class:`~layerwise.runtime.offload.ModuleOffloader` asks for
a weight that is not loaded (:meth:`WeightStream.load`), and what it hands a piece's modules to
once no later piece runs them (:meth:`WeightStream.retire`): their final tensors (quantized
ones encoded by the saver) go to the output shards and their parameters are unloaded again.
:meth:`WeightStream.finish` copies what no piece ran (a head nobody calibrates), tensor by tensor.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerwise.errors import LayerwiseError
from layerwise.model_io.streaming.checkpoint import Checkpoint, checkpoint_bytes
from layerwise.model_io.streaming.safetensors_io import DTYPES, StoredTensor
from layerwise.model_io.streaming.shards import ShardWriter
from layerwise.model_io.streaming.skeleton import (
    build_skeleton,
    config_dtype,
    load_persistent_buffers,
)
from layerwise.runtime import memory_policy
from layerwise.runtime.finite import check_saved, is_finite, listed
from layerwise.runtime.placeholders import is_unloaded

log = logging.getLogger("layerwise")

#: a streamed run's peak is about this share of the checkpoint; an in-memory run's is ~1.35x the model
IN_MEMORY_PEAK = 1.5
#: ``weights=`` values: where the weights rest during a run
WEIGHTS = ("auto", "memory", "stream")

Encoder = Callable[[str, nn.Module], dict[str, torch.Tensor]]


class StreamingError(LayerwiseError, RuntimeError):
    """This model or run cannot stream its weights from disk (the message says why and what to do)."""


def should_stream(folder: str | os.PathLike, free: int | None = None) -> tuple[bool, str]:
    """Whether a run on ``folder`` would not fit in memory (then ``weights="auto"`` streams), and why;
    ``free``: the memory to plan for (``None``: what this machine has available now)."""
    size = checkpoint_bytes(folder)
    if size is None:
        return False, "no safetensors checkpoint to stream"
    if free is None:
        free = memory_policy.available_memory()  # looked up here, so one monkeypatch serves both choices
    if free is None:
        return False, "available memory unknown"
    need = int(size * IN_MEMORY_PEAK)
    fits = need <= free
    why = f"{size / 2**30:.2f} GiB checkpoint, ~{need / 2**30:.2f} GiB to load it, {free / 2**30:.2f} GiB available"
    return not fits, why


def choose_streaming(model: Any, weights: str) -> tuple[bool, str]:
    """Whether a run streams its weights from disk, and why: ``weights`` is checked, ``model`` a folder or a module."""
    if weights == "memory":
        return False, ""
    if isinstance(model, torch.nn.Module):
        if weights == "stream":
            raise StreamingError("weights='stream' reads the model from its folder, but a loaded module was passed: "
                                 "pass the folder instead (or weights='memory')")
        return False, ""
    if weights == "stream":
        return True, "asked for"
    stream, why = should_stream(model)
    if stream:
        log.info("layerwise: the model would not fit in memory (%s): streaming its weights from disk", why)
    return stream, f"would not fit in memory: {why}"


def build_streamed_model(folder: str | os.PathLike, patch: Any = None, trust_remote_code: bool = False
                         ) -> tuple[nn.Module, WeightStream]:
    """The model of ``folder`` with its weights left on disk, its patch applied, and its stream."""
    import transformers

    from layerwise.host.patch_selection import apply_patch, resolve_patch
    from layerwise.model_io.heads import checkpoint_class
    from layerwise.model_io.model_paths import check_model_path

    check_model_path(folder)
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise StreamingError(f"{str(folder)!r} is not a local folder: streaming reads the checkpoint from disk. "
                             f"Download it first, or pass weights='memory' (CLI: --weights memory)")
    checkpoint = Checkpoint(path)
    config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if getattr(config, "quantization_config", None) is not None:
        raise StreamingError(f"{str(folder)!r} is already quantized (config.json has quantization_config); "
                             f"streaming reads dense checkpoints. Pass weights='memory'")
    cls = checkpoint_class(config, path, set(checkpoint.names()))
    model = build_skeleton(cls, config, config_dtype(config))
    model = apply_patch(model, resolve_patch(model, patch))
    load_persistent_buffers(model, checkpoint)
    return model, WeightStream(model, checkpoint)


class WeightStream:
    """Loads unloaded weights of ``model`` from ``checkpoint`` and writes finished modules to the output."""

    def __init__(self, model: nn.Module, checkpoint: Checkpoint) -> None:
        self.model = model
        self.checkpoint = checkpoint
        self.keys = _checkpoint_keys(model, checkpoint)
        self.writer: ShardWriter | None = None
        self.encoder: Encoder | None = None
        #: qualified names of the modules whose tensors were written
        self.retired: set[str] = set()
        #: checkpoint keys written, or replaced by what a retired module wrote (a quantized weight)
        self.covered: set[str] = set()
        #: parameter prefixes exempt from the non-finite check (``non_finite="skip"``)
        self.exempt: tuple[str, ...] = ()
        #: bytes of the final tensors of the modules retired so far (written, or dropped without an output)
        self.final_bytes = 0
        #: per pruned module written, (zeros, weights): the sparsity config is built from these
        self.sparsity_counts: dict[str, tuple[int, int]] = {}
        #: called once every tensor is written, before the folder becomes the output (drops a resume checkpoint)
        self.on_finish: list[Callable[[], None]] = []

    # -- set-up ------------------------------------------------------------------------
    def write_to(self, folder: str | Path | None, encoder: Encoder | None) -> None:
        """Send retired modules' tensors to shards in ``folder`` (``None``: counted, not written: another
        rank writes, or a dry run), quantized modules through ``encoder``."""
        self.writer, self.encoder = (ShardWriter(folder) if folder is not None else None), encoder

    def non_finite(self) -> list[str]:
        """Parameters (qualified names) whose checkpoint values hold NaN or inf; read a chunk at a time, each
        chunk's pages given back at once (checking must not load the model)."""
        bad = []
        for name, param in self.model.named_parameters():
            key = self.keys.get(id(param))
            if key is None:
                continue
            flat = self.checkpoint.read(key).reshape(-1)
            finite = True
            for begin in range(0, flat.numel(), _CHECK_CHUNK):
                chunk = flat[begin:begin + _CHECK_CHUNK]
                finite = finite and is_finite(chunk)
                self.checkpoint.release(chunk)
                if not finite:
                    break
            if not finite:
                bad.append(name)
        return bad

    # -- the offloader's side ------------------------------------------------------------
    def load(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The values of unloaded parameter ``tensor``, read from the checkpoint onto ``device``."""
        key = self.keys.get(id(tensor))
        if key is None:
            raise StreamingError("a parameter has no tensor in the checkpoint to load it from")
        stored = self.checkpoint.read(key)
        value = stored.to(device=device, dtype=tensor.dtype)
        if value.data_ptr() != stored.data_ptr():  # copied (cast, or to the GPU): the file's pages can go
            self.checkpoint.release(stored)
        return value

    def release(self, tensor: torch.Tensor) -> None:
        """Give back the memory pages of a loaded weight about to be unloaded (a view of the checkpoint; a
        weight a modifier replaced had its view's pages handed back then, :func:`~layerwise.algorithms.quantization.storage.replace_data`)."""
        self.checkpoint.release(tensor)

    def is_retired(self, name: str) -> bool:
        return name in self.retired

    def retire(self, owners: Iterable[tuple[str, nn.Module]]) -> None:
        """Write the final tensors of ``owners`` (qualified name, module; their direct tensors) and mark them done."""
        tensors: dict[str, torch.Tensor] = {}
        for name, module in owners:
            if name in self.retired:
                continue
            tensors.update(self._final_tensors(name, module))
            self.retired.add(name)
        if tensors:
            check_saved(tensors, self.exempt)
            self.final_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
            if self.writer is not None:
                self.writer.write(tensors, written=self.checkpoint.release)
        trim_heap()

    def _final_tensors(self, name: str, module: nn.Module) -> dict[str, torch.Tensor]:
        from layerwise.algorithms.sparsity.storage import SPARSITY_ATTR

        prefix = f"{name}." if name else ""
        out: dict[str, torch.Tensor] = {}
        quantized = getattr(module, "quantization_args", None) is not None
        if getattr(module, SPARSITY_ATTR, None) is not None:
            weight = module.weight.detach()
            self.sparsity_counts[name] = (int((weight == 0).sum()), weight.numel())
        for key, param in module._parameters.items():
            if param is None:
                continue
            stored = self.keys.get(id(param), prefix + key)
            if stored in self.covered:  # a tied weight, written with its first holder
                continue
            self.covered.add(stored)
            if quantized and key == "weight":
                continue  # the encoder writes it
            if is_unloaded(param):
                raise StreamingError(f"{prefix + key} was never loaded but its module {name!r} is finished")
            out[stored] = param.detach()
        if quantized and self.encoder is not None:  # without one nothing is written (a dry run)
            out.update(self.encoder(name, module))
        elif quantized and self.writer is not None:
            raise StreamingError(f"quantized module {name!r} has no encoder to write it")
        for key, buffer in module._buffers.items():
            full = prefix + key
            if buffer is not None and key not in module._non_persistent_buffers_set and full not in self.covered:
                self.covered.add(full)
                out[full] = buffer.detach()
        return out

    def output_bytes(self, bytes_before: int) -> int:
        """What the run's tensors take on disk: the finished modules' as written, the rest as they are."""
        return self.final_bytes + max(bytes_before - self.covered_bytes(), 0)

    def covered_bytes(self) -> int:
        """Bytes (in the model's dtypes) of the parameters written or replaced so far."""
        sizes = {key: param.numel() * param.element_size() for param in self.model.parameters()
                 if (key := self.keys.get(id(param))) is not None}
        return sum(size for key, size in sizes.items() if key in self.covered)

    # -- the end -----------------------------------------------------------------------
    def leftovers(self) -> list[str]:
        """Modules holding parameters no piece ran (never retired), in model order."""
        return [name for name, module in self.model.named_modules()
                if name not in self.retired and any(p is not None for p in module._parameters.values())]

    def finish(self, rewrite: tuple[set[str], Callable[[str, torch.Tensor], dict[str, torch.Tensor]]] | None = None
               ) -> None:
        """Copy every checkpoint tensor nothing wrote (read one at a time); then gather and name the shards.

        ``rewrite``: (keys, encode): written tensors the saver re-encodes once every piece is done (a
        pruned weight's layout depends on every pruned layer).
        """
        dtypes = {key: param.dtype for param in self.model.parameters()
                  if (key := self.keys.get(id(param))) is not None}
        pending = [k for k in self.checkpoint.names() if k not in self.covered]
        batch: dict[str, torch.Tensor | StoredTensor] = {}
        size = 0
        for key in pending:
            stored = self.checkpoint.stored(key)
            value: torch.Tensor | StoredTensor = stored
            if key in dtypes and DTYPES.get(stored.dtype) != dtypes[key]:  # cast as from_pretrained would
                value = self.checkpoint.read(key).to(dtypes[key])
            batch[key] = value
            size += stored.nbytes
            self.covered.add(key)
            if size >= _COPY_BATCH_BYTES:
                self._write(batch)
                batch, size = {}, 0
        self._write(batch)
        if self.writer is not None:
            if rewrite is not None:
                self.writer.rewrite(*rewrite)
            self.writer.finish()
        for callback in self.on_finish:
            callback()

    def _write(self, tensors: dict[str, torch.Tensor | StoredTensor]) -> None:
        """Write a batch of checkpoint tensors (byte ranges copied as they are, after a finiteness check)."""
        if tensors and self.writer is not None:  # copied values were checked by non_finite() before the run
            check_saved({k: v for k, v in tensors.items() if not isinstance(v, StoredTensor)}, self.exempt)
            self.writer.write(tensors, written=self.checkpoint.release)

    def close(self) -> None:
        self.checkpoint.close()


#: elements checked for NaN / inf at a time (a 128k-token embedding is half a billion)
_CHECK_CHUNK = 2**24
#: tensors copied unchanged are written in files of about this size
_COPY_BATCH_BYTES = 256 * 2**20


def seal_streamed_model(model: nn.Module, output_dir: str | os.PathLike | None) -> None:
    """Make the model a streamed run returns refuse to run: its weights went to ``output_dir`` piece by piece
    and are placeholders now (NaN), so a forward would compute NaN without a word."""
    where = f"were written to {str(output_dir)!r}: load them with layerwise.load_compressed({str(output_dir)!r})" \
        if output_dir is not None else "were not kept (no output folder was given)"

    def refuse(module: nn.Module, args: Any) -> None:
        raise StreamingError(f"this model's weights were streamed from disk (weights='stream') and are not in "
                             f"memory: they {where}, or compress with weights='memory' to keep them")

    model.register_forward_pre_hook(refuse)


def trim_heap() -> None:
    """Hand the memory freed by a finished piece back to the system (glibc keeps freed heap otherwise,
    and a streamed run's peak is what one piece needs on top of what earlier ones left)."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC else None
    if trim is not None:
        trim(0)


_LIBC: Any = None


def _checkpoint_keys(model: nn.Module, checkpoint: Checkpoint) -> dict[int, str]:
    """Each parameter (by identity) -> the checkpoint key holding it (any of a tied parameter's names).

    Parameters the checkpoint does not hold, or checkpoint tensors the model has no place for, are a
    :class:`StreamingError`: ``from_pretrained`` renames some architectures' keys on load, which a
    streamed run does not do.
    """
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    keys: dict[int, str] = {}
    missing = []
    for ident, aliases in names.items():
        found = next((a for a in aliases if a in checkpoint), None)
        if found is None:
            missing.append(aliases[0])
        else:
            keys[ident] = found
    buffers = {f"{m}.{b}" if m else b for m, module in model.named_modules() for b in module._buffers}
    known = {a for aliases in names.values() for a in aliases} | buffers
    extra = [k for k in checkpoint.names() if k not in known]
    if missing or extra:
        what = []
        if missing:
            what.append(f"parameters missing from the checkpoint: {listed(missing)}")
        if extra:
            what.append(f"checkpoint tensors the model has no place for: {listed(extra)}")
        raise StreamingError(f"{type(model).__name__}'s weights cannot be streamed from {str(checkpoint.folder)!r}: "
                             f"{'; '.join(what)}. transformers renames such keys when it loads the whole model: "
                             f"pass weights='memory' (CLI: --weights memory)")
    return keys
