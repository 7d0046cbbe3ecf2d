"""Which transformers class a checkpoint folder holds: the task head comes from the weights.

A config.json without ``architectures`` (or naming a class transformers does not have,
as an ``auto_map`` model does) used to load as the bare base model (``AutoModel``), so
``lm_head`` was dropped and the saved model could no longer generate. Here the weights'
names decide: each task class that knows the config is built on the meta device, and the
one whose parameter names match the most checkpoint keys exactly wins (a ``model.``
prefix and an ``lm_head.weight`` point at ``*ForCausalLM``; keys saved by the base
model match ``AutoModel``). Ties keep the order of :data:`AUTO_CLASSES`.

:func:`dropped_keys_error` is the second half of the contract: checkpoint keys that
the loaded class did not use are an error naming them, never a silent headless save.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from layerwise.errors import ModelLoadError

#: auto classes tried, most specific first; ties between equally good matches keep this order
AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM",
                "AutoModelForSequenceClassification", "AutoModelForTokenClassification",
                "AutoModelForQuestionAnswering", "AutoModel")
#: how many dropped keys an error lists before "..."
_SHOWN = 8


def checkpoint_keys(folder: str | Path) -> set[str] | None:
    """Tensor names in a folder's safetensors weights (index, else file headers); ``None`` if unknown."""
    folder = Path(folder).expanduser()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return set(json.loads(index.read_text())["weight_map"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    keys: set[str] = set()
    try:
        for file in files:
            with safe_open(file, framework="pt") as handle:
                keys.update(handle.keys())
    except Exception:  # noqa: BLE001 - a broken file is explained by the loader's own error
        return None
    return keys


def named_class(config: Any) -> type | None:
    """The transformers class ``architectures`` names, if transformers has it."""
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return None


def candidate_classes(config: Any) -> list[type]:
    """The task classes transformers maps this config to, in :data:`AUTO_CLASSES` order."""
    import transformers

    found: list[type] = []
    for auto_name in AUTO_CLASSES:
        mapping = getattr(getattr(transformers, auto_name, None), "_model_mapping", None)
        try:
            cls = mapping[type(config)] if mapping is not None else None
        except (KeyError, ValueError, AttributeError):
            continue
        if isinstance(cls, (list, tuple)):
            cls = cls[0]
        if cls is not None and cls not in found:
            found.append(cls)
    return found


def expected_keys(cls: type, config: Any) -> set[str]:
    """Parameter and buffer names of ``cls`` built for ``config`` (on meta: no memory, no init)."""
    with torch.device("meta"):
        model = cls(config)
    return set(model.state_dict())


def best_class(config: Any, keys: set[str]) -> type | None:
    """The candidate class whose own names match the most of ``keys``; ``None`` if none matches."""
    best, best_score = None, 0
    for cls in candidate_classes(config):
        try:
            score = len(keys & expected_keys(cls, config))
        except Exception:  # noqa: BLE001 - a class that cannot be built for this config is no candidate
            score = 0
        if score > best_score:
            best, best_score = cls, score
    return best


def dropped_keys_error(where: str, cls: type, dropped: list[str]) -> ModelLoadError:
    """The error for checkpoint weights the loaded class does not use (a head that would be lost)."""
    shown = ", ".join(sorted(dropped)[:_SHOWN]) + (", ..." if len(dropped) > _SHOWN else "")
    return ModelLoadError(
        f"'{where}' holds {len(dropped)} weight(s) that {cls.__name__} does not use ({shown}); compressing it "
        f"would save the model without them. Fix: set \"architectures\" in its config.json to the class that "
        f"holds those weights (for example the *ForCausalLM or *ForSequenceClassification class of its "
        f"model_type), or load the model yourself and pass the module to layerwise.compress()")


def checkpoint_class(config: Any, path: Path, keys: set[str] | None = None) -> type:
    """The class ``architectures`` names, else the task class the weights' names fit, else AutoModel.

    ``keys`` are the weights' names when the caller has them (decoded sparse tensors), else the
    folder's checkpoint is asked.
    """
    import transformers

    named = named_class(config)
    if named is not None:
        return named
    if keys is None:
        keys = checkpoint_keys(path) if path.is_dir() else None
    return (best_class(config, keys) if keys else None) or transformers.AutoModel
