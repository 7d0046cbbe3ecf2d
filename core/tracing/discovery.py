"""Finding a model's repeated blocks from its structure, for models nothing else describes.

When no patch names sequential targets and the model class declares no
``_no_split_modules``, the blocks are still visible in the module tree: a
``ModuleList``/``Sequential`` whose children are all of one class (or one
parameter layout) and each hold Linear layers. A model has one such list per
tower (vision encoder, text decoder; encoder and decoder).

The rules, in order:

1. a candidate list has >= 2 children, none of them a bare Linear or a list (no forward),
   each holding at least one Linear (or transformers' ``Conv1D``), all of one class
   or one parameter layout (names and shapes), and no block used twice or sharing
   weights with another block (layer sharing is not a chain of distinct blocks);
2. a candidate inside another candidate's blocks is dropped (MoE experts stay
   part of their decoder layer);
3. per tower (the module holding the list) the longest list wins, ties broken by
   parameter count; lists nested in a list of lists are towers of their own.

Discovery reads structure only: no forward, so it works on a meta-device model.
Whether the forward calls the blocks, each once, is checked where the forward
runs anyway: the trace skips targets it never sees and refuses swallowed ones,
and ``layer_sequential`` checks that the blocks form a chain.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from layerwise.common.matching import is_linear_like

#: modules that hold others; ModuleList/ModuleDict have no forward, so they are never blocks
_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)
_NO_FORWARD = (torch.nn.ModuleList, torch.nn.ModuleDict)


@dataclass(frozen=True)
class BlockList:
    """One list of repeated blocks: ``encoder.layer`` holding 6 ``BertLayer``."""

    #: qualified name of the ``ModuleList``/``Sequential``
    name: str
    #: class name of the blocks (``A/B`` when same-layout blocks have several classes)
    block_class: str
    #: number of blocks
    count: int

    @property
    def pattern(self) -> str:
        """A ``re:`` target matching exactly this list's children."""
        prefix = re.escape(self.name) + r"\." if self.name else ""
        return f"re:{prefix}\\d+"

    def describe(self) -> str:
        """``6 x BertLayer (encoder.layer.0-5)``."""
        prefix = f"{self.name}." if self.name else ""
        return f"{self.count} x {self.block_class} ({prefix}0-{self.count - 1})"


@dataclass(frozen=True)
class DiscoveredBlocks:
    """The block lists found in a model, in definition order (empty when none)."""

    lists: tuple[BlockList, ...] = ()

    @property
    def targets(self) -> tuple[str, ...]:
        """Sequential-target entries that resolve to exactly the found blocks."""
        return tuple(block_list.pattern for block_list in self.lists)

    def describe(self) -> str:
        return ", ".join(block_list.describe() for block_list in self.lists) or "no repeated blocks"

    def __bool__(self) -> bool:
        return bool(self.lists)


def discover_blocks(model: torch.nn.Module) -> DiscoveredBlocks:
    """The repeated-block lists of ``model`` (see the module docstring for the rules)."""
    uses: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        uses[id(module)] = uses.get(id(module), 0) + 1
    modules = dict(model.named_modules())
    candidates = {name: found for name, module in modules.items()
                  if (found := _candidate(name, module, uses)) is not None}
    outermost = {name: found for name, found in candidates.items()
                 if not any(name.startswith(other + ".") for other in candidates if other != name)}
    best: dict[str, tuple[BlockList, int]] = {}
    for name, found in outermost.items():
        parent = name.rpartition(".")[0]
        tower = name if isinstance(modules.get(parent), _CONTAINERS) else parent
        size = sum(p.numel() for p in modules[name].parameters())
        if tower not in best or (found.count, size) > (best[tower][0].count, best[tower][1]):
            best[tower] = (found, size)
    kept = {found.name for found, _ in best.values()}
    return DiscoveredBlocks(tuple(found for name, found in outermost.items() if name in kept))


def _candidate(name: str, module: torch.nn.Module, uses: dict[int, int]) -> BlockList | None:
    if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
        return None
    children = list(module.children())
    if len(children) < 2 or len(children) != len(module._modules):
        return None
    seen: set[int] = set()
    for child in children:
        if is_linear_like(child) or isinstance(child, _NO_FORWARD) or not any(is_linear_like(m) for m in child.modules()):
            return None
        # weights used by two blocks are not a chain of blocks (stateless activations may be shared)
        inside = {id(m) for m in child.modules() if next(m.parameters(recurse=False), None) is not None}
        if uses.get(id(child), 0) > 1 or inside & seen:
            return None
        seen |= inside
    classes = list(dict.fromkeys(type(child).__name__ for child in children))
    if len(classes) > 1 and len({_layout(child) for child in children}) > 1:
        return None
    return BlockList(name, "/".join(classes), len(children))


def _layout(module: torch.nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((name, tuple(p.shape)) for name, p in module.named_parameters())
