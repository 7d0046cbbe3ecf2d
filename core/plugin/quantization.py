"""Quantization for plugins: schemes, the math, storage on a module, solvers and smoothing mappings."""

from layerwise.algorithms.quantization.args import (
    ACTORDERS,
    QuantizationArgs,
    QuantizationScheme,
    recipe_actorder,
)
from layerwise.algorithms.quantization.attention import (
    AttentionError,
    attach,
    attention_state,
    find_attention_modules,
    quantized_attention,
    set_attention_scales,
)
from layerwise.algorithms.quantization.autoround import (
    AutoRoundError,
    BlockSample,
    Rounding,
    TuneResult,
    block_output,
    check_autoround_args,
    quantize_learned,
    tune_block,
)
from layerwise.algorithms.quantization.awq import search_flops, search_scales
from layerwise.algorithms.quantization.config_groups import (
    ConfigGroup,
    read_config_groups,
    recipe_observer,
    split_observers,
)
from layerwise.algorithms.quantization.float_formats import (
    e8m0_codes,
    fp4_codes,
    nvfp4_block_scales,
    nvfp4_global_scale,
    pack_fp4,
)
from layerwise.algorithms.quantization.global_scales import fused_groups, fused_sets, global_scales
from layerwise.algorithms.quantization.gptq import (
    GPTQError,
    GPTQResult,
    gptq_quantize,
    rtn_quantize,
)
from layerwise.algorithms.quantization.int_packing import pack_to_int32
from layerwise.algorithms.quantization.kv_cache import kv_amax, kv_cache_args, kv_scale
from layerwise.algorithms.quantization.mappings import (
    Mapping,
    MappingError,
    ResolvedMapping,
    mappings_for_run,
    recipe_mappings,
    split_by_piece,
)
from layerwise.algorithms.quantization.observer import Observer
from layerwise.algorithms.quantization.online_rotation import (
    OnlineRotationError,
    flip_online_signs,
    online_hadamards,
    rotate_inputs_online,
    transform_config,
)
from layerwise.algorithms.quantization.presets import (
    DEFAULT_TARGETS,
    preset_targets,
    resolve_scheme,
)
from layerwise.algorithms.quantization.qmath import (
    compute_qparams,
    default_g_idx,
    expand_qparams,
    fake_quantize,
    quantize_weight,
    weight_global_scale,
    weight_qparams,
)
from layerwise.algorithms.quantization.rotation import (
    LLAMA_LIKE,
    ResolvedLayout,
    RotationError,
    RotationLayout,
    check_rotatable,
    refused_layout,
    rotate_heads,
    rotate_residual_stream,
)
from layerwise.algorithms.quantization.smoothing import apply_smoothing
from layerwise.algorithms.quantization.smoothquant import smoothquant_scales
from layerwise.algorithms.quantization.storage import (
    is_transposed,
    linear_weight,
    quantized_modules,
    replace_data,
    set_input_quantization,
    set_quantized_weight,
    take_packed_weight_codes,
    take_weight_codes,
)
from layerwise.tracing.smoothing_layout import discover_mappings

__all__ = [
    "ACTORDERS",
    "DEFAULT_TARGETS",
    "LLAMA_LIKE",
    "AttentionError",
    "AutoRoundError",
    "BlockSample",
    "ConfigGroup",
    "GPTQError",
    "GPTQResult",
    "Mapping",
    "MappingError",
    "Observer",
    "OnlineRotationError",
    "QuantizationArgs",
    "QuantizationScheme",
    "ResolvedLayout",
    "ResolvedMapping",
    "RotationError",
    "RotationLayout",
    "Rounding",
    "TuneResult",
    "apply_smoothing",
    "attach",
    "attention_state",
    "block_output",
    "check_autoround_args",
    "check_rotatable",
    "compute_qparams",
    "default_g_idx",
    "discover_mappings",
    "e8m0_codes",
    "expand_qparams",
    "fake_quantize",
    "find_attention_modules",
    "flip_online_signs",
    "fp4_codes",
    "fused_groups",
    "fused_sets",
    "global_scales",
    "gptq_quantize",
    "is_transposed",
    "kv_amax",
    "kv_cache_args",
    "kv_scale",
    "linear_weight",
    "mappings_for_run",
    "nvfp4_block_scales",
    "nvfp4_global_scale",
    "online_hadamards",
    "pack_fp4",
    "pack_to_int32",
    "preset_targets",
    "quantize_learned",
    "quantize_weight",
    "quantized_attention",
    "quantized_modules",
    "read_config_groups",
    "recipe_actorder",
    "recipe_mappings",
    "recipe_observer",
    "refused_layout",
    "replace_data",
    "resolve_scheme",
    "rotate_heads",
    "rotate_inputs_online",
    "rotate_residual_stream",
    "rtn_quantize",
    "search_flops",
    "search_scales",
    "set_attention_scales",
    "set_input_quantization",
    "set_quantized_weight",
    "smoothquant_scales",
    "split_by_piece",
    "split_observers",
    "take_packed_weight_codes",
    "take_weight_codes",
    "transform_config",
    "tune_block",
    "weight_global_scale",
    "weight_qparams",
]
