"""``layerwise trace --suggest-patch``: a ready-to-paste ``ModelPatch`` for a model no patch covers.

What discovery found holds for one model instance; a patch states it for the whole
family, so targets are written as block class names when those select exactly the
same modules (they then hold for ``...Model`` and ``...ForCausalLM`` alike), and the
Linear layers outside the blocks (task heads, projections) are proposed as ``ignore``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import torch

from layerwise.common.matching import is_linear_like

from .targets import resolve_modules


def portable_targets(model: torch.nn.Module, target_names: Sequence[str]) -> tuple[str, ...]:
    """The block class names when they select exactly ``target_names``, else one regex per block list."""
    wanted = set(target_names)
    modules = dict(model.named_modules())
    classes = tuple(dict.fromkeys(type(modules[name]).__name__ for name in target_names))
    if set(resolve_modules(model, classes)) == wanted:
        return classes
    lists = dict.fromkeys(name.rpartition(".")[0] for name in target_names)
    return tuple(f"re:{re.escape(prefix)}\\.\\d+" if prefix else "re:\\d+" for prefix in lists)


def outside_linears(model: torch.nn.Module, target_names: Sequence[str]) -> list[str]:
    """Qualified names of Linear layers outside every target (heads, poolers, projections)."""
    return [name for name, module in model.named_modules()
            if name and is_linear_like(module) and not any(name.startswith(t + ".") for t in target_names)]


def suggest_patch(model: torch.nn.Module, target_names: Sequence[str]) -> str:
    """Python source of a ``ModelPatch`` and its registration for ``model``'s family.

    ``target_names`` are the qualified names of the blocks the trace ran (``result.target_names``).
    """
    config = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", "") or type(model).__name__.lower())
    slug = re.sub(r"\W+", "_", model_type).strip("_") or "model"
    architectures = dict.fromkeys([type(model).__name__, *(getattr(config, "architectures", None) or [])])
    ignore = outside_linears(model, target_names)
    lines = [
        f"# {slug}.py -- a starting point: check the targets and the ignore list, add sample_inputs and a",
        "# test (GUIDE.md, section 5, \"Writing a model patch\"); `layerwise new-patch` makes a whole plugin",
        "# package around it, with the test.",
        "import transformers",
        "",
        "from layerwise import ModelPatch, hookimpl",
        "",
        f"{slug.upper()} = ModelPatch(",
        f"    name={_str(slug)},",
        f"    model_types={_tuple([model_type])},",
        f"    architectures={_tuple(architectures)},",
        f"    sequential_targets={_tuple(portable_targets(model, target_names))},",
        "    # Linear layers outside the blocks (heads, projections): usually kept in full precision",
        f"    ignore={_tuple(ignore)},",
        "    # the releases this patch was checked with: this one, until the tests pass on others",
        "    verified_transformers=(transformers.__version__, transformers.__version__),",
        ")",
        "",
        "",
        "@hookimpl",
        "def layerwise_register_model_patches(register):",
        f"    register({slug.upper()})",
    ]
    return "\n".join(lines) + "\n"


def _tuple(items: Sequence[str] | dict[str, None]) -> str:
    items = list(items)
    return "(" + ", ".join(_str(i) for i in items) + ("," if len(items) == 1 else "") + ")"


def _str(text: str) -> str:
    """A double-quoted Python literal, as the zoo writes them (JSON escapes are Python's)."""
    return json.dumps(text)
