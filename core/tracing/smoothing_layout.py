"""Smoothing mappings found from a model's layout, each proven exact before it is used.

SmoothQuant and AWQ need to know which module produces the input of which layers (a model patch's
``smoothing_mappings``, or a recipe's ``mappings``). A model no patch describes (Qwen2, Mistral and
the other decoders transformers ships in Llama's layout) has them all the same; :func:`discover_mappings`
finds them in two steps:

1. **layout**: the :data:`CANDIDATES` (Llama's four: the input norm feeds q/k/v, ``v_proj`` feeds
   ``o_proj``, the post-attention norm feeds gate/up, ``up_proj`` feeds ``down_proj``) whose patterns
   match modules of the model and resolve there (:func:`~layerwise.algorithms.quantization.mappings.resolve_mappings`:
   a norm with no balance layer near it, or a width that does not match, is no mapping);
2. **proof**: each candidate is applied with random positive scales to a *tiny twin* of the model
   (the same class, its config's sizes shrunk, seeded) and must leave the twin's outputs unchanged:
   the identity the zoo's mappings are held to (``tests/model_zoo/test_zoo_mappings.py``). A norm that
   is not the layers' only input path, a post-norm, or a ``1 + w`` norm handled wrongly fails here,
   and the candidate is dropped with the reason.

The proof costs a twin of two layers and two forwards per candidate, whatever the model's size (its
weights may be on the meta device or streamed from disk: only names and shapes are read from it), and
is done once per model class and config.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass

import torch

from layerwise.algorithms.quantization.mappings import Mapping, MappingError, resolve_mappings
from layerwise.algorithms.quantization.smoothing import apply_smoothing
from layerwise.algorithms.quantization.storage import linear_weight

log = logging.getLogger("layerwise")

#: the mappings of a Llama-like decoder layer, tried in this order
CANDIDATES: tuple[Mapping, ...] = (
    (("re:.*q_proj", "re:.*k_proj", "re:.*v_proj"), "re:.*input_layernorm"),
    (("re:.*o_proj",), "re:.*v_proj"),
    (("re:.*gate_proj", "re:.*up_proj"), "re:.*post_attention_layernorm"),
    (("re:.*down_proj",), "re:.*up_proj"),
)
#: the twin's sizes (only the fields its config has are set)
TWIN_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "vocab_size": 128, "max_position_embeddings": 64}
#: outputs of the twin before and after smoothing must agree this closely (float32)
TOLERANCE = 1e-5


@dataclass(frozen=True)
class Discovery:
    """The mappings found and proven, and each candidate dropped with the reason."""

    mappings: tuple[Mapping, ...]
    dropped: tuple[tuple[Mapping, str], ...] = ()

    def why_none(self) -> str:
        reasons = "; ".join(f"{smoothed} -> {', '.join(balance)}: {why}" for (balance, smoothed), why in self.dropped)
        return reasons or "no candidate"


_PROVEN: dict[tuple[type, str, tuple[Mapping, ...]], Discovery] = {}


def discover_mappings(model: torch.nn.Module) -> Discovery:
    """The smoothing mappings of a Llama-like decoder, each proven exact on a tiny twin of ``model``."""
    resolving, dropped = [], []
    for candidate in CANDIDATES:
        why = _resolves(model, candidate)
        if why:
            dropped.append((candidate, why))
        else:
            resolving.append(candidate)
    if not resolving:
        return Discovery((), tuple(dropped))
    key = (type(model), _config_key(model), tuple(resolving))
    if key not in _PROVEN:
        _PROVEN[key] = _prove(model, tuple(resolving))
    proven = _PROVEN[key]
    found = tuple(c for c in resolving if c in proven.mappings)
    return Discovery(found, (*dropped, *((c, why) for c, why in proven.dropped if c in resolving)))


def _resolves(model: torch.nn.Module, candidate: Mapping) -> str:
    """Why ``candidate`` is no mapping of ``model`` ("" when it is one)."""
    try:
        resolution = resolve_mappings(model, [candidate], owner="layout")
    except MappingError:
        return "the layout has no such modules"
    if not resolution.mappings:
        return "; ".join(sorted({why for _, why in resolution.skipped})) or "nothing to pair"
    return ""


def _prove(model: torch.nn.Module, candidates: tuple[Mapping, ...]) -> Discovery:
    try:
        twin = tiny_twin(model)
        inputs = _twin_inputs(twin)
        expected = _outputs(twin, inputs)
    except Exception as exc:  # noqa: BLE001  (any model class may fail to build small: then nothing is proven)
        why = f"no tiny twin of {type(model).__name__} to prove it on ({type(exc).__name__}: {exc})"
        return Discovery((), tuple((c, why) for c in candidates))
    proven, dropped = [], []
    generator = torch.Generator().manual_seed(0)
    for candidate in candidates:
        why = _resolves(twin, candidate)
        if why:
            dropped.append((candidate, f"not provable on the tiny twin ({why})"))
            continue
        smoothed = copy.deepcopy(twin)
        for mapping in resolve_mappings(smoothed, [candidate], owner="layout").mappings:
            width = linear_weight(smoothed.get_submodule(mapping.balance[0])).shape[1]
            apply_smoothing(smoothed, mapping, torch.rand(width, generator=generator) * 3.9 + 0.1)
        got = _outputs(smoothed, inputs)
        error = (got - expected).abs().max().item() / max(expected.abs().max().item(), 1e-12)
        if error <= TOLERANCE:
            proven.append(candidate)
        else:
            dropped.append((candidate, f"changes the tiny twin's outputs (relative error {error:.1e}): not exact "
                                       f"for this architecture"))
    return Discovery(tuple(proven), tuple(dropped))


def tiny_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A seeded float32 model of ``model``'s class with its config's sizes shrunk (grouped-query attention kept
    as grouped, or not)."""
    config = copy.deepcopy(model.config)
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    for name, size in TWIN_SIZES.items():
        if hasattr(config, name):
            setattr(config, name, size)
    if kv_heads is not None:
        config.num_key_value_heads = TWIN_SIZES["num_attention_heads"] if kv_heads == heads else 2
    if getattr(config, "head_dim", None) is not None:
        config.head_dim = TWIN_SIZES["hidden_size"] // TWIN_SIZES["num_attention_heads"]
    for name, value in list(vars(config).items()):  # per-layer lists (layer_types, ...) follow the depth
        if isinstance(value, list) and layers and len(value) == layers:
            setattr(config, name, value[:TWIN_SIZES["num_hidden_layers"]])
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= TWIN_SIZES["vocab_size"]:
            setattr(config, name, None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        twin = type(model)(config)
    return twin.to(torch.float32).eval()


def _twin_inputs(twin: torch.nn.Module) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, TWIN_SIZES["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@torch.no_grad()
def _outputs(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**inputs, use_cache=False)
    return (out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))).detach().to(torch.float32)


def _config_key(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    try:
        return config.to_json_string(use_diff=False) if config is not None else ""
    except (TypeError, ValueError, AttributeError):
        return json.dumps(repr(config))


def describe(mappings: tuple[Mapping, ...]) -> str:
    """``input_layernorm -> q_proj, k_proj, v_proj; ...`` for a log line."""
    return "; ".join(f"{_bare(smoothed)} -> {', '.join(_bare(b) for b in balance)}" for balance, smoothed in mappings)


def _bare(pattern: str) -> str:
    return pattern.removeprefix("re:.*")

