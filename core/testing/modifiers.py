"""``check_modifier``: what the host assumes of every modifier, checked step by step.

1. **registered**: the class is in the modifiers registry under some name (recipes name it);
2. **dataclass**: recipe fields map one to one onto constructor arguments;
3. **unknown fields**: a recipe with a field the class does not have is a ``RecipeError``;
4. **round trip**: YAML -> object -> YAML keeps every public field (``to_dict`` drops none);
5. **events**: through ``compress()`` the events come in order (initialize, calibration_start,
   sequential_epoch_end..., calibration_end, finalize), and no hook is left afterwards;
6. **calibration_inputs**: a modifier that names the inputs it reads hooks nothing else: only
   forward **pre**-hooks, only on the modules it named (the pipeline skips or cuts the rest);
7. **hooks after an error**: when a forward fails mid-calibration, the error propagates and every
   hook the modifier registered is gone.

The default model is a seeded 2-layer Llama built from its config (no download), calibrated on
random token batches; pass ``model_factory`` / ``batches`` for a modifier that needs another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from layerwise.errors import RecipeError
from layerwise.host.modifier import Modifier

from .errors import PluginCheckError

CHECK = "check_modifier"
#: the events a data-needing modifier must see, in this order (sequential_epoch_end may repeat)
EVENTS = ("on_initialize", "on_calibration_start", "on_sequential_epoch_end", "on_calibration_end", "on_finalize")


def tiny_llama(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """A seeded Llama small enough for a unit test, built offline from its config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def token_batches(count: int = 4, length: int = 16, vocab: int = 128, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``count`` tokenized samples of random ids (with their attention masks)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (1, length), generator=g) for _ in range(count)]
    return [{"input_ids": i, "attention_mask": torch.ones_like(i)} for i in ids]


def count_hooks(model: torch.nn.Module) -> int:
    """Forward and forward-pre hooks on every module of ``model``, less those that are part of the model's
    function (marked ``part_of_model``, such as an online rotation's): they are meant to stay."""
    return sum(sum(not getattr(hook, "part_of_model", False) for hook in (*m._forward_hooks.values(),
                                                                          *m._forward_pre_hooks.values()))
               for m in model.modules())


def check_modifier(cls: type[Modifier], fields: dict[str, Any] | None = None, *,
                   model_factory: Callable[[], torch.nn.Module] = tiny_llama,
                   batches: list[Any] | None = None) -> None:
    """Run every check on ``cls`` built with ``fields`` (give non-default values: the round trip
    can only lose what differs from the defaults). Raises :class:`PluginCheckError` on the first
    failure."""
    fields = dict(fields or {})
    name = _registered_name(cls)
    _check_dataclass(cls, name)
    _check_unknown_field(cls, name, fields)
    _check_round_trip(cls, name, fields)
    batches = token_batches() if batches is None else batches
    _check_events_and_hooks(cls, name, fields, model_factory, batches)
    _check_calibration_inputs(cls, name, fields, model_factory)
    if cls(**fields).requires_data:  # an instance: whether it needs data may depend on its fields
        _check_hooks_after_error(cls, name, fields, model_factory, batches)


def _fail(name: str, step: str, problem: str, fix: str = "") -> PluginCheckError:
    return PluginCheckError(CHECK, name, step, problem, fix)


def _registered_name(cls: type) -> str:
    from layerwise.host.plugin_manager import registry

    names = [n for n, obj in registry("modifiers").items() if obj is cls]
    if not names:
        raise _fail(cls.__name__, "registered", "the class is not in the modifiers registry, so no recipe can name it",
                    "register it from a layerwise_register_modifiers hookimpl of a module listed under the "
                    "'layerwise' entry-point group (GUIDE.md section 6)")
    return names[0]


def _check_dataclass(cls: type, name: str) -> None:
    if not (dataclasses.is_dataclass(cls) and issubclass(cls, Modifier)):
        raise _fail(name, "dataclass", "a modifier must be a @dataclass subclass of layerwise.Modifier",
                    "decorate the class with @dataclass so recipe fields map onto its constructor")


def _check_unknown_field(cls: type, name: str, fields: dict[str, Any]) -> None:
    from layerwise.host.recipe import parse_recipe

    try:
        parse_recipe({name: {**fields, "no_such_field_kit": 1}})
    except RecipeError as error:
        if "no_such_field_kit" not in str(error):
            raise _fail(name, "unknown fields", f"the error does not name the unknown field: {error}") from None
        return
    raise _fail(name, "unknown fields", "a recipe field the class does not have was accepted silently",
                "keep the class a plain dataclass (layerwise's recipe parser checks the fields) and do not "
                "accept **kwargs")


def _public_fields(modifier: Modifier) -> dict[str, Any]:
    return {f.name: getattr(modifier, f.name) for f in dataclasses.fields(modifier) if not f.name.startswith("_")}


def _check_round_trip(cls: type, name: str, fields: dict[str, Any]) -> None:
    from layerwise.host.recipe import parse_recipe, recipe_to_yaml

    original = cls(**fields)
    text = recipe_to_yaml([original])
    try:
        (again,) = parse_recipe(text)
    except Exception as error:
        raise _fail(name, "round trip", f"the saved recipe does not parse back: {type(error).__name__}: {error}",
                    "make to_dict() return only fields the constructor accepts") from error
    before, after = _public_fields(original), _public_fields(again)
    changed = [f for f in before if before[f] != after.get(f)]
    if changed or type(again) is not cls:
        shown = ", ".join(f"{f}: {before[f]!r} -> {after.get(f)!r}" for f in changed) or f"type {type(again)}"
        raise _fail(name, "round trip", f"YAML -> object -> YAML changes {shown}",
                    "to_dict() must keep every public field that differs from its default")


def _recording(modifier: Modifier, seen: list[str]) -> None:
    for event in EVENTS:
        method = getattr(modifier, event)

        def record(*args, _method=method, _event=event, **kwargs):
            seen.append(_event)
            return _method(*args, **kwargs)

        setattr(modifier, event, record)


def _check_events_and_hooks(cls: type, name: str, fields: dict[str, Any], model_factory, batches) -> None:
    import layerwise

    model = model_factory()
    before = count_hooks(model)
    modifier = cls(**fields)
    seen: list[str] = []
    needs_data = modifier.requires_data
    _recording(modifier, seen)
    try:
        layerwise.compress(model, [modifier], dataset=batches if needs_data else None, show_progress=False)
    except Exception as error:
        raise _fail(name, "events", f"compress() failed: {type(error).__name__}: {error}") from error
    if needs_data:  # initialize, calibration_start, epoch ends, calibration_end, finalize
        epochs = [e for e in seen if e == "on_sequential_epoch_end"]
        in_order = seen == ["on_initialize", "on_calibration_start", *epochs, "on_calibration_end", "on_finalize"]
    else:  # data-free: whatever the datafree pipeline fires, between initialize and finalize
        in_order = bool(seen) and seen[0] == "on_initialize" and seen[-1] == "on_finalize"
    if not in_order:
        raise _fail(name, "events", f"events came as {seen}", "events are fired by the host: a modifier must not "
                    "call its own on_* methods, nor replace them on the instance")
    left = count_hooks(model) - before
    if left:
        raise _fail(name, "hooks after success", f"{left} hook(s) left on the model after compress()",
                    "register hooks with Modifier.register_hook (the lifecycle removes those), or remove your own "
                    "in remove_hooks()")


def _check_calibration_inputs(cls: type, name: str, fields: dict[str, Any], model_factory) -> None:
    from layerwise.host.lifecycle import Lifecycle
    from layerwise.host.state import CompressionState

    model = model_factory()
    modifier = cls(**fields)
    lifecycle = Lifecycle(CompressionState(model, [modifier]))
    names = [n for n, _ in model.named_modules()]
    lifecycle.initialize()
    lifecycle.calibration_start()
    try:
        answer = modifier.calibration_inputs(names)
        if answer is None:
            return
        stray = set(answer) - set(names)
        if stray:
            raise _fail(name, "calibration_inputs", f"names modules that are not in the piece asked about: "
                        f"{sorted(stray)[:3]}", "answer with a subset of the names given")
        for module_name, module in model.named_modules():
            ids = {h.id for h in getattr(modifier, "_hooks", ())}
            if ids & set(module._forward_hooks):
                raise _fail(name, "calibration_inputs", f"it answers with inputs it reads, but registers a forward "
                            f"(output) hook on {module_name!r}; the layers cut skips that forward",
                            "read inputs with forward_pre hooks, or answer None (whole forwards)")
            if ids & set(module._forward_pre_hooks) and module_name not in answer:
                raise _fail(name, "calibration_inputs", f"it hooks the inputs of {module_name!r} but does not name "
                            f"it; the pipeline may skip that module's forward",
                            "include every module whose inputs a pre-hook reads")
    finally:
        lifecycle.remove_hooks()


class _InjectedFailure(RuntimeError):
    """The error the check raises inside calibration."""


def _check_hooks_after_error(cls: type, name: str, fields: dict[str, Any], model_factory, batches) -> None:
    import layerwise

    model = model_factory()
    before = count_hooks(model)
    blocks = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    calls = {"n": 0}

    def fail_later(module, args):
        calls["n"] += 1
        if calls["n"] > 1:
            raise _InjectedFailure("layerwise.testing: a forward failing mid-calibration")

    injected = blocks[len(blocks) // 2].register_forward_pre_hook(fail_later)
    try:
        layerwise.compress(model, [cls(**fields)], dataset=batches, show_progress=False)
    except Exception:  # noqa: BLE001, S110 -- the run is expected to fail; what matters is what it leaves
        pass
    else:
        injected.remove()
        raise _fail(name, "hooks after an error", "compress() succeeded although a forward raised mid-calibration",
                    "do not catch exceptions around model forwards")
    injected.remove()
    left = count_hooks(model) - before
    if left:
        raise _fail(name, "hooks after an error", f"{left} hook(s) left on the model after a failed run",
                    "register hooks with Modifier.register_hook (removed on every exit), or remove your own "
                    "in remove_hooks()")
