"""Saving a quantized model in the compressed-tensors format (loaded by transformers and vLLM).

On disk, for every quantized Linear called ``<name>``:

* ``<name>.weight_packed`` -- int32, shape ``(out, ceil(in * bits / 32))``: the signed
  integers ``q`` shifted to unsigned (``q + 2**(bits-1)``) and packed densely along the
  input dimension, element ``j`` at bit ``j * bits`` (8 int4 or 4 int8 per word);
* ``<name>.weight_scale`` -- the weight's dtype, shape ``(1,)`` / ``(out, 1)`` /
  ``(out, in // group_size)``; ``w = (q - zero_point) * scale``;
* ``<name>.weight_zero_point`` -- asymmetric only: int32 packed along the output
  dimension for channel/group strategies, int8 for the tensor strategy;
* ``<name>.weight_shape`` -- int64 ``[out, in]``.

The low-bit float formats (``args.float_format``) are stored as compressed-tensors 0.20 stores them:

* NVFP4 (``nvfp4-pack-quantized``): ``weight_packed`` uint8 ``(out, in / 2)``, two FP4 E2M1 codes a
  byte (column ``2k`` in the low nibble), ``weight_scale`` float8_e4m3fn ``(out, in / 16)``,
  ``weight_global_scale`` float32 ``(1,)``; ``w = q * weight_scale / weight_global_scale``;
* MXFP4 (``mxfp4-pack-quantized``): ``weight_packed`` as NVFP4, ``weight_scale`` uint8 E8M0 exponents
  ``(out, in / 32)``; ``w = q * 2**(weight_scale - 127)``;
* MXFP8 (``mxfp8-quantized``): ``weight`` float8_e4m3fn, ``weight_scale`` as MXFP4.

``config.json`` gains ``quantization_config`` (``quant_method: compressed-tensors``,
``format: pack-quantized`` for int4 and int8 alike -- the weight-only format vLLM runs --
one config group per distinct set of args, and ``ignore`` listing every Linear
left unquantized). The tokenizer, ``recipe.yaml`` and any extra files go alongside.
The folder is written atomically (see :mod:`layerwise.model_io.saving`), and only when every tensor
is finite (:func:`layerwise.runtime.finite.check_saved`): a NaN scale is an error, not a checkpoint.

An FP8 KV cache (a ``kv_cache_scheme``, :mod:`layerwise.algorithms.quantization.kv_cache`) adds
``quantization_config.kv_cache_scheme`` (compressed-tensors' QuantizationArgs: float, 8 bits, symmetric,
static, strategy ``tensor`` or ``attn_head``) and, per attention layer ``<attn>``, ``<attn>.k_scale`` and
``<attn>.v_scale`` in the model's dtype, shape ``(1,)`` or ``(kv_heads, 1, 1)``: what compressed-tensors
initializes and vLLM reads. A model whose only quantization is its KV cache is saved with no config group
(format ``dense``).

A pruned model (layers marked by :func:`layerwise.algorithms.sparsity.mark_sparse`) also gets
``quantization_config.sparsity_config`` with format ``dense``: the pruned weights are stored as they
are (dense, zeros included; packed as above when quantized) and the config only says what the zeros
are. Pruned and not quantized, it gets no ``quantization_config`` (compressed-tensors 0.19 writes none,
and transformers with 0.19 fails on one without a config group): the sparsity_config goes under
``layerwise_sparsity_config``. Details, and why not the bitmask layouts: :mod:`.sparse`.

What plain ``AutoModelForCausalLM.from_pretrained(folder)`` reads (transformers 5.24.0,
compressed-tensors 0.20.0, measured in ``tests/plugins/savers/test_plain_transformers.py``): every
format above loads to layerwise's outputs, with one exception in its compressed-tensors
integration. For packed asymmetric weights (``W4A16_ASYM``, AWQ's default: channel or group
strategy) it builds the empty layer with an *unpacked* ``weight_zero_point`` ``(out, groups)`` but
then decompresses that tensor as if packed (``unpack_from_int32(..., packed_dim=0)``), so the
packed ``(ceil(out * bits / 32), groups)`` int32 zero point that compressed-tensors writes, and vLLM
declares, is refused as a size mismatch. The tensors stay in that layout (vLLM's); the config adds
``"dequantize": true``, which transformers' ``CompressedTensorsConfig`` reads and compressed-tensors
and vLLM ignore, so transformers takes its dequantize-on-load path, which decodes them correctly.

A model with online rotations (``RotationModifier(online=True)``) also gets
``quantization_config.transform_config`` (:func:`with_transform_config`), where compressed-tensors'
own ``ModelCompressor`` writes it. transformers 5.x drops that key when it loads the folder (its
outputs then differ); :func:`layerwise.load_compressed` puts the online rotations back.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from layerwise.plugin.quantization import (
    QuantizationArgs,
    attention_state,
    default_g_idx,
    e8m0_codes,
    fp4_codes,
    is_transposed,
    linear_weight,
    nvfp4_block_scales,
    pack_fp4,
    pack_to_int32,
    quantize_weight,
    quantized_attention,
    quantized_modules,
    take_packed_weight_codes,
    take_weight_codes,
    transform_config,
)
from layerwise.plugin.saving import (
    Overwrite,
    Saver,
    atomic_output_dir,
    check_not_an_input,
    check_output_dir,
    check_saved,
    first_time,
    run_inputs,
    skipped_prefixes,
)
from layerwise.plugin.sparsity import PRUNED_ONLY_KEY, sparse_modules

from .ct_config import args_json, config_json, scheme_json
from .errors import SaveError
from .sparse import DENSE, build_sparsity_config, check_marked_structure, check_sparse_layers

__all__ = ["FORMAT", "CompressedTensorsSaver", "SaveError", "build_quantization_config", "compressed_state_dict", "quantized_tensors",
           "save_compressed", "save_streamed"]

FORMAT = "pack-quantized"


def save_compressed(model: torch.nn.Module, output_dir: str | os.PathLike, tokenizer: Any = None,
                    recipe: dict | str | None = None, extra_files: dict[str, str | bytes] | None = None,
                    overwrite: Overwrite = False) -> Path:
    """Write ``model`` (quantized and/or pruned in place by layerwise) to ``output_dir``; returns the folder.

    ``overwrite=True`` replaces a folder layerwise wrote, ``"any"`` any folder; never the model's own.
    """
    check_not_an_input(output_dir, run_inputs(model, None, None))
    check_output_dir(output_dir, overwrite)  # fail before any work
    modules, pruned = quantized_modules(model), sparse_modules(model)
    if not modules and not pruned and not quantized_attention(model):
        raise SaveError("the model has no quantized module and no pruned one; quantize it first (e.g. recipe "
                        "'W4A16') or prune it (SparseGPT, Wanda)")
    for name, module in modules.items():
        if is_transposed(module):
            raise SaveError(f"layer {name!r} is a transformers Conv1D (GPT-2 style); the compressed-tensors "
                            f"loader handles nn.Linear only, so this model cannot be saved in this format yet")
    check_sparse_layers(pruned)
    check_marked_structure(pruned)
    quant_config = build_quantization_config(model, modules)
    state_dict = compressed_state_dict(model, modules)
    state_dict.update(attention_scales(model))
    if pruned:
        quant_config["sparsity_config"] = build_sparsity_config(model, pruned, DENSE)
    check_saved(state_dict, skipped_prefixes(model))  # before anything is written
    with atomic_output_dir(output_dir, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict)
        _write_beside(tmp, quant_config, tokenizer, recipe, extra_files)
    return Path(output_dir)


def save_streamed(model: torch.nn.Module, stream: Any, output_dir: str | os.PathLike, tokenizer: Any = None,
                  recipe: dict | str | None = None, extra_files: dict[str, str | bytes] | None = None,
                  overwrite: Overwrite = False) -> Path:
    """Finish a run whose weights streamed from disk (:class:`~layerwise.model_io.streaming.WeightStream`): its
    pieces' tensors are in the output's temporary folder already; copy the rest, write the config."""
    modules, pruned = quantized_modules(model), sparse_modules(model)
    if not modules and not pruned and not quantized_attention(model):
        raise SaveError("the model has no quantized module and no pruned one; quantize it first (e.g. recipe "
                        "'W4A16') or prune it (SparseGPT, Wanda)")
    check_sparse_layers(pruned)
    quant_config = build_quantization_config(model, modules)
    if pruned:  # the pruned weights were written dense as their pieces ended, which is the layout kept
        quant_config["sparsity_config"] = build_sparsity_config(model, pruned, DENSE, counts=stream.sparsity_counts)
    scales = attention_scales(model)  # the KV cache's scales belong to no piece's checkpoint tensors
    if scales:
        check_saved(scales, set())
    with atomic_output_dir(output_dir, overwrite=overwrite) as tmp:
        if scales:
            stream.writer.write(scales)
        stream.finish(None)
        model.config.save_pretrained(tmp)
        generation = getattr(model, "generation_config", None)
        if generation is not None and model.can_generate():
            generation.save_pretrained(tmp)
        _write_beside(tmp, quant_config, tokenizer, recipe, extra_files)
    return Path(output_dir)


def _write_beside(tmp: Path, quant_config: dict[str, Any], tokenizer: Any, recipe: dict | str | None,
                  extra_files: dict[str, str | bytes] | None) -> None:
    """``quantization_config`` into config.json, and the tokenizer, recipe and extra files next to it. A model
    pruned and not quantized gets none (as compressed-tensors 0.19 writes it: a dense model, which every loader
    and vLLM take); its ``sparsity_config`` goes under :data:`PRUNED_ONLY_KEY`, for layerwise's loader."""
    config_path = tmp / "config.json"
    config = json.loads(config_path.read_text())
    if quant_config.get("config_groups") or quant_config.get("kv_cache_scheme") or "sparsity_config" not in quant_config:
        config["quantization_config"] = quant_config
    else:
        config[PRUNED_ONLY_KEY] = quant_config["sparsity_config"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if recipe is not None:
        (tmp / "recipe.yaml").write_text(recipe if isinstance(recipe, str) else _yaml(recipe))
    for relative, content in (extra_files or {}).items():
        path = _inside(tmp, relative)
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


# -- config ------------------------------------------------------------------------------
def _ct_args(args: QuantizationArgs) -> dict[str, Any]:
    """compressed-tensors' QuantizationArgs fields for our args (weights or input activations)."""
    fields: dict[str, Any] = {
        "num_bits": args.num_bits,
        "type": args.type,
        "symmetric": args.symmetric,
        "strategy": args.strategy,
        "group_size": args.group_size if args.strategy in ("group", "tensor_group") else None,
        "dynamic": args.dynamic,
        "observer": None if args.dynamic else args.observer,
    }
    if args.strategy == "tensor_group" and args.dynamic:  # NVFP4 inputs: block scales dynamic, global calibrated
        fields.update(dynamic="local", observer=args.observer)
    if args.scale_dtype is not None:
        fields["scale_dtype"] = SCALE_DTYPES[args.scale_dtype]
        fields["zp_dtype"] = SCALE_DTYPES[args.scale_dtype]  # compressed-tensors' presets name both
    if args.block_structure is not None:
        fields["block_structure"] = list(args.block_structure)
    if args.actorder == "static":
        fields["actorder"] = "weight"  # compressed-tensors' name for static ordering
    return fields


#: how compressed-tensors names our scale dtypes (E8M0 exponents are stored as uint8)
SCALE_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "e8m0": torch.uint8}
#: the compressed-tensors format of each low-bit float layout
FLOAT_FORMATS = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized", "mxfp8": "mxfp8-quantized"}


def weight_format(args: QuantizationArgs, input_args: QuantizationArgs | None) -> str:
    """How a layer's weight is stored: the low-bit float layouts in their own formats; float8 as is
    (``float-quantized``); integers with integer inputs as int8 tensors (``int-quantized``, what W8A8
    kernels read, and what compressed-tensors 0.20 expects of W4A8 too: it infers that format for
    every integer weight whose inputs are quantized); int8 with float8 inputs likewise; other
    integers packed into int32 (``pack-quantized``: weight-only, and W4AFP8, whose int4 weights
    vLLM's kernel reads packed; llm-compressor 0.14 with compressed-tensors 0.19 writes them unpacked,
    ``int-quantized``, measured in BENCHMARKS.md's data-free section)."""
    if args.float_format is not None:
        return FLOAT_FORMATS[args.float_format]
    if args.type == "float":
        return "float-quantized"
    if input_args is not None and args.type == "int" and (input_args.type == "int" or args.num_bits == 8):
        return "int-quantized"
    return FORMAT


def build_quantization_config(model: torch.nn.Module, modules: dict[str, torch.nn.Module]) -> dict[str, Any]:
    """The ``quantization_config`` dict of config.json (compressed-tensors' own dump of it: :mod:`.ct_config`).

    With no quantized module it has no config groups and format ``dense``: the frame a
    ``sparsity_config`` goes in.
    """
    by_args: dict[tuple[QuantizationArgs, QuantizationArgs | None], list[str]] = defaultdict(list)
    for name, module in modules.items():
        by_args[module.quantization_args, getattr(module, "input_quantization_args", None)].append(name)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    ignore = [n for n in linears if n not in modules]
    groups = {}
    formats = {weight_format(*key) for key in by_args}
    for i, ((args, input_args), names) in enumerate(by_args.items()):
        # one group: every Linear minus `ignore`; several: each group lists its layers exactly
        targets = ["Linear"] if len(by_args) == 1 else [f"re:^{re.escape(n)}$" for n in names]
        groups[f"group_{i}"] = scheme_json(
            targets, args_json(_ct_args(args)), None if input_args is None else args_json(_ct_args(input_args)),
            weight_format(args, input_args) if len(formats) > 1 or packed_with_inputs(args, input_args) else None)
    fmt = (formats.pop() if len(formats) == 1 else "mixed-precision") if groups else "dense"
    data = config_json(groups, fmt, ignore if groups else [])
    data["kv_cache_scheme"] = kv_cache_scheme(model)
    add_attention_group(data, model)
    data["quant_method"] = "compressed-tensors"
    if any(packs_zero_point(*key) for key in by_args):
        data["dequantize"] = True  # see the module docstring: transformers' own path for packed zero points
    return with_transform_config(model, data)


def with_transform_config(model: torch.nn.Module, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` plus ``transform_config`` when ``model`` rotates some inputs online (compressed-tensors' key)."""
    transforms = transform_config(model)
    if transforms is not None:
        data["transform_config"] = transforms
    return data


def kv_cache_scheme(model: torch.nn.Module) -> dict[str, Any] | None:
    """``quantization_config.kv_cache_scheme``: compressed-tensors' QuantizationArgs of the model's FP8 KV cache
    (one for every attention layer), as compressed-tensors serializes it; ``None`` without one."""
    kinds = {state.kv_args for m in quantized_attention(model).values()
             if (state := attention_state(m)) is not None and state.kv_args is not None}
    if not kinds:
        return None
    if len(kinds) > 1:
        raise SaveError("the attention layers have different KV cache schemes; compressed-tensors stores one "
                        "kv_cache_scheme for the model: calibrate them with one")
    return args_json(_ct_args(kinds.pop()))


def add_attention_group(data: dict[str, Any], model: torch.nn.Module) -> None:
    """FP8 attention: a config group with the queries' args as ``input_activations`` and no weights, targeting
    the attention classes (what compressed-tensors writes for llm-compressor's attention group); the format is
    ``dense`` when no weight is quantized."""
    queried = {type(m).__name__: state.query_args for m in quantized_attention(model).values()
               if (state := attention_state(m)) is not None and state.query_args is not None}
    if not queried:
        return
    if len(set(queried.values())) > 1:
        raise SaveError("the attention layers quantize their queries with different args; calibrate them with one "
                        "attention_scheme")
    args = next(iter(queried.values()))
    group = scheme_json(sorted(queried), None, args_json(_ct_args(args)))
    data["config_groups"][f"group_{len(data['config_groups'])}"] = group


@torch.no_grad()
def attention_scales(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``<attn>.k_scale`` / ``<attn>.v_scale`` (and ``q_scale``) of every attention layer with calibrated scales
    (the copies the attention state keeps: a streamed run has released the modules' own by the end)."""
    state = {}
    for name, module in quantized_attention(model).items():
        prefix = f"{name}." if name else ""
        scales = attention_state(module).scales
        for buffer in ("q_scale", "k_scale", "v_scale"):
            if buffer in scales:
                state[f"{prefix}{buffer}"] = scales[buffer].contiguous()
    return state


def packed_with_inputs(args: QuantizationArgs, input_args: QuantizationArgs | None) -> bool:
    """int4 weights with quantized inputs (``W4AFP8``): packed, but compressed-tensors 0.20 infers
    ``int-quantized`` for any integer weight with quantized inputs, so the group names its format."""
    return input_args is not None and weight_format(args, input_args) == FORMAT


def packs_zero_point(args: QuantizationArgs, input_args: QuantizationArgs | None) -> bool:
    """Is the weight's zero point stored packed (asymmetric, ``pack-quantized``, channel or group strategy)?
    transformers 5.24 loads those layers only through its dequantize-on-load path."""
    return (not args.symmetric and weight_format(args, input_args) == FORMAT
            and args.strategy in ("channel", "group"))


# -- weights -----------------------------------------------------------------------------
@torch.no_grad()
def compressed_state_dict(model: torch.nn.Module, modules: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The model's state dict with each quantized weight replaced by its packed form."""
    state = dict(model.state_dict())
    for name, module in modules.items():
        state.pop(f"{name}.weight" if name else "weight")
        state.update(quantized_tensors(name, module))
    return state


@torch.no_grad()
def quantized_tensors(name: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What quantized module ``name`` is saved as: its encoded weight and qparams (every other tensor of
    the module is saved as it is)."""
    args: QuantizationArgs = module.quantization_args
    prefix = f"{name}." if name else ""
    # in its own dtype: quantizing divides by the float32 scale, which computes in float32 a slice at a time
    # (the same values as a float32 copy of the whole weight, without making one)
    weight = linear_weight(module).detach().to("cpu")
    if weight.dtype == torch.float64:  # float64 would divide in float64: not the float32 values saved before
        weight = weight.to(torch.float32)
    scale = module.weight_scale.detach().to("cpu")
    zero_point = module.weight_zero_point.detach().to("cpu")
    g_idx = getattr(module, "weight_g_idx", None)
    if g_idx is not None:
        trivial = default_g_idx(weight.shape[1], args.group_size)
        if not torch.equal(g_idx.to("cpu", torch.int32), trivial):
            raise SaveError(
                f"layer {name!r} has a reordered group index (GPTQ actorder='group'); compressed-tensors "
                f"{_ct_version()} no longer stores weight_g_idx, so this cannot be loaded back. "
                f"Use actorder='static' (same format, no g_idx) or actorder=None")
    input_args = getattr(module, "input_quantization_args", None)
    fmt = weight_format(args, input_args)
    # compress() kept the codes from its own quantization (4-bit ones packed already): no second one
    packed = take_packed_weight_codes(module) if fmt == FORMAT and args.float_format is None else None
    q = take_weight_codes(module) if packed is None else None
    if q is None and packed is None:
        q = quantize_weight(weight, scale.to(torch.float32), zero_point.to(torch.float32), args)
    q = None if q is None else q.to("cpu")
    if args.float_format is not None:  # symmetric: no zero point
        state = {f"{prefix}{key}": value for key, value in
                 float_format_tensors(q, scale, getattr(module, "weight_global_scale", None), args).items()}
        return {**state, **_input_tensors(prefix, module, input_args)}
    state = {f"{prefix}weight_scale": scale.to(module.weight.dtype).contiguous()}
    if fmt == "float-quantized":
        state[f"{prefix}weight"] = q.to(torch.float8_e4m3fn).contiguous()
    elif fmt == "int-quantized":
        state[f"{prefix}weight"] = q.to(torch.int8).contiguous()
    else:
        state[f"{prefix}weight_packed"] = (packed.to("cpu") if packed is not None
                                           else pack_to_int32(q.to(torch.int8), args.num_bits))
        state[f"{prefix}weight_shape"] = torch.tensor(list(weight.shape), dtype=torch.int64)
    if not args.symmetric:
        zp = torch.round(zero_point).to(torch.int8)
        if fmt == FORMAT and args.strategy in ("channel", "group"):
            zp = pack_to_int32(zp, args.num_bits, packed_dim=0)
        state[f"{prefix}weight_zero_point"] = zp.contiguous()
    return {**state, **_input_tensors(prefix, module, input_args)}


def _input_tensors(prefix: str, module: torch.nn.Module, input_args: QuantizationArgs | None) -> dict[str, torch.Tensor]:
    """The calibrated input scales: static ones (``input_scale``, ``input_zero_point``), NVFP4's float32
    ``input_global_scale``; nothing for dynamic inputs."""
    if input_args is None or not input_args.calibrated:
        return {}
    if input_args.strategy == "tensor_group":
        return {f"{prefix}input_global_scale": module.input_global_scale.detach().to("cpu", torch.float32).contiguous()}
    state = {f"{prefix}input_scale": module.input_scale.detach().to("cpu").contiguous()}
    if not input_args.symmetric:
        state[f"{prefix}input_zero_point"] = torch.round(module.input_zero_point.detach()).to(
            "cpu", torch.int8).contiguous()
    return state


def float_format_tensors(q: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                         args: QuantizationArgs) -> dict[str, torch.Tensor]:
    """The stored tensors of an NVFP4 / MXFP4 / MXFP8 weight from its grid values ``q`` (``(out, in)``, float),
    effective float32 block ``scale`` and (NVFP4) ``global_scale``: what compressed-tensors 0.20 writes."""
    state: dict[str, torch.Tensor] = {}
    if args.num_bits == 4:
        state["weight_packed"] = pack_fp4(fp4_codes(q, on_grid=True)).contiguous()  # q: E2M1 values
    else:
        state["weight"] = q.to(torch.float8_e4m3fn).contiguous()
    if args.float_format == "nvfp4":
        if global_scale is None:
            raise SaveError("an NVFP4 layer lacks weight_global_scale; quantize it with layerwise (its global scale "
                            "is stored beside the block scales)")
        global_scale = global_scale.detach().to("cpu", torch.float32).reshape(1)
        state["weight_scale"] = nvfp4_block_scales(scale, global_scale).contiguous()
        state["weight_global_scale"] = global_scale.contiguous()
    else:
        state["weight_scale"] = e8m0_codes(scale).contiguous()
    return state


def _ct_version() -> str:
    try:
        from importlib.metadata import version

        return version("compressed-tensors")
    except Exception:  # noqa: BLE001
        return "(installed)"


def _inside(folder: Path, relative: str) -> Path:
    path = (folder / relative).resolve()
    if folder.resolve() not in path.parents:
        raise SaveError(f"extra file name {relative!r} points outside the output folder")
    return path


def _yaml(data: Any) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


class CompressedTensorsSaver(Saver):
    """The compressed-tensors format, in memory or streamed piece by piece (each module encoded as its
    piece ends, the folder completed at the end)."""

    streams = True

    def save(self, model: torch.nn.Module, output_dir: str | os.PathLike, **options: Any) -> Path:
        return save_compressed(model, output_dir, **options)

    def save_streamed(self, model: torch.nn.Module, stream: Any, output_dir: str | os.PathLike,
                      **options: Any) -> Path:
        return save_streamed(model, stream, output_dir, **options)

    def encode_module(self, name: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return quantized_tensors(name, module)

    def quantization_config(self, model: torch.nn.Module, modules: dict[str, torch.nn.Module],
                            extra_ignore: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
        config = build_quantization_config(model, modules)
        if config["config_groups"]:
            config["ignore"] = list(dict.fromkeys([*config["ignore"], *extra_ignore]))
        return config

    def saved_bytes(self, model: torch.nn.Module) -> int:
        """The bytes of the tensors :func:`compressed_state_dict` writes, without encoding anything: quantized
        weights in their stored form and their qparams (:func:`quantized_bytes`), every other tensor (pruned
        weights included: they are stored dense) as it is; a tied tensor once, as on disk."""
        total = 0
        seen: set[tuple] = set()
        for module in model.modules():
            args = getattr(module, "quantization_args", None)
            for name, param in module.named_parameters(recurse=False):
                if not first_time(param, seen):
                    continue
                if name == "weight" and args is not None:
                    total += quantized_bytes(module)
                else:
                    total += param.numel() * param.element_size()
        return total


def quantized_bytes(module: torch.nn.Module) -> int:
    """What :func:`quantized_tensors` writes for one quantized module, counted from shapes alone."""
    args: QuantizationArgs = module.quantization_args
    input_args = getattr(module, "input_quantization_args", None)
    rows, columns = linear_weight(module).shape
    fmt = weight_format(args, input_args)
    if args.float_format is not None:
        total = rows * columns * args.num_bits // 8 + module.weight_scale.numel()  # fp8 / e8m0 scales: a byte each
        total += 4 if args.float_format == "nvfp4" else 0  # the float32 global scale
    elif fmt == FORMAT:
        total = rows * -(-columns * args.num_bits // 32) * 4 + 2 * 8  # int32 words, and weight_shape
    else:
        total = rows * columns  # int8 or float8
    scale = module.weight_scale
    if args.float_format is None:
        total += scale.numel() * module.weight.element_size()  # stored in the weight's dtype
    if not args.symmetric:
        zero_rows = scale.shape[0] if scale.dim() else 1
        if fmt == FORMAT and args.strategy in ("channel", "group"):
            total += -(-zero_rows * args.num_bits // 32) * (scale.numel() // max(zero_rows, 1)) * 4
        else:
            total += scale.numel()  # int8
    if input_args is not None and input_args.strategy == "tensor_group":
        total += 4  # the float32 input_global_scale
    elif input_args is not None and not input_args.dynamic:
        total += module.input_scale.numel() * module.input_scale.element_size()
        if not input_args.symmetric:
            total += module.input_zero_point.numel()
    return total
