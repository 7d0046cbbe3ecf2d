"""Why a model folder did not load, in words a user can act on.

transformers, safetensors and torch report a corrupt weights file, a refused pickle or a
config that asks to run its own code as long tracebacks from deep inside, and a config.json
that is not JSON as a bare ``OSError``. :func:`explain`
turns the failures layerwise recognises into a :class:`ModelLoadError` that says what was
wrong (or refused, and why) and the fix; anything else it returns ``None`` for, and the
caller lets the original error through.

Two refusals are deliberate and stay so: pickle weights load weights-only (a pickle can
run any code while it loads), and ``trust_remote_code`` is off (it would run the
model's own Python from the folder or the hub).
"""

from __future__ import annotations

import contextlib
import json
import pickle
import re
from collections.abc import Iterator
from pathlib import Path

from layerwise.errors import ModelLoadError

#: how transformers names pickle weight files (one file or shards)
PICKLE_WEIGHTS = ("pytorch_model*.bin", "*.pt", "*.pth")


@contextlib.contextmanager
def explained(where: str) -> Iterator[None]:
    """Inside the block, a load failure :func:`explain` recognises becomes its ModelLoadError."""
    try:
        yield
    except Exception as exc:
        known = explain(where, exc)
        if known is None:
            raise
        raise known from exc


def explain(where: str, exc: BaseException) -> ModelLoadError | None:
    """A ModelLoadError for a failure to load ``where`` that layerwise recognises, else ``None``."""
    text = str(exc)
    if type(exc).__name__ == "SafetensorError":
        return _corrupt(_broken_safetensors(where) or where, f"safetensors: {text}")
    if isinstance(exc, pickle.UnpicklingError) and "GLOBAL" in text:
        return _pickle_refused(where, text)
    if isinstance(exc, pickle.UnpicklingError) or "PytorchStreamReader" in text:
        return _corrupt(_first(where, PICKLE_WEIGHTS) or where, f"torch.load: {_pickle_detail(text)}")
    if isinstance(exc, ValueError) and "trust_remote_code" in text:
        return _remote_code_refused(where)
    if isinstance(exc, ValueError) and "does not recognize this architecture" in text:
        return _unknown_model_type(where)
    if isinstance(exc, OSError) and not isinstance(exc, ModelLoadError):  # transformers' way to say most things
        return _config_not_json(where) or not_loadable(where, text)
    return None


def not_loadable(where: str, text: str) -> ModelLoadError:
    """transformers' own reason (its ``OSError``: no weights, an unknown hub id, ...) with what layerwise loads."""
    return ModelLoadError(f"cannot load model {where!r}: {text.rstrip('.')}. Pass a local folder with config.json "
                          f"and weights, or a hub id reachable from this machine")


def _config_not_json(where: str) -> ModelLoadError | None:
    """The error for a local config.json that does not parse (cut short, edited by hand), with where it breaks."""
    config_file = Path(where).expanduser() / "config.json"
    try:
        json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return None
    except ValueError as exc:
        return ModelLoadError(f"cannot load model {where!r}: its config file '{config_file}' is not valid JSON "
                              f"({exc}); repair it, or copy or download the model's config.json again")
    return None


def _corrupt(file: str | Path, detail: str) -> ModelLoadError:
    return ModelLoadError(
        f"model weights file '{file}' is truncated or corrupt ({detail}); download it again (delete the "
        f"partial copy, or the hub cache entry, first) or save the model again with save_pretrained")


def _pickle_refused(where: str, text: str) -> ModelLoadError:
    found = re.search(r"GLOBAL ([\w.]+)", text)
    wanted = f"asks to call {found.group(1)}" if found else "holds objects other than tensors"
    file = _first(where, PICKLE_WEIGHTS) or where
    return ModelLoadError(
        f"refused to load '{file}': this pickle file {wanted}, which weights-only loading does not allow. A pickle can "
        f"run any code while it loads, so layerwise only loads plain tensors from it and never runs code from a "
        f"checkpoint. Fix: if you trust the file, convert it to safetensors in a separate environment "
        f"(load it there and call save_pretrained), then pass the converted folder; otherwise use a "
        f"safetensors release of the model")


def _remote_code_refused(where: str) -> ModelLoadError:
    auto_map = _config(where).get("auto_map") or {}
    code = ", ".join(sorted({str(v) for v in auto_map.values()})) or "its own modeling code"
    return ModelLoadError(
        f"refused to load '{where}': its config.json asks transformers to run Python shipped with the model "
        f"({code}), which needs trust_remote_code=True. layerwise keeps trust_remote_code off on purpose: it "
        f"would run that code from the folder or the hub. Fix: read that code; if you trust it, run "
        f"layerwise compress --trust-remote-code (compress(..., trust_remote_code=True)), or load the model yourself "
        f"(layerwise.load_model(path, trust_remote_code=True)) and pass the module to layerwise.compress(), "
        f"with a model patch if it needs one (GUIDE.md section 5)")


def _unknown_model_type(where: str) -> ModelLoadError:
    import transformers

    model_type = _config(where).get("model_type", "?")
    return ModelLoadError(
        f"cannot load '{where}': its config.json has model_type {model_type!r}, which transformers "
        f"{transformers.__version__} does not know. Fix: a newer transformers may (`layerwise env` shows the "
        f"tested range); or load the model yourself and pass the module to layerwise.compress()")


def _config(where: str) -> dict:
    try:
        return json.loads((Path(where).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _broken_safetensors(where: str) -> Path | None:
    """The first ``*.safetensors`` file in the folder whose header safetensors cannot read."""
    from safetensors import safe_open

    for file in sorted(Path(where).expanduser().glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt"):
                pass
        except Exception:  # noqa: BLE001 - any failure to open marks this file as the broken one
            return file
    return None


def _first(where: str, patterns: tuple[str, ...]) -> Path | None:
    folder = Path(where).expanduser()
    return next((f for pattern in patterns for f in sorted(folder.glob(pattern))), None)


def _pickle_detail(text: str) -> str:
    """The part of torch's message that describes the file (not its advice to unpickle unsafely)."""
    reader = re.search(r"PytorchStreamReader [^.]*", text)
    if reader:
        return reader.group(0)
    operand = re.search(r"Unsupported operand \d+", text)
    return "not a pickle of tensors" + (f" ({operand.group(0)})" if operand else "")
