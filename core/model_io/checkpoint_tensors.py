"""Reading a saved folder's tensors by name: its safetensors files, the input quantization parameters it saved,
and checkpoint names as transformers renames them on load (shared by the compressed loader and the experts')."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from layerwise.errors import ModelLoadError


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"cannot read '{index}' ({exc}); it must map every tensor name to its shard "
                                 f"(\"weight_map\"): copy or save the model again") from exc
        files = [folder / name for name in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"'{index}' names shard(s) that are not in the folder: {', '.join(absent)}; "
                                 f"copy the missing files or save the model again")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"'{folder}' has no .safetensors weights; sparse layouts are read from safetensors "
                             f"files only: save the model again with layerwise (or save_pretrained)")
    return files


#: the tensors a layer's calibrated input quantization is saved as (compressed-tensors' names)
INPUT_QPARAMS = ("input_scale", "input_zero_point", "input_global_scale")


def saved_input_qparams(folder: Path, within: str = "", rename: Callable[[str], str] = str,
                         ) -> dict[str, dict[str, torch.Tensor]]:
    """The folder's saved input quantization parameters of the layers whose name holds ``within``:
    ``{layer: {"input_scale": tensor, ...}}``, each key ``rename``-d first (only those tensors are read)."""
    from safetensors import safe_open

    found: dict[str, dict[str, torch.Tensor]] = {}
    for file in weight_files(folder):
        with safe_open(str(file), "pt") as tensors:
            names = tensors.keys()  # a safetensors file is not iterable
            for key in names:
                layer, _, param = rename(key).rpartition(".")
                if param in INPUT_QPARAMS and within in f".{layer}.":
                    found.setdefault(layer, {})[param] = tensors.get_tensor(key)
    return found


def renamed_as_loaded(model: torch.nn.Module) -> Callable[[str], str]:
    """A checkpoint key as transformers names it in ``model`` (Mixtral's ``block_sparse_moe`` is the model's
    ``mlp``): its own renaming rules, which it applied to the tensors it loaded and not to the ones it left out."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers without renaming rules loads the saved names as they are
        return str
    renamings = [rule for rule in get_model_conversion_mapping(model) if isinstance(rule, WeightRenaming)]
    return lambda key: rename_source_key(key, renamings, [])[0]


def prefixed_names(name: str, prefix: str) -> list[str]:
    """``name`` as it may appear across a head / base model pair: itself, without the base model's ``prefix``
    (a head checkpoint loaded into its base model) and with it (a base checkpoint loaded under a head)."""
    return [name, name.removeprefix(f"{prefix}."), f"{prefix}.{name}"] if prefix else [name]


def named_entry(saved: dict[str, Any], name: str, prefix: str) -> Any:
    """``saved``'s entry for module ``name`` (:func:`prefixed_names`), else ``{}``."""
    return next((saved[n] for n in prefixed_names(name, prefix) if n in saved), {})
