"""MoE experts on a reloaded compressed model: transformers 5 loads them fused (3-D ``gate_up_proj`` /
``down_proj``) and runs them without the input quantization their config groups give them; here they are
unfused by the model's patch and their inputs quantized again, static scales read back from the folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from layerwise.common.user_warnings import warn_user
from layerwise.errors import ModelLoadError
from layerwise.model_io.checkpoint_tensors import (
    named_entry,
    renamed_as_loaded,
    saved_input_qparams,
)


def unfuse_experts(model: torch.nn.Module) -> None:
    """Unfuse the MoE experts transformers loaded fused (their float-format tensors were left out), by the model's
    patch, so that each expert's layers take their decoded weights and input quantization."""
    from layerwise.host.patch_selection import apply_patch, resolve_patch

    if any(fused_experts(module) for module in model.modules()):
        apply_patch(model, resolve_patch(model))


def undecoded_experts_error(where: str, stems: list[str]) -> ModelLoadError:
    return ModelLoadError(
        f"{where!r} stores the MoE experts' layers ({stems[0]}{f' and {len(stems) - 1} more' if len(stems) > 1 else ''}"
        f") as NVFP4 / MXFP4 / MXFP8 / int8, which transformers 5.24 decodes wrongly (int8: not at all) into its fused "
        f"experts, and layerwise "
        f"found no per-expert layer of the model to decode them into (no model patch unfuses this model's experts, "
        f"or it names them differently): register a model patch whose apply unfuses them (GUIDE.md, "
        f"expert_projections)")


def restore_expert_inputs(model: torch.nn.Module, quant: dict[str, Any], where: str) -> list[str]:
    """When a config group quantizes layer inputs and transformers loaded the MoE experts fused (3-D
    ``gate_up_proj`` / ``down_proj``, as transformers 5 loads them), they would run without that input
    quantization: neither the compressed model nor what vLLM serves. The experts are unfused again by the model's
    patch (their weights are the saved ones) and their Linear layers quantize their inputs as the group says,
    static ones with each expert's saved scales (transformers drops them as unexpected keys: read back from the
    folder's weights). Experts left without their scales, and NVFP4 experts still fused (their per-expert tensors
    not in a local folder: :func:`~layerwise.model_io.compressed_loading.load_compressed` decodes and unfuses them otherwise), are warned about. Returns
    the layers restored. ``quant``: the folder's quantization_config."""
    from layerwise.algorithms.quantization.config_groups import read_config_groups
    from layerwise.algorithms.quantization.storage import set_input_quantization
    from layerwise.common.matching import find_modules, matches
    from layerwise.host.patch_selection import apply_patch, resolve_patch

    saved = {key: {k: v for k, v in group.items() if k != "format"}
             for key, group in (quant.get("config_groups") or {}).items()}
    if not saved or not any(fused_experts(module) for module in model.modules()):
        return []
    groups = [g for g in read_config_groups(saved, "quantization_config.config_groups")
              if g.scheme is not None and g.scheme.input_activations is not None]
    ignore = list(quant.get("ignore") or [])
    layer = torch.nn.Linear(1, 1, device="meta")  # what a group's targets and ignore say of an expert's layer
    leaves = _expert_projections(model)

    def quantizes(name: str, targets: list[str]) -> bool:  # the first expert's layers of fused experts `name`
        return any(matches(f"{name}.0.{leaf}", layer, targets) for leaf in leaves)

    fused = [name for name, module in model.named_modules() if fused_experts(module)
             and any(quantizes(name, g.targets) for g in groups) and not quantizes(name, ignore)]
    if not fused:
        return []
    expert_groups = [g for g in groups if any(quantizes(name, g.targets) for name in fused)]
    if any(g.scheme.input_activations.strategy == "tensor_group" for g in expert_groups):
        _warn_experts_unquantized(where, fused, "layerwise decodes NVFP4 experts and puts their calibrated global "
                                                "input scales back from a local folder's per-expert tensors only",
                                  weights_as_saved=False)  # transformers decodes them without the global scale
        return []
    folder = Path(where).expanduser()
    static = any(not g.scheme.input_activations.dynamic for g in expert_groups)
    if static and not folder.is_dir():
        _warn_experts_unquantized(where, fused, "their calibrated input scales are read from a local folder only")
        return []
    apply_patch(model, resolve_patch(model))
    if any(fused_experts(module) for module in model.modules()):
        _warn_experts_unquantized(where, fused, "transformers loads them fused and no model patch unfuses them")
        return []
    scales = saved_input_qparams(folder, ".experts.", renamed_as_loaded(model)) if static else {}
    restored, unscaled = [], []
    for group in groups:
        inputs = group.scheme.input_activations
        for name, module in find_modules(model, group.targets, ignore).items():
            if ".experts." not in f".{name}" or getattr(module, "input_quantization_args", None) is not None:
                continue
            qparams = named_entry(scales, name, getattr(model, "base_model_prefix", ""))
            if not inputs.dynamic and "input_scale" not in qparams:
                unscaled.append(name)
                continue
            set_input_quantization(module, inputs, scale=qparams.get("input_scale"),
                                   zero_point=qparams.get("input_zero_point"))
            restored.append(name)
    if unscaled:
        _warn_experts_unquantized(where, unscaled, "the folder holds no calibrated input scales for them")
    return restored


def _expert_projections(model: torch.nn.Module) -> tuple[str, ...]:
    """One expert's (gate, up, down) layer names once the model's patch unfuses its experts (Mixtral's w1, w3, w2),
    as the config groups' targets name them."""
    from layerwise.host.patch_selection import resolve_patch

    patch = resolve_patch(model)
    return tuple(getattr(patch, "expert_projections", None) or ()) or ("gate_proj", "up_proj", "down_proj")


def _warn_experts_unquantized(where: str, names: list[str], why: str, weights_as_saved: bool = True) -> None:
    weights = "the dense layers and the weights are as saved" if weights_as_saved else \
        "the experts' weights are not the saved ones either"
    warn_user(f"{where!r}: the MoE experts ({names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''}) "
              f"run without the input quantization the checkpoint's config groups give them ({why}), so this "
              f"model's outputs differ from the compressed model's and vLLM's; {weights}")


def fused_experts(module: torch.nn.Module) -> bool:
    return all(isinstance(getattr(module, key, None), torch.Tensor) and getattr(module, key).dim() == 3
               for key in ("gate_up_proj", "down_proj"))
