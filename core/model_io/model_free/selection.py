"""Which tensors of a checkpoint a data-free recipe quantizes, by name and shape alone.

A *layer* is a 2-D floating ``<module>.weight`` tensor; the module name is what targets and
ignore entries match, with the syntax recipes use everywhere (:mod:`layerwise.common.matching`):

* ``Linear`` -- every layer but embeddings (a module name whose last part names an embedding:
  ``embed_tokens``, ``wte``, ``word_embeddings``, ...): without the model class, an embedding table
  and a Linear weight look alike, and these names are how checkpoints spell them;
* ``re:<regex>`` -- matched in full against the module name (an entry matching only a block holding
  layers, written for llm-compressor's prefix match, is warned about or refused with the pattern to write);
* an exact module name (``lm_head``).

Any other class name cannot be told from a name: it is an error that says to write a pattern.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from layerwise.common.matching import (
    DEFAULT_IGNORE,
    closest_entries,
    inside_pattern,
    regex,
    warn_block_ignore,
)
from layerwise.common.matching import warn_unmatched_ignore as warn_unmatched
from layerwise.model_io.streaming.safetensors_io import StoredTensor

#: the last part of an embedding's module name in transformers checkpoints
EMBEDDING = re.compile(r"(.*_)?(embed_tokens|embeddings?|embed_in|wte|wpe|word_embeddings|position_embeddings|"
                       r"token_type_embeddings|shared|embed_positions|tok_embeddings)")
FLOATING = ("F64", "F32", "F16", "BF16")


@dataclass(frozen=True)
class Layer:
    """A quantizable weight: its module name, tensor name, shape and where it is stored."""

    module: str
    tensor: str
    rows: int
    columns: int
    stored: StoredTensor
    file: str


def layers(tensors: Mapping[str, tuple[str, StoredTensor]]) -> dict[str, Layer]:
    """Every 2-D floating ``*.weight`` tensor of ``tensors`` (name -> (file, stored)), by module name."""
    found = {}
    for name, (file, stored) in tensors.items():
        if name.endswith(".weight") and len(stored.shape) == 2 and stored.dtype in FLOATING:
            module = name[: -len(".weight")]
            found[module] = Layer(module, name, stored.shape[0], stored.shape[1], stored, file)
    return found


def is_embedding(module: str) -> bool:
    return EMBEDDING.fullmatch(module.rsplit(".", 1)[-1]) is not None


class SelectionError(ValueError):
    """A target or ignore entry that cannot be matched on tensor names (the message names the fix)."""


def matches(module: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return regex(pattern).fullmatch(module) is not None
    if pattern == "Linear":
        return not is_embedding(module)
    return pattern == module


def check_patterns(patterns: Iterable[str], modules: list[str], owner: str, kind: str, *,
                   allow_unmatched: bool = False) -> None:
    """Refuse a class name other than ``Linear`` and (unless allowed) an entry that matches no layer."""
    for pattern in patterns:
        if not pattern.startswith("re:") and pattern != "Linear" and "." not in pattern and pattern not in modules \
                and pattern[:1].isupper():
            raise SelectionError(f"{owner}: {kind} {pattern!r} looks like a class name, and model-free compression "
                                 f"sees tensor names only: write it as a pattern on module names, e.g. "
                                 f"'re:.*mlp\\..*_proj' (or 'Linear' for every layer but embeddings)")
        if allow_unmatched or any(matches(m, pattern) for m in modules):
            continue
        blocks = block_names(pattern, modules)
        close = closest_entries(pattern, modules, n=3)
        hint = f" did you mean {', '.join(map(repr, close))}?" if close else ""
        if blocks:
            fix = inside_pattern(pattern if "." in pattern or pattern.startswith("re:") else blocks[0])
            hint = (f" it matches only blocks holding layers ({blocks[0]!r}, ...): an 're:' entry matches the whole "
                    f"module name (llm-compressor's its start), so write '{fix}';")
        shown = ", ".join(modules[:4]) + (f", ... ({len(modules)} layers)" if len(modules) > 4 else "")
        raise SelectionError(f"{owner}: {kind} {pattern!r} matches no layer of the checkpoint;{hint} layers (module "
                             f"names of its 2-D weights): {shown or '(none)'}")


def block_names(pattern: str, modules: list[str]) -> list[str]:
    """The names of modules holding layers (``model.layers.0.mlp``, the dotted prefixes of layer names) that
    ``pattern`` matches, when it matches no layer itself: an entry written for llm-compressor's prefix match."""
    if any(matches(m, pattern) for m in modules):
        return []
    prefixes = dict.fromkeys(".".join(m.split(".")[:i]) for m in modules for i in range(1, m.count(".") + 1))
    return [p for p in prefixes if (regex(pattern).fullmatch(p) if pattern.startswith("re:") else p == pattern)]


def warn_unmatched_ignore(ignore: Iterable[str], modules: list[str], owner: str) -> None:
    """A recipe's ignore entries matching no layer, warned about as in memory (one matching only blocks, with
    the pattern that keeps their layers out)."""
    missing = [entry for entry in ignore if entry not in DEFAULT_IGNORE and not any(matches(m, entry) for m in modules)]
    blocks = {entry: found for entry in missing if (found := block_names(entry, modules))}
    warn_block_ignore(owner, blocks)
    warn_unmatched(owner, [entry for entry in missing if entry not in blocks], modules, "layer of the checkpoint")


def select(all_layers: Mapping[str, Layer], targets: list[str], ignore: list[str], owner: str) -> list[str]:
    """The module names ``targets`` select minus ``ignore``, in checkpoint order; an unmatched target is an error
    (an ignore entry may match nothing: the default ``lm_head`` of a model with tied embeddings)."""
    modules = list(all_layers)
    check_patterns(targets, modules, owner, "target")
    check_patterns(ignore, modules, owner, "ignore entry", allow_unmatched=True)
    return [m for m in modules if any(matches(m, t) for t in targets) and not any(matches(m, i) for i in ignore)]
