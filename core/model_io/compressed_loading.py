"""Loading a compressed-tensors folder, the sparse layouts transformers no longer reads included.

layerwise writes every folder in a layout plain transformers loads (pruned weights dense with a
``dense`` sparsity_config; see :mod:`layerwise.plugins.savers.sparse`). Folders that layerwise
0.1.0 wrote for a pruned, unquantized model are stored ``sparse-bitmask`` or ``sparse-24-bitmask``:
compressed-tensors >= 0.15 dropped those decompressors, so plain transformers loads them with the
pruned weights *missing* (randomly initialised, with only a load report saying so).
:func:`load_compressed` decodes those tensors (:mod:`layerwise.algorithms.sparsity.bitmask`) into dense
``<layer>.weight`` tensors, drops the sparsity part of the config and builds the model from
that state dict; every other folder (dense, pack-quantized, quantized or pruned with a ``dense``
sparsity_config) is a plain ``from_pretrained``, packed asymmetric weights of a folder that does
not say ``dequantize`` dequantized on load (:func:`packed_asymmetric`). :func:`layerwise.load_model`,
and so ``compress(path)``, load sparse folders the same way.

The pruned layers are marked pruned again (:func:`layerwise.algorithms.sparsity.mark_sparse`, with the
config's ``sparsity_structure``): decoded ones, and the ``targets`` of a ``dense`` sparsity_config on
an unquantized folder, so a later GPTQ run keeps their zeros and a save records them again. A bitmask
checkpoint is read into CPU memory once while loading.
"""

from __future__ import annotations

import copy
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from layerwise.algorithms.quantization.float_formats import e8m0_values, fp4_values, unpack_fp4
from layerwise.algorithms.sparsity.bitmask import DECODERS, PARTS, SparseFormatError
from layerwise.algorithms.sparsity.masks import parse_mask_structure
from layerwise.algorithms.sparsity.storage import PRUNED_ONLY_KEY, mark_sparse
from layerwise.common.quiet import quiet_transformers
from layerwise.common.user_warnings import warn_user
from layerwise.errors import ModelLoadError
from layerwise.model_io.checkpoint_tensors import (
    INPUT_QPARAMS,
    named_entry,
    prefixed_names,
    renamed_as_loaded,
    saved_input_qparams,
    weight_files,
)
from layerwise.model_io.expert_loading import (
    fused_experts,
    restore_expert_inputs,
    undecoded_experts_error,
    unfuse_experts,
)
from layerwise.model_io.heads import checkpoint_class
from layerwise.model_io.kv_cache_loading import attach_kv_scales, kv_cache_scheme, scales_expected
from layerwise.model_io.model_paths import check_model_path
from layerwise.model_io.token_inputs import quantize_inputs_per_row

#: the sparsity_config formats whose tensors need decoding
SPARSE_FORMATS = tuple(DECODERS)


def quantization_config(config: Any) -> dict[str, Any]:
    """A transformers config's (or config.json dict's) ``quantization_config`` as a dict; ``{}`` if none."""
    quant = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config",
                                                                                         None)
    if quant is None:
        return {}
    return dict(quant) if isinstance(quant, dict) else quant.to_dict()


def sparsity_config(config: Any) -> dict[str, Any] | None:
    """``quantization_config.sparsity_config`` of a transformers config (or config.json dict), if any; for a
    model pruned and not quantized, the one layerwise writes beside (:data:`PRUNED_ONLY_KEY`)."""
    sparse = quantization_config(config).get("sparsity_config")
    if not sparse:
        sparse = config.get(PRUNED_ONLY_KEY) if isinstance(config, dict) else getattr(config, PRUNED_ONLY_KEY, None)
    return sparse if isinstance(sparse, dict) and sparse else None


def sparse_format(config: Any) -> str | None:
    """The sparse layout a config's weights are stored in (one of :data:`SPARSE_FORMATS`), else ``None``."""
    fmt = (sparsity_config(config) or {}).get("format")
    return fmt if fmt in SPARSE_FORMATS else None


def load_compressed(path: str | os.PathLike, model_class: type | None = None, **kwargs: Any) -> Any:
    """Load a folder saved in the compressed-tensors format, sparse layouts decoded.

    ``model_class`` defaults to the class ``architectures`` names (else the task class whose
    weight names the folder holds, else ``AutoModel``); ``kwargs`` go to ``from_pretrained``
    (``dtype``, ``device_map``, ``output_loading_info``, ...). A folder that is not sparse
    loads exactly as ``model_class.from_pretrained(path, **kwargs)`` would.
    """
    import transformers

    where = str(path)
    check_model_path(where)
    folder = Path(where).expanduser()
    config = kwargs.pop("config", None)
    try:
        loaded = config if config is not None else transformers.AutoConfig.from_pretrained(
            where, trust_remote_code=kwargs.get("trust_remote_code", False))
    except OSError as exc:
        raise ModelLoadError(f"cannot read the config of {where!r}: {str(exc).rstrip('.')}. Pass a local folder "
                             f"with config.json and weights") from exc
    fmt = sparse_format(loaded)
    if fmt is None:
        cls = model_class or checkpoint_class(loaded, folder)
        bfloat16 = kwargs.get("dtype") in (torch.bfloat16, "bfloat16")
        float_formats = packed_fp4(loaded) and "quantization_config" not in kwargs
        int8 = "quantization_config" not in kwargs and "int-quantized" in _formats(loaded)
        # float-format and int8 MoE experts: transformers cannot decode them in any dtype (int8 ones not at all), so
        # bfloat16 takes this path too
        experts = float_format_experts(folder) if (float_formats or int8) and folder.is_dir() else set()
        redecode = (float_formats and (not bfloat16 or bool(experts))) or (int8 and bool(experts))
        if "quantization_config" not in kwargs and (packed_asymmetric(loaded) or redecode):
            from transformers import CompressedTensorsConfig

            kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)

        def load(**given: Any) -> Any:
            if redecode and folder.is_dir() and (experts or _mixed_with_float_formats(loaded)):
                return _load_dequantized_without(cls, folder, loaded, experts, **given)
            return _from_pretrained(cls, where, loaded, **({"config": config} if config is not None else {}),
                                    **given)

        if not (redecode and folder.is_dir()):
            result = load(**kwargs)
            _put_back(result[0] if isinstance(result, tuple) else result, loaded, where)
            return result
        model, info = _quietly(load, kwargs)
        if experts:
            unfuse_experts(model)
        rename = renamed_as_loaded(model)
        decoded = decode_float_formats(model, folder, rename)
        if experts - set(decoded):
            raise undecoded_experts_error(where, sorted(experts - set(decoded)))
        restored = restore_input_quantization(model, folder, loaded, rename)
        restored += _put_back(model, loaded, where)
        _warn_disagreement(info, decoded, model, restored)
        return (model, info) if kwargs.get("output_loading_info") else model
    result = load_sparse(folder, loaded, model_class, **kwargs)
    attach_online_transforms(result[0] if isinstance(result, tuple) else result, loaded)
    return result


def _quietly(load: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``load(**kwargs)`` for the float32 re-decode of FP4 / MX folders, and its loading info, without the notices
    that path always draws and that layerwise answers itself: transformers' "you passed quantization_config"
    (layerwise passed it) and its load report (``input_global_scale`` tensors unexpected: read back by
    :func:`restore_input_quantization`; a mixed folder's FP4 / MX weights missing: decoded after);
    :func:`_warn_disagreement` says whatever else the report held."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"You passed `quantization_config`")
        with quiet_transformers():
            model, info = load(**{**kwargs, "output_loading_info": True})
    return model, info


def _warn_disagreement(info: dict[str, Any], decoded: list[str], model: torch.nn.Module,
                       restored: list[str]) -> None:
    """What a quiet load's report held beyond what the re-decode answers (see :func:`_quietly`): the input scales
    of the ``restored`` layers were read back from the folder, and a missing parameter the model no longer has
    is a fused experts tensor, unfused since and decoded per expert."""
    filled = {f"{layer}.weight" for layer in decoded}
    prefix = getattr(model, "base_model_prefix", "")
    read_back = {f"{name}.{param}" for layer in restored for param in INPUT_QPARAMS
                 for name in prefixed_names(layer, prefix)}
    unexpected = [key for key in info.get("unexpected_keys", ()) if key not in read_back]
    present = {name for name, _ in (*model.named_parameters(), *model.named_buffers())}
    missing = [key for key in info.get("missing_keys", ()) if key in present
               and key not in filled and not any(key.endswith(f".{name}") for name in filled)]
    mismatched = list(info.get("mismatched_keys", ()))
    found = [(what, keys) for what, keys in (("unexpected", unexpected), ("missing", missing),
                                             ("mismatched", mismatched)) if keys]
    if found:
        warn_user("load_compressed: the checkpoint and the model disagree: " + "; ".join(
            f"{what} {', '.join(map(str, sorted(keys, key=str)[:5]))}" + (" ..." if len(keys) > 5 else "")
            for what, keys in found))


def _mixed_with_float_formats(config: Any) -> bool:
    """A mixed-precision folder with NVFP4 / MXFP4 / MXFP8 groups beside others (NVFP4 MLPs, FP8 attention)."""
    groups = (quantization_config(config).get("config_groups") or {}).values()
    formats = {group.get("format") for group in groups}
    return bool(formats & set(BFLOAT16_FORMATS)) and bool(formats - set(BFLOAT16_FORMATS))


def _load_dequantized_without(cls: type, folder: Path, config: Any, experts: set[str], **kwargs: Any) -> Any:
    """A dequantized load (float32; bfloat16 too when MoE experts are float formats) with the NVFP4 / MXFP4 / MXFP8
    tensors transformers 5.24 cannot decode left out of what it reads (the folder's tensors read into memory once),
    for :func:`decode_float_formats` to fill after:

    - ``experts``, the float-format layers of MoE experts (:func:`float_format_experts`): its expert
      dequantization decodes NVFP4 without the global scale, MXFP4 in bfloat16 (the layers then fail in a float32
      model) and MXFP8 as FP8 times the raw E8M0 byte (the load fails);
    - in a :func:`_mixed_with_float_formats` folder, every layer of the float-format groups (those groups left
      out of the config too): its dequantize-on-load decodes every packed tensor with the compressor of one
      format, and fails on the NVFP4 / MX ones beside an FP8 or integer group.
    """
    from safetensors.torch import load_file

    from layerwise.common.matching import regex

    dense, left_out = _without_float_groups(config) if _mixed_with_float_formats(config) else (config, [])

    def left_out_layer(key: str) -> bool:
        stem = key.rsplit(".", 1)[0]
        return stem in experts or any(regex(t).fullmatch(stem) if t.startswith("re:") else t == stem
                                      for t in left_out)

    state: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        state.update({k: v for k, v in load_file(file).items() if not left_out_layer(k)})
    return _concrete(cls, dense).from_pretrained(None, config=dense, state_dict=state, **kwargs)


def _without_float_groups(config: Any) -> tuple[Any, list[str]]:
    """A copy of a :func:`_mixed_with_float_formats` config without its NVFP4 / MXFP4 / MXFP8 groups (their
    targets added to ``ignore``), and those targets."""
    dense = copy.deepcopy(config)
    quant = quantization_config(dense)
    left_out: list[str] = []
    for key, group in list(quant["config_groups"].items()):
        if group.get("format") in BFLOAT16_FORMATS:
            left_out += list(quant["config_groups"].pop(key).get("targets") or [])
    quant["ignore"] = [*(quant.get("ignore") or []), *left_out]
    formats = {group.get("format") for group in quant["config_groups"].values()}
    quant["format"] = formats.pop() if len(formats) == 1 else quant.get("format")
    if isinstance(dense, dict):
        dense["quantization_config"] = quant
    else:
        dense.quantization_config = quant
    return dense, left_out


def _put_back(model: torch.nn.Module, config: Any, where: str) -> list[str]:
    """What a dense (non-sparse-format) load leaves out or gets wrong: sparse marks, per-token input scales per
    row (:mod:`layerwise.model_io.token_inputs`), the MoE experts' input quantization, then the online rotations
    (which need the experts unfused first). Returns the experts' layers whose input quantization was restored."""
    mark_dense_sparse(model, config)
    quantize_inputs_per_row(model)
    restored = restore_expert_inputs(model, quantization_config(config), where)
    attach_online_transforms(model, config)
    return restored


def attach_online_transforms(model: torch.nn.Module, config: Any) -> list[str]:
    """The online rotations ``quantization_config.transform_config`` declares, put back on the loaded
    model (transformers 5.x drops that key); MoE experts loaded fused are unfused first, by the model's patch, as
    the rotations name their per-expert layers. Returns the rotated layers."""
    transforms = quantization_config(config).get("transform_config")
    if not transforms:
        return []
    from layerwise.algorithms.quantization.online_rotation import attach_from_transform_config
    from layerwise.host.patch_selection import apply_patch, resolve_patch

    if any(fused_experts(module) for module in model.modules()):
        # an expert's rotation sits on its own down projection, which transformers 5 loads fused: the model's
        # patch unfuses them again (after restore_expert_inputs, which would otherwise find nothing to restore)
        apply_patch(model, resolve_patch(model))
    return attach_from_transform_config(model, transforms)


def _from_pretrained(cls: type, where: str, loaded: Any, **kwargs: Any) -> Any:
    """``cls.from_pretrained``; a folder with an FP8 KV cache gets its scales attached by layerwise when
    compressed-tensors does not apply them (:mod:`layerwise.model_io.kv_cache_loading`)."""
    quant = quantization_config(loaded)
    folder = Path(where).expanduser()
    if kv_cache_scheme(quant) is None or not folder.is_dir():
        return cls.from_pretrained(where, **kwargs)
    with scales_expected(cls):
        result = cls.from_pretrained(where, **kwargs)
    attach_kv_scales(result[0] if isinstance(result, tuple) else result, weight_files(folder), quant)
    return result


def packed_asymmetric(config: Any) -> bool:
    """Does the folder hold packed asymmetric weights (``W4A16_ASYM``, AWQ's default) without saying
    ``dequantize``? transformers 5.24 with compressed-tensors 0.20 loads those layers only through its
    dequantize-on-load path (dense weights with the quantized values: the same outputs); layerwise
    writes ``"dequantize": true`` into such a config, older folders lack it."""
    quant = quantization_config(config)
    return not quant.get("dequantize") and quant.get("format") in ("pack-quantized", "mixed-precision") and any(
        not (group.get("weights") or {}).get("symmetric", True)
        for group in (quant.get("config_groups") or {}).values())


#: the formats compressed-tensors 0.20 decompresses in bfloat16 whatever the model's dtype
BFLOAT16_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp8-quantized")


def packed_fp4(config: Any) -> bool:
    """Does the folder hold NVFP4 / MXFP4 / MXFP8 weights? compressed-tensors 0.20 decodes them in bfloat16
    (FP4 unpacked, E8M0 scales) and its compressed forward then fails in a float32 model ("self and mat2
    must have the same dtype");
    transformers' dequantize-on-load path gives dense weights in the model's dtype (bfloat16-exact: in a
    float32 model they are the bfloat16-rounded values), without input quantization (put back by
    :func:`restore_input_quantization`). :func:`load_compressed`
    takes that path unless ``dtype=torch.bfloat16`` is asked for, where compressed-tensors' own forward runs
    (input quantization included)."""
    return bool(_formats(config) & set(BFLOAT16_FORMATS))


def _formats(config: Any) -> set[str]:
    """The compressed-tensors formats a folder's quantization_config names (overall and per group)."""
    quant = quantization_config(config)
    return {quant.get("format")} | {group.get("format") for group in (quant.get("config_groups") or {}).values()}


def _float_layout(stem: str, keys: set[str], scale_is_byte: bool, weight_dtype: str | None) -> str | None:
    """How a layer with ``<stem>.weight_scale`` is stored: ``"nvfp4"``, ``"mxfp4"``, ``"mxfp8"``, ``"int8"`` (int8
    values times a float scale, per channel or group: W8A8) or ``"int8-asym"`` (less a zero point), else ``None``."""
    if f"{stem}.weight_packed" in keys and f"{stem}.weight_global_scale" in keys:
        return "nvfp4"
    if scale_is_byte and f"{stem}.weight_packed" in keys:
        return "mxfp4"
    if scale_is_byte and f"{stem}.weight" in keys:
        return "mxfp8"
    if weight_dtype == "I8":
        return "int8-asym" if f"{stem}.weight_zero_point" in keys else "int8"
    return None


def _float_format_layers(tensors: Any) -> dict[str, str]:
    """The layers an open safetensors file stores as NVFP4 / MXFP4 / MXFP8 (or int8): ``{stem: layout}`` (read from
    the names and the dtypes, no tensor read)."""
    keys = set(tensors.keys())
    found = {}
    for key in sorted(k for k in keys if k.endswith(".weight_scale")):
        stem = key.removesuffix(".weight_scale")
        weight = tensors.get_slice(f"{stem}.weight").get_dtype() if f"{stem}.weight" in keys else None
        layout = _float_layout(stem, keys, tensors.get_slice(key).get_dtype() == "U8", weight)
        if layout is not None:
            found[stem] = layout
    return found


#: a layer of one MoE expert, as a per-expert checkpoint names it (``...experts.3.gate_proj``)
_EXPERT_LAYER = re.compile(r"(^|\.)experts\.\d+\.")


def float_format_experts(folder: Path) -> set[str]:
    """The MoE experts' layers the folder stores as NVFP4 / MXFP4 / MXFP8 or int8 (checkpoint names): transformers
    5.24 cannot decode them into its fused experts (see :func:`_load_dequantized_without`; int8 ones it cannot
    load at all: its expert conversion handles FP8 and packed weights only)."""
    from safetensors import safe_open

    found: set[str] = set()
    for file in weight_files(folder):
        with safe_open(str(file), "pt") as tensors:
            found.update(stem for stem in _float_format_layers(tensors) if _EXPERT_LAYER.search(stem))
    return found


@torch.no_grad()
def decode_float_formats(model: torch.nn.Module, folder: Path, rename: Callable[[str], str] = str) -> list[str]:
    """Decode the folder's NVFP4 / MXFP4 / MXFP8 weights again in float32 into ``model`` (loaded dequantized):
    compressed-tensors 0.20 decodes them in bfloat16, which in a float32 model is not the checkpoint's value
    (``q * s8 / g`` needs more bits); each checkpoint name ``rename``-d to the model's first (Mixtral's
    ``block_sparse_moe`` is its ``mlp``: :func:`~layerwise.model_io.checkpoint_tensors.renamed_as_loaded`). Returns the layers decoded (checkpoint
    names)."""
    from safetensors import safe_open

    decoded = []
    prefix = getattr(model, "base_model_prefix", "")
    for file in weight_files(folder):
        with safe_open(str(file), "pt") as tensors:
            for stem, layout in _float_format_layers(tensors).items():
                name = rename(f"{stem}.weight").removesuffix(".weight")
                module = next((m for m in (_submodule(model, c) for c in prefixed_names(name, prefix))
                               if m is not None), None)
                weight = getattr(module, "weight", None)
                if weight is None:
                    continue
                values, block = _float_values_and_scales(tensors, stem, layout)
                if tuple(weight.shape) != tuple(values.shape):
                    continue
                group = values.shape[1] // block.shape[1]
                exact = (values.reshape(*block.shape, group) * block.unsqueeze(-1)).reshape(values.shape)
                weight.copy_(exact.to(weight.dtype))
                decoded.append(stem)
    return decoded


def _float_values_and_scales(tensors: Any, stem: str, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A float-format layer's element values and block scales, both float32 (their product is the weight); an
    int8 layer's values less its zero point, if any."""
    scale = tensors.get_tensor(f"{stem}.weight_scale")
    if layout.startswith("int8"):
        values = tensors.get_tensor(f"{stem}.weight").to(torch.float32)
        block = _per_row(scale, values.shape[0])
        if layout == "int8-asym":
            zero = _per_row(tensors.get_tensor(f"{stem}.weight_zero_point"), values.shape[0])
            values = (values.reshape(*block.shape, -1) - zero.unsqueeze(-1)).reshape(values.shape)
        return values, block
    if layout == "nvfp4":
        global_scale = tensors.get_tensor(f"{stem}.weight_global_scale").to(torch.float32)
        return fp4_values(unpack_fp4(tensors.get_tensor(f"{stem}.weight_packed"))), scale.to(torch.float32) / global_scale
    if layout == "mxfp4":
        return fp4_values(unpack_fp4(tensors.get_tensor(f"{stem}.weight_packed"))), e8m0_values(scale)
    return tensors.get_tensor(f"{stem}.weight").to(torch.float32), e8m0_values(scale)


def _per_row(qparam: torch.Tensor, rows: int) -> torch.Tensor:
    """An int8 weight's scale or zero point as ``(rows, groups)`` float32: one per tensor (shape ``()`` or
    ``(1,)``), per channel ``(rows, 1)`` or per group ``(rows, groups)``."""
    return qparam.to(torch.float32).reshape(-1, qparam.shape[-1] if qparam.ndim > 1 else 1).expand(rows, -1)


@torch.no_grad()
def restore_input_quantization(model: torch.nn.Module, folder: Path, config: Any,
                               rename: Callable[[str], str] = str) -> list[str]:
    """After :func:`decode_float_formats`: the layers whose config group quantizes their inputs do so again, as
    the in-memory model did (transformers' dequantize-on-load leaves every layer plain): NVFP4, MXFP4, MXFP8 with
    activations, the MoE experts unfused by then included, and in a mixed folder the other groups' (FP8, int8),
    their calibrated ``input_scale`` / ``input_zero_point`` and NVFP4's ``input_global_scale`` read back from the
    folder (under the model's names: ``rename``). Layers whose saved scales are missing stay plain (the load
    report names those tensors). Returns the layers."""
    from layerwise.algorithms.quantization.config_groups import read_config_groups
    from layerwise.algorithms.quantization.storage import set_input_quantization
    from layerwise.common.matching import find_modules

    quant = quantization_config(config)
    saved = {key: {k: v for k, v in group.items() if k != "format"}  # each group's storage: read, not a scheme
             for key, group in (quant.get("config_groups") or {}).items()}
    groups = [g for g in read_config_groups(saved, "quantization_config.config_groups")
              if g.scheme is not None and g.scheme.input_activations is not None]
    if not groups:
        return []
    saved = saved_input_qparams(folder, rename=rename)
    prefix = getattr(model, "base_model_prefix", "")
    restored = []
    for group in groups:
        inputs = group.scheme.input_activations
        for name, module in find_modules(model, group.targets, quant.get("ignore") or []).items():
            qparams = _input_qparams_for(inputs, named_entry(saved, name, prefix))
            if qparams is None or getattr(module, "input_quantization_args", None) is not None:
                continue
            set_input_quantization(module, inputs, **qparams)
            restored.append(name)
    return restored


def _input_qparams_for(inputs: Any, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """What ``set_input_quantization`` needs besides the args, from a layer's ``saved`` input tensors: NVFP4's
    global scale, a static scale (and zero point), nothing for dynamic inputs; ``None`` when the folder lacks it."""
    if inputs.strategy == "tensor_group":
        scale = saved.get("input_global_scale")
        return None if scale is None else {"global_scale": scale}
    if inputs.dynamic:
        return {}
    if "input_scale" not in saved:
        return None
    return {"scale": saved["input_scale"], "zero_point": saved.get("input_zero_point")}


def mark_dense_sparse(model: torch.nn.Module, config: Any) -> list[str]:
    """Mark the ``targets`` of a ``dense`` sparsity_config pruned again, on a model loaded from an unquantized
    folder (its weights are the pruned ones, zeros included); returns the names marked."""
    sparse = sparsity_config(config)
    if not sparse or sparse.get("format") != "dense" or quantization_config(config).get("config_groups"):
        return []
    names = [f"{target}.weight" for target in sparse.get("targets") or [] if not str(target).startswith("re:")]
    _mark_decoded(model, names, sparse.get("sparsity_structure"))
    return names


def load_sparse(folder: str | os.PathLike, config: Any, model_class: type | None = None, **kwargs: Any) -> Any:
    """``from_pretrained`` for a sparse folder whose ``config`` was read already (see :func:`load_compressed`)."""
    folder = Path(folder).expanduser()
    fmt = sparse_format(config)
    if quantization_config(config).get("config_groups"):
        raise ModelLoadError(f"'{folder}' is quantized and stored as {fmt}: compressed-tensors >= 0.15 cannot load "
                             f"that combination, nor can layerwise. Save it again with a sparsity_config of format "
                             f"'dense' (what layerwise writes for pruned and quantized models)")
    if not folder.is_dir():
        raise ModelLoadError(f"'{folder}' is stored as {fmt}, which is decoded from local files only: download it "
                             f"first (huggingface-cli download {folder} --local-dir DIR) and pass that folder")
    state, decoded = decoded_state_dict(folder, fmt)
    structure = (sparsity_config(config) or {}).get("sparsity_structure")
    config = dense_config(config)
    cls = _concrete(model_class or checkpoint_class(config, folder, keys=set(state)), config)
    result = cls.from_pretrained(None, config=config, state_dict=state, **kwargs)
    model = result[0] if isinstance(result, tuple) else result
    if (folder / "generation_config.json").is_file() and getattr(model, "can_generate", lambda: False)():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
    _mark_decoded(model, decoded, structure)
    return result


def decoded_state_dict(folder: Path, fmt: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every tensor of the folder's safetensors, sparse ``<name>.<part>`` groups decoded to ``<name>``.

    Returns the state dict and the names decoded.
    """
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for file in weight_files(folder):
        try:
            shard = load_file(file)  # safe_open on CPU, every tensor of the file
        except Exception as exc:  # safetensors raises its own error types
            raise ModelLoadError(f"cannot read weights file '{file}': {exc}. The file is damaged or incomplete: "
                                 f"copy or download it again") from exc
        tensors.update(shard)
        where.update(dict.fromkeys(shard, file.name))
    parts, decode = PARTS[fmt], DECODERS[fmt]
    stems = sorted({key.rsplit(".", 1)[0] for key in tensors
                    if "." in key and key.rsplit(".", 1)[1] in parts and key.rsplit(".", 1)[1] != "shape"})
    for stem in stems:
        missing = [f"{stem}.{part}" for part in parts if f"{stem}.{part}" not in tensors]
        found = next(where[f"{stem}.{part}"] for part in parts if f"{stem}.{part}" in tensors)
        if missing:
            raise ModelLoadError(f"'{folder}' stores {stem!r} as {fmt} but lacks {', '.join(map(repr, missing))} "
                                 f"(its other parts are in {found}); the checkpoint is incomplete: save or copy "
                                 f"it again")
        try:
            tensors[stem] = decode({part: tensors.pop(f"{stem}.{part}") for part in parts})
        except SparseFormatError as exc:
            raise ModelLoadError(f"'{folder}': the {fmt} tensors of {stem!r} (in {found}) do not fit together: "
                                 f"{exc}; the checkpoint is damaged: save or copy it again") from exc
    return tensors, stems


def dense_config(config: Any) -> Any:
    """A copy of ``config`` without ``sparsity_config``; without ``quantization_config`` when it quantizes nothing."""
    config = copy.deepcopy(config)
    quant = quantization_config(config)
    if not quant:
        return config
    quant.pop("sparsity_config", None)
    if quant.get("config_groups") or quant.get("kv_cache_scheme"):
        config.quantization_config = quant
    else:
        del config.quantization_config
    return config


def _concrete(cls: type, config: Any) -> type:
    """The model class an Auto class picks for ``config`` (``from_pretrained(None, ...)`` needs a real one)."""
    mapping = getattr(cls, "_model_mapping", None)
    if mapping is None:
        return cls
    try:
        return mapping[type(config)]
    except KeyError as exc:
        raise ModelLoadError(f"{cls.__name__} has no model class for {type(config).__name__}; pass model_class= "
                             f"(the transformers class of this model)") from exc


def _mark_decoded(model: torch.nn.Module, names: list[str], structure: str | None) -> None:
    """Mark the modules whose weights were decoded as pruned, with the config's structure."""
    try:
        mask_structure = parse_mask_structure(structure)
    except ValueError:
        return  # an N:M text layerwise cannot read: the weights are right, only the mark is skipped
    prefix = getattr(model, "base_model_prefix", "")
    for name in names:
        owner, _, param = name.rpartition(".")
        module = next((m for m in (_submodule(model, c) for c in prefixed_names(owner, prefix)) if m is not None),
                      None)
        if module is not None and param == "weight":  # None: a name the model renamed while loading
            mark_sparse(module, mask_structure)


def _submodule(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
