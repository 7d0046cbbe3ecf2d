"""What the generated package will say about an architecture, found on its tiny model.

:func:`plan_patch` builds the tiny model (seeded random weights, CPU, no download) and
reads off everything a :class:`~layerwise.ModelPatch` declares: the repeated blocks
(:func:`~layerwise.tracing.discovery.discover_blocks`, written as class names when those
select exactly the blocks), the output head to leave alone, the model type, and the
class names that match. The plan is plain data; rendering and writing come after.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .architecture import resolve_architecture
from .errors import ScaffoldError
from .tiny_config import build_config, default_values, tiny_config_fields

if TYPE_CHECKING:
    from ..tracing.discovery import DiscoveredBlocks

#: what ``--name`` may be: it becomes a distribution, a module and a patch name
_SLUG = re.compile(r"[a-z][a-z0-9_]*")
#: the modalities the generated ``sample_inputs`` can build
MODALITIES = ("text", "audio")
#: the seed every tiny model is built with
SEED = 0


@dataclass(frozen=True)
class PatchPlan:
    """Everything the generated package states about one architecture."""

    #: the model class (``MistralForCausalLM``)
    architecture: str
    #: its config class and the module to import it from (``transformers`` when exported there)
    config_class: str
    config_module: str
    #: the keyword arguments that make the config tiny (sub-configs as nested dicts)
    config_fields: dict[str, Any]
    #: the class defaults of those fields, shown beside them in the generated code
    config_defaults: dict[str, Any]
    #: every field the tiny config has at its top level (set or by default)
    config_keys: frozenset[str]
    #: ``config.model_type`` (``mistral``)
    model_type: str
    #: the name of the patch, the plugin and (prefixed) the distribution and the module
    slug: str
    architectures: tuple[str, ...]
    sequential_targets: tuple[str, ...]
    ignore: tuple[str, ...]
    #: ``text`` or ``audio``
    modality: str
    #: whether the forward also needs ``decoder_input_ids``
    encoder_decoder: bool
    #: the block lists found, for messages and comments (``2 x MistralDecoderLayer (model.layers.0-1)``)
    blocks: tuple[str, ...]

    @property
    def distribution(self) -> str:
        return "layerwise-" + self.slug.replace("_", "-")

    @property
    def module(self) -> str:
        return "layerwise_" + self.slug

    @property
    def constant(self) -> str:
        return self.slug.upper()

    @property
    def builder(self) -> str:
        return f"tiny_{self.slug}"

    @property
    def family(self) -> str:
        """A human name for messages: the class name up to ``For...``/``Model`` (``Mistral``)."""
        return re.split(r"For[A-Z]|Model$|LMHead", self.architecture)[0] or self.architecture


def slug_for(text: str) -> str:
    """``gpt_neox`` for ``gpt-neox``/``GPT_NeoX``; an error naming the rule when nothing usable is left."""
    slug = re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")
    if not _SLUG.fullmatch(slug):
        raise ScaffoldError(f"--name {text!r} cannot name a package: use lowercase letters, digits and '_' or '-', "
                            f"starting with a letter (e.g. --name my_mistral)")
    return slug


def plan_patch(architecture: str, name: str | None = None) -> PatchPlan:
    """Resolve ``architecture``, build its tiny model and read off the patch (a :class:`ScaffoldError` if it cannot)."""
    slug = slug_for(name) if name else None  # a bad --name fails before any model is built
    model_class = resolve_architecture(architecture)
    fields = tiny_config_fields(model_class.config_class, architecture)
    model = build_tiny_model(model_class, fields)
    config = model.config
    modality = _modality(architecture, config)
    found = _discovered(model)
    targets = _targets(architecture, model, found)
    return PatchPlan(
        architecture=architecture,
        config_class=model_class.config_class.__name__,
        config_module=_import_module(model_class.config_class),
        config_fields=fields,
        config_defaults=default_values(model_class.config_class, fields),
        config_keys=frozenset(config.to_dict()),
        model_type=str(config.model_type),
        slug=slug or slug_for(str(config.model_type)),
        architectures=_architectures(model),
        sequential_targets=targets,
        ignore=_ignore(model),
        modality=modality,
        encoder_decoder=bool(getattr(config, "is_encoder_decoder", False)),
        blocks=tuple(block_list.describe() for block_list in found.lists),
    )


def build_tiny_model(model_class: type, fields: dict[str, Any]) -> torch.nn.Module:
    """``model_class(config_class(**fields))`` with seeded random weights, in eval mode."""
    config = build_config(model_class.config_class, fields)
    torch.manual_seed(SEED)
    try:
        return model_class(config).eval()
    except Exception as error:  # the shrunk sizes disagree somewhere: say so, and the fix
        raise ScaffoldError(f"{model_class.__name__} cannot be built from the tiny config "
                            f"({type(error).__name__}: {error}); write the tiny config by hand") from error


def _modality(architecture: str, config: Any) -> str:
    from ..tracing.samples import default_modality

    modality = default_modality(config)
    if modality not in MODALITIES:
        raise ScaffoldError(f"{architecture} takes {modality} inputs: new-patch generates text and audio models "
                            f"only; write its tiny model and sample_inputs by hand (the zoo's llava.py shows "
                            f"image inputs)")
    return modality


def _discovered(model: torch.nn.Module) -> DiscoveredBlocks:
    from ..tracing.discovery import discover_blocks

    return discover_blocks(model)


def _targets(architecture: str, model: torch.nn.Module, found: DiscoveredBlocks) -> tuple[str, ...]:
    """The block class names when they select exactly the discovered blocks, else one ``re:`` per list."""
    from ..tracing.suggest import portable_targets
    from ..tracing.targets import resolve_modules

    if not found:
        raise ScaffoldError(f"{architecture}'s tiny model has no repeated blocks to discover (no list of two or "
                            f"more same-shaped layers holding Linear layers), so there is nothing to calibrate "
                            f"one at a time; write sequential_targets by hand, or calibrate it with the basic "
                            f"pipeline (no patch needed)")
    return portable_targets(model, list(resolve_modules(model, found.targets)))


def _ignore(model: torch.nn.Module) -> tuple[str, ...]:
    """The output head: ``lm_head`` when it is a Linear of that name, else its qualified name; none without one."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return ()
    names = [name for name, module in model.named_modules() if module is head and name]
    if isinstance(head, torch.nn.Linear) and "lm_head" in names:
        return ("lm_head",)
    return tuple(names[:1])


def _architectures(model: torch.nn.Module) -> tuple[str, ...]:
    """The class, and its base model's class (``MistralModel``) when ``base_model_prefix`` leads to one."""
    from transformers import PreTrainedModel

    names = [type(model).__name__]
    base = getattr(model, getattr(model, "base_model_prefix", "") or "", None)
    if isinstance(base, PreTrainedModel) and type(base).__name__ not in names:
        names.append(type(base).__name__)
    return tuple(names)


def _import_module(config_class: type) -> str:
    """``transformers`` when the class is exported there (the usual case), else its own module."""
    import transformers

    name = config_class.__name__
    return "transformers" if getattr(transformers, name, None) is config_class else config_class.__module__


def tiny_model(plan: PatchPlan) -> torch.nn.Module:
    """The plan's tiny model again, as the generated ``tiny_<slug>()`` builds it."""
    return build_tiny_model(resolve_architecture(plan.architecture), plan.config_fields)
