"""Telling a local model folder from a hub id, and refusing a folder that cannot be compressed, at once.

Checked before anything loads (a second, not minutes): a path that is not there (with the
nearest folder that is), a folder without ``config.json``, a bare name that cannot be a hub id
or cannot be looked up (offline), and a model that is already quantized (with what it holds).
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any

from layerwise.errors import ModelLoadError
from layerwise.model_io.output_leftovers import missing_output_hint

#: what a hub repository name may be (``name`` or ``org/name``): letters, digits, ``-``, ``_``, ``.``
HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
#: environment variables that keep transformers off the hub
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


class AlreadyQuantizedError(ModelLoadError):
    """The model given to compress is a quantized checkpoint: compress the original weights instead."""


def looks_like_path(where: str) -> bool:
    """Whether ``where`` can only be a folder, never a hub id (``name`` or ``org/name``).

    It starts with ``.``, ``~`` or ``/``, ends with a separator, has a backslash (no hub id has
    one), more than one ``/``, or characters no hub id has.
    """
    return (where.startswith((".", "~", "/")) or where.endswith("/") or "\\" in where or where.count("/") > 1
            or not HUB_ID.match(where))


def offline() -> bool:
    """Whether transformers is told not to reach the hub."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in OFFLINE_ENV)


def check_model_path(where: str | os.PathLike) -> None:
    """Refuse a model folder that is not there, or holds no config.json, before anything loads.

    A path-like name that does not exist is a local typo, and so is any name that does not exist
    while the hub is off (``HF_HUB_OFFLINE``): asking the hub would only retry for half a minute
    and then fail with a message about repository ids. The message names the nearest folder here, or, for
    an output a run was killed while putting in place, the folder beside it that holds it.
    """
    where = str(where)
    path = Path(where).expanduser()
    if path.exists() and not (path / "config.json").is_file():
        raise ModelLoadError(f"{where!r} has no config.json: pass a folder saved by transformers "
                             f"(save_pretrained) or a model id")
    if path.exists():
        return
    if hint := missing_output_hint(path):  # a killed run's renames: the folder to move into place is beside it
        raise ModelLoadError(f"model folder {where!r} does not exist{hint}")
    if looks_like_path(where):
        raise ModelLoadError(f"model folder {where!r} does not exist{_nearest_folder(path)}")
    if offline() and not _in_hub_cache(where):
        raise ModelLoadError(f"no folder {where!r} here{_nearest_folder(path)}, and the hub is off "
                             f"({', '.join(n for n in OFFLINE_ENV if os.environ.get(n))} is set) with no cached "
                             f"copy of a model {where!r}: pass the model's folder")


def _nearest_folder(path: Path) -> str:
    parent = path.parent if str(path.parent) else Path(".")
    try:
        folders = [p.name for p in parent.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, folders, n=1, cutoff=0.6)
    return f"; did you mean '{parent / close[0] if str(parent) != '.' else close[0]}'?" if close else ""


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - a malformed id is simply not cached
        return False
    return isinstance(found, str)


def check_not_quantized(where: str | os.PathLike) -> None:
    """Refuse a local folder whose config.json says it is quantized already, naming what it holds.

    Compressing it again would quantize quantized weights (or fail half way); the fix is the
    original model.
    """
    quant = folder_quantization(where)
    if quant:
        raise AlreadyQuantizedError(
            f"{str(where)!r} is already quantized ({describe_quantization(quant)}): compress the original, "
            f"unquantized model instead (its folder or hub id); to run it, load it with "
            f"transformers.AutoModelForCausalLM.from_pretrained or layerwise.load_compressed")


def folder_quantization(where: str | os.PathLike) -> dict[str, Any] | None:
    """The ``quantization_config`` a local folder's config.json holds; ``None`` for none, no such file, or one
    that does not read (transformers gives the precise error when it loads it)."""
    config_file = Path(str(where)).expanduser() / "config.json"
    if not config_file.is_file():
        return None
    try:
        return json.loads(config_file.read_text(encoding="utf-8")).get("quantization_config") or None
    except (OSError, ValueError):
        return None


def describe_quantization(quant: dict[str, Any]) -> str:
    """``compressed-tensors pack-quantized: int4 weights, group 128, asymmetric`` from a quantization_config."""
    method = quant.get("quant_method", "unknown method")
    parts = [f"{method} {quant.get('format', '')}".strip()]
    for group in (quant.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights:
            kind = "float" if weights.get("type") == "float" else "int"
            text = f"{kind}{weights.get('num_bits', '?')} weights"
            strategy = weights.get("strategy")
            text += f", group {weights.get('group_size')}" if strategy == "group" else f", per {strategy}" if strategy \
                else ""
            text += "" if weights.get("symmetric", True) else ", asymmetric"
            if group.get("input_activations"):
                inputs = group["input_activations"]
                text += f", {inputs.get('type', 'int')}{inputs.get('num_bits', '?')} inputs"
            parts.append(text)
            break
    if quant.get("bits"):  # GPTQ / AWQ checkpoints of other tools
        parts.append(f"{quant['bits']}-bit")
    if (quant.get("sparsity_config") or {}).get("format"):
        parts.append(f"sparsity {quant['sparsity_config']['format']}")
    return ": ".join(parts[:2]) + (f"; {'; '.join(parts[2:])}" if len(parts) > 2 else "")
