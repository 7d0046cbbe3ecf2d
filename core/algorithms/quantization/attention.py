"""Reaching the keys, values and queries an attention layer computes with: after the rotary embedding, as
they enter the attention function (what vLLM's KV cache stores).

transformers' attention modules (5.x) compute q/k/v, rotate them, update the cache, then call the function
``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, ...)`` with
``(module, query, key, value, mask, ...)``. :func:`attach` gives one attention module a shallow copy of its
config whose implementation is named ``layerwise_fp8|<original>``, registered once as :func:`_dispatch`:
that function finds the module's :class:`AttentionQuantization`, lets its observers see q/k/v, fake-quantizes
them with the calibrated scales, and calls the original function (sdpa, flash, or the modeling file's eager
one). The model's own config is untouched (masks, saving and other models see nothing), and the hook works
the same with the cache on or off: layerwise calibrates with it off, block by block, and the keys then are
exactly the tokens' own. With the cache on the function receives every cached key, quantized again with the
same scale, which gives the same values (FP8 values are fixed points of the rounding).

Which modules are attention layers: the model patch's ``attention_modules`` if it names them (class names,
qualified names or ``re:`` patterns: a VLM's patch names its text decoder's attention only, since a vision
encoder has no KV cache in vLLM), else every module whose class name ends in ``Attention`` and which has
``k_proj`` and ``v_proj`` children and a ``config`` (what transformers' attention modules have).
"""

from __future__ import annotations

import copy
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.kv_cache import fake_quantize_kv
from layerwise.common.matching import matches

#: the attribute of an attention module that holds its :class:`AttentionQuantization`
STATE_ATTR = "_layerwise_attention"
#: the prefix of the attention implementations registered by :func:`attach`
IMPLEMENTATION_PREFIX = "layerwise_fp8|"
#: the scales an attention module stores, by the states they scale
SCALE_NAMES = {"query": "q_scale", "key": "k_scale", "value": "v_scale"}

Observer = Callable[[str, Tensor], None]


class AttentionError(ValueError):
    """An attention module layerwise cannot reach (no config, an unknown attention implementation)."""


def find_attention_modules(model: nn.Module, names: Iterable[str] = ()) -> dict[str, nn.Module]:
    """The attention layers of ``model`` by qualified name: the modules ``names`` (a model patch's
    ``attention_modules``: class names, qualified names or ``re:`` patterns) select, else those whose class name
    ends in ``Attention`` with ``k_proj`` and ``v_proj`` children."""
    wanted = list(names)
    found = {}
    for name, module in model.named_modules():
        cls = type(module).__name__
        if wanted:
            if matches(name, module, wanted):
                found[name] = module
        elif cls.endswith("Attention") and hasattr(module, "k_proj") and hasattr(module, "v_proj"):
            found[name] = module
    return found


class AttentionQuantization:
    """What one attention module does to its states before the attention function: observers (calibration)
    and FP8 fake quantization with its scales (buffers ``k_scale`` / ``v_scale`` / ``q_scale`` on the module)."""

    def __init__(self, module: nn.Module, original: Callable[..., Any], config: Any) -> None:
        self.original = original
        self.config = config  # the module's own config, put back by detach
        self.kv_args: QuantizationArgs | None = None
        self.query_args: QuantizationArgs | None = None
        self.observers: OrderedDict[int, Observer] = OrderedDict()
        self.module_type = type(module).__name__
        #: the calibrated scales by buffer name, a CPU copy: what is saved (a streamed run releases a finished
        #: piece's tensors, buffers included, so the module's own may be gone by then)
        self.scales: dict[str, Tensor] = {}

    def observe(self, observer: Observer) -> RemovableHandle:
        """Call ``observer(kind, states)`` (``kind``: query / key / value) on every forward until removed."""
        handle = RemovableHandle(self.observers)
        self.observers[handle.id] = observer
        return handle

    def apply(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        for observer in list(self.observers.values()):
            observer("query", query)
            observer("key", key)
            observer("value", value)
        buffers = module._buffers
        if self.kv_args is not None and "k_scale" in buffers:
            key = fake_quantize_kv(key, buffers["k_scale"], self.kv_args)
            value = fake_quantize_kv(value, buffers["v_scale"], self.kv_args)
        if self.query_args is not None and "q_scale" in buffers:
            query = fake_quantize_kv(query, buffers["q_scale"], self.query_args)
        return query, key, value


def _dispatch(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Any:
    tracer = getattr(query, "tracer", None) if isinstance(query, torch.fx.Proxy) else None
    if tracer is not None and hasattr(tracer, "call_opaque"):
        # traced (a piece cut inside a block): one opaque call, so the scales and sdpa's mask test are read
        # when the graph runs, as transformers' own attention functions are
        return tracer.call_opaque(_dispatch, (module, query, key, value, *args), kwargs, listed=True)
    state: AttentionQuantization = module.__dict__[STATE_ATTR]
    query, key, value = state.apply(module, query, key, value)
    return state.original(module, query, key, value, *args, **kwargs)


def attach(module: nn.Module, name: str = "") -> AttentionQuantization:
    """The :class:`AttentionQuantization` of ``module``, routing its attention function through it (once)."""
    state = module.__dict__.get(STATE_ATTR)
    if state is not None:
        return state
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    config = getattr(module, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    where = f"attention module {name!r} ({type(module).__name__})"
    if config is None or implementation is None:
        raise AttentionError(f"{where} has no config naming its attention implementation, so its keys and values "
                             f"cannot be reached; name the model's attention classes in the model patch "
                             f"(attention_modules) or leave kv_cache_scheme out")
    if implementation.startswith(IMPLEMENTATION_PREFIX):
        raise AttentionError(f"{where} is routed through layerwise already but has no state; load the model again")
    if implementation == "eager":
        original = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    else:
        original = ALL_ATTENTION_FUNCTIONS.get(implementation)
    if original is None:
        raise AttentionError(f"{where}: attention implementation {implementation!r} has no function layerwise can "
                             f"wrap; load the model with attn_implementation='sdpa' or 'eager'")
    routed = IMPLEMENTATION_PREFIX + implementation
    if routed not in AttentionInterface._global_mapping:
        AttentionInterface.register(routed, _dispatch)
    state = AttentionQuantization(module, original, config)
    own = copy.copy(config)  # shallow: only the implementation's name differs; sub-configs stay shared
    own.__dict__["_attn_implementation_internal"] = routed  # not the setter: it would rename shared sub-configs
    module.__dict__[STATE_ATTR] = state
    module.config = own
    return state


def detach(module: nn.Module) -> None:
    """Undo :func:`attach`: the module's own config back, its scales and state gone."""
    state = module.__dict__.pop(STATE_ATTR, None)
    if state is None:
        return
    module.config = state.config
    for scale in SCALE_NAMES.values():
        module._buffers.pop(scale, None)


def attention_state(module: nn.Module) -> AttentionQuantization | None:
    """The module's :class:`AttentionQuantization`, if :func:`attach` gave it one."""
    return module.__dict__.get(STATE_ATTR)


def set_attention_scales(module: nn.Module, scales: dict[str, Tensor], kv_args: QuantizationArgs | None,
                         query_args: QuantizationArgs | None = None) -> None:
    """Make ``module`` quantize its states from now on: ``scales`` by buffer name (``k_scale``, ``v_scale``,
    ``q_scale``), kept as non-persistent buffers (the saver writes them)."""
    state = attach(module)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    for buffer, scale in scales.items():
        if buffer not in SCALE_NAMES.values():
            raise ValueError(f"unknown attention scale {buffer!r}; valid: {', '.join(SCALE_NAMES.values())}")
        module._buffers.pop(buffer, None)
        module.register_buffer(buffer, scale.detach().to(device).clone(), persistent=False)
        state.scales[buffer] = scale.detach().to("cpu").clone()
    state.kv_args = kv_args if kv_args is not None else state.kv_args
    state.query_args = query_args if query_args is not None else state.query_args


def quantized_attention(model: nn.Module) -> dict[str, nn.Module]:
    """The attention modules of ``model`` with calibrated KV (or query) scales, by qualified name."""
    return {name: m for name, m in model.named_modules()
            if (state := attention_state(m)) is not None and (state.kv_args is not None or state.query_args is not None)}
