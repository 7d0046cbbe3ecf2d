"""From the architecture name a user types to the transformers model class it names.

The name is what a checkpoint's ``config.json`` lists under ``architectures``
(``MistralForCausalLM``), so the errors point back there: a typo gets the closest
names transformers exports, a configuration or auto class gets the model classes
it stands for.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import did_you_mean
from .errors import ScaffoldError

#: the end of the hint every "not a model" error shares
_WHERE = "name a model class, as a checkpoint's config.json lists it under \"architectures\""


def model_class_names() -> list[str]:
    """The names transformers exports that look like model classes (``...Model``, ``...For...``)."""
    import transformers

    return [name for name in dir(transformers)
            if name[:1].isupper() and not name.startswith(("Auto", "TF", "Flax"))
            and (name.endswith("Model") or "For" in name)]


def resolve_architecture(name: str) -> type:
    """The ``transformers`` model class called ``name``; a :class:`ScaffoldError` naming the fix otherwise."""
    import transformers
    from transformers import PreTrainedConfig, PreTrainedModel

    if not name.isidentifier() or not hasattr(transformers, name):
        hint = did_you_mean(name, model_class_names())
        raise ScaffoldError(f"transformers {transformers.__version__} has no architecture {name!r};{hint or ''} "
                            f"{_WHERE} (e.g. MistralForCausalLM)")
    try:
        cls: Any = getattr(transformers, name)
    except Exception as error:  # a backend transformers imports lazily (timm, ...) is missing
        raise ScaffoldError(f"transformers cannot import {name}: {type(error).__name__}: {error}; install what "
                            f"it names, then run new-patch again") from error
    if (isinstance(cls, type) and issubclass(cls, PreTrainedModel) and getattr(cls, "config_class", None)
            and not name.endswith("PreTrainedModel")):
        return cls
    raise ScaffoldError(f"{name} is not a model class ({_kind(cls, PreTrainedConfig)}); {_WHERE}"
                        f"{_siblings(name)}")


def _kind(obj: Any, config_base: type) -> str:
    if isinstance(obj, type) and obj.__name__.endswith("PreTrainedModel"):
        return "it is the base class of a family's models, with no layers of its own"
    if isinstance(obj, type) and issubclass(obj, config_base):
        return "it is a configuration class"
    if isinstance(obj, type) and obj.__name__.startswith("Auto"):
        return "it is an auto class, which picks a model class from a config"
    if isinstance(obj, type):
        return f"it is a {obj.__mro__[1].__name__} subclass"
    return f"it is a {type(obj).__name__}"


def _siblings(name: str) -> str:
    """``; for example LlamaModel, LlamaForCausalLM`` for ``LlamaConfig``: the model classes of its family."""
    for suffix in ("Config", "TextConfig", "Tokenizer", "TokenizerFast", "Processor", "PreTrainedModel"):
        if name.endswith(suffix) and len(name) > len(suffix):
            family = name[: -len(suffix)]
            own = re.compile(re.escape(family) + r"(Model|For[A-Z]\w*)")
            found = sorted((n for n in model_class_names() if own.fullmatch(n)), key=len)
            if found:
                return f"; {family} has: {', '.join(found[:6])}"
    return ""
