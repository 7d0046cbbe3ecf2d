"""Quantization settings as frozen dataclasses: what to quantize and how.

:class:`QuantizationArgs` describes one tensor's quantization (type, bits, symmetry,
granularity); :class:`QuantizationScheme` pairs weight args, and optionally input-activation
args, with the module targets they apply to. Both validate on construction and name the
valid values. Field names and meanings follow compressed-tensors, so a scheme saves as is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from layerwise.errors import RecipeError, did_you_mean, unknown_names

TYPES = ("int", "float")
#: tensor / channel / group / block / tensor_group for weights; tensor / token / group / tensor_group for activations;
#: tensor / attn_head (one scale per attention head) for the keys and values of the KV cache (:mod:`.kv_cache`)
STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")
WEIGHT_STRATEGIES = ("tensor", "channel", "group", "block", "tensor_group")
ACTIVATION_STRATEGIES = ("tensor", "token", "group", "tensor_group")
#: the strategies that take no group_size
UNGROUPED = ("tensor", "channel", "block", "token", "attn_head")
BITS = (2, 3, 4, 8)
FLOAT_BITS = (4, 8)
ACTORDERS = (None, "static", "group")
#: a recipe's activation orders -> layerwise's: compressed-tensors calls ``static`` ``weight``
RECIPE_ACTORDERS = {"static": "static", "weight": "static"}
#: the group ordering under its names (``true`` was its old spelling): removed from compressed-tensors, refused
#: by llm-compressor 0.14 when the recipe is built; its group index cannot be saved in a compressed-tensors
#: checkpoint, so a recipe cannot ask for it (the solver still takes ``"group"`` for code that keeps the model)
REMOVED_ACTORDERS = ("group", "dynamic", True)
#: how block scales are stored: ``None`` in the weight's dtype; ``float8_e4m3fn`` (NVFP4's block scales, with a
#: global scale); ``e8m0`` power-of-two exponents (the MX formats; compressed-tensors spells it ``uint8``)
SCALE_DTYPES = (None, "float8_e4m3fn", "e8m0")
_SCALE_DTYPE_ALIASES = {"uint8": "e8m0", "torch.uint8": "e8m0", "torch.float8_e4m3fn": "float8_e4m3fn"}
#: FP4 is stored in exactly two ways (compressed-tensors' formats and vLLM's kernels know no other)
FP4_LAYOUTS = {"tensor_group": (16, "float8_e4m3fn"), "group": (32, "e8m0")}


@dataclass(frozen=True)
class QuantizationArgs:
    """How one tensor (a weight or a layer's input activations) is quantized.

    * ``type``: ``"int"`` (signed integers) or ``"float"`` (symmetric: float8 e4m3 with 8 bits, fp4
      e2m1 with 4, see :mod:`.float_formats`);
    * ``num_bits``: 2, 3, 4 or 8 for integers (int4 is -8..7, int8 is -128..127), 4 or 8 for floats;
    * ``symmetric``: zero point fixed at 0 (``True``) or fitted to the range;
    * ``strategy``: one scale for the whole ``"tensor"``, one per output ``"channel"``, one per
      ``group_size`` consecutive input columns (``"group"``), one per ``block_structure`` tile of
      a weight (``"block"``), one per token of an activation (``"token"``), or one per group with one
      float32 global scale for the whole tensor (``"tensor_group"``, NVFP4);
    * ``dynamic``: activations only: scales computed from each input as it comes (nothing
      calibrated or stored; with ``tensor_group``, NVFP4's inputs, the block scales come from each
      input and the global scale is calibrated: compressed-tensors' ``dynamic: local``)
      calibrated or stored) instead of calibrated once;
    * ``observer``: name of a registered observer that measures the range;
    * ``actorder``: GPTQ activation ordering (``None``, ``"static"``, ``"group"``);
    * ``scale_dtype``: how the scales are stored (:data:`SCALE_DTYPES`): ``None`` in the weight's dtype,
      ``"float8_e4m3fn"`` (NVFP4), ``"e8m0"`` (MXFP4 / MXFP8: powers of two). FP4 fills it in.

    The low-bit float formats: NVFP4 is ``type float, num_bits 4, strategy tensor_group, group_size 16``;
    MXFP4 ``type float, num_bits 4, strategy group, group_size 32, scale_dtype e8m0``; MXFP8 the same with
    ``num_bits 8``.
    """

    num_bits: int = 4
    symmetric: bool = True
    strategy: str = "group"
    group_size: int | None = 128
    observer: str = "minmax"
    actorder: str | None = None
    type: str = "int"
    dynamic: bool = False
    block_structure: tuple[int, int] | None = None
    scale_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise RecipeError(f"unknown type {self.type!r};{did_you_mean(self.type, TYPES)} valid types: "
                              f"{', '.join(TYPES)}")
        if self.type == "float" and (self.num_bits not in FLOAT_BITS or not self.symmetric):
            raise RecipeError(f"type 'float' is float8 e4m3 (num_bits 8) or fp4 e2m1 (num_bits 4), symmetric; got "
                              f"num_bits={self.num_bits!r}, symmetric={self.symmetric!r}")
        if isinstance(self.num_bits, bool) or self.num_bits not in BITS:
            raise RecipeError(f"num_bits={self.num_bits!r} is not supported; valid num_bits: "
                              f"{', '.join(map(str, BITS))}")
        if not isinstance(self.symmetric, bool):
            raise RecipeError(f"symmetric must be true or false, got {self.symmetric!r}")
        if self.strategy not in STRATEGIES:
            raise RecipeError(f"unknown strategy {self.strategy!r};{did_you_mean(self.strategy, STRATEGIES)} valid "
                              f"strategies: {', '.join(STRATEGIES)}")
        if self.strategy in ("group", "tensor_group") and (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)
                                         or self.group_size <= 0):
            raise RecipeError(f"strategy {self.strategy!r} needs a positive integer group_size, got {self.group_size!r} "
                              f"(or use strategy 'channel')")
        if self.actorder not in ACTORDERS:
            raise RecipeError(f"unknown actorder {self.actorder!r}; valid actorders: None, static, group")
        if self.actorder == "group" and self.strategy != "group":
            raise RecipeError("actorder 'group' needs strategy 'group'")
        if not isinstance(self.observer, str) or not self.observer:
            raise RecipeError(f"observer must be a registered observer name, got {self.observer!r}")
        if not isinstance(self.dynamic, bool):
            raise RecipeError(f"dynamic must be true or false, got {self.dynamic!r}")
        if self.strategy == "block":
            block = self.block_structure
            if (not isinstance(block, (list, tuple)) or len(block) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
                raise RecipeError(f"strategy 'block' needs block_structure [rows, columns] of positive integers, "
                                  f"got {block!r}")
            object.__setattr__(self, "block_structure", tuple(block))
        elif self.block_structure is not None:
            raise RecipeError("block_structure goes with strategy 'block'")
        self._check_float_layout()

    def _check_float_layout(self) -> None:
        """The scale layouts that exist: NVFP4 (tensor_group, 16, fp8 scales), MX (group 32, e8m0 scales)."""
        scale_dtype = _SCALE_DTYPE_ALIASES.get(str(self.scale_dtype), self.scale_dtype)
        if scale_dtype not in SCALE_DTYPES:
            raise RecipeError(f"unknown scale_dtype {self.scale_dtype!r}; valid: float8_e4m3fn (NVFP4), e8m0 "
                              f"(MXFP4 / MXFP8), or leave it out (scales in the weight's dtype)")
        if self.type == "float" and self.num_bits == 4:
            if self.strategy not in FP4_LAYOUTS:
                raise RecipeError(f"fp4 (type float, num_bits 4) has scales per block: strategy tensor_group "
                                  f"(NVFP4, group_size 16) or group (MXFP4, group_size 32), not {self.strategy!r}")
            size, expected = FP4_LAYOUTS[self.strategy]
            name = "NVFP4" if self.strategy == "tensor_group" else "MXFP4"
            if self.group_size != size:
                raise RecipeError(f"fp4 with strategy {self.strategy!r} is {name}, whose blocks are {size} values: "
                                  f"group_size {size}, not {self.group_size!r}")
            scale_dtype = scale_dtype or expected
            if scale_dtype != expected:
                raise RecipeError(f"{name} stores its block scales as {expected}, not scale_dtype {scale_dtype!r}")
        if self.strategy == "tensor_group" and (self.type != "float" or self.num_bits != 4):
            raise RecipeError("strategy 'tensor_group' (a global scale over fp8 block scales) is NVFP4's: "
                              "type float, num_bits 4, group_size 16")
        if scale_dtype == "e8m0" and (self.type != "float" or self.strategy != "group" or self.group_size != 32):
            raise RecipeError("scale_dtype e8m0 is the MX formats' power-of-two scale: type float (num_bits 4 or 8), "
                              "strategy group, group_size 32")
        if scale_dtype == "float8_e4m3fn" and self.strategy != "tensor_group":
            raise RecipeError("scale_dtype float8_e4m3fn goes with NVFP4 (strategy tensor_group): fp8 block scales "
                              "need a global scale beside them")
        object.__setattr__(self, "scale_dtype", scale_dtype)

    @property
    def float_format(self) -> str | None:
        """``"nvfp4"``, ``"mxfp4"`` or ``"mxfp8"`` for the low-bit float layouts, else ``None``."""
        if self.strategy == "tensor_group":
            return "nvfp4"
        if self.scale_dtype == "e8m0":
            return f"mxfp{self.num_bits}"
        return None

    def check_for(self, role: str) -> None:
        """Refuse a strategy that makes no sense for ``role`` (``"weights"`` or ``"input_activations"``)."""
        valid = WEIGHT_STRATEGIES if role == "weights" else ACTIVATION_STRATEGIES
        if self.strategy not in valid:
            raise RecipeError(f"{role}: strategy {self.strategy!r} is not for {role.replace('_', ' ')}; "
                              f"valid: {', '.join(valid)}")
        if role == "weights" and self.dynamic:
            raise RecipeError("weights: dynamic is for activations (weights are quantized once)")
        if role == "input_activations" and self.actorder is not None:
            raise RecipeError("input_activations: actorder is a GPTQ setting for weights")
        if role == "input_activations" and self.strategy == "tensor_group" and not self.dynamic:
            raise RecipeError("input_activations: NVFP4 inputs (strategy tensor_group) take their block scales from "
                              "each input: dynamic: true (the global input scale is calibrated)")
        if role == "input_activations" and not self.dynamic and self.strategy != "tensor":
            raise RecipeError(f"input_activations: static (calibrated) scales are one per tensor; strategy "
                              f"{self.strategy!r} needs dynamic: true (scales computed from each input)")

    @property
    def calibrated(self) -> bool:
        """Does an input quantized with these args need calibration data? Static scales, and NVFP4's global
        input scale (its block scales are dynamic)."""
        return not self.dynamic or self.strategy == "tensor_group"

    @property
    def effective_group_size(self) -> int | None:
        """``group_size`` when the strategy is ``"group"``, else ``None``."""
        return self.group_size if self.strategy in ("group", "tensor_group") else None

    def replace(self, **changes: Any) -> QuantizationArgs:
        """A copy with some fields changed (validated again)."""
        if changes.get("strategy") in UNGROUPED and "group_size" not in changes:
            changes["group_size"] = None
        if self.float_format and ({"type", "num_bits", "strategy", "group_size"} & set(changes)
                                  and "scale_dtype" not in changes):
            changes["scale_dtype"] = None  # a changed layout infers its own scales (or says what to give)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantizationArgs:
        """Build from a recipe mapping; an unknown field is an error listing the valid ones."""
        if isinstance(data, QuantizationArgs):
            return data
        if not isinstance(data, dict):
            raise RecipeError(f"quantization args must be a mapping, got {data!r}")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in data if k not in valid]
        if unknown:
            raise RecipeError(f"unknown quantization field(s) {unknown_names(unknown, valid)}; "
                              f"valid fields: {', '.join(valid)}")
        data = dict(data)
        if data.get("strategy") in UNGROUPED and "group_size" not in data:
            data["group_size"] = None
        if isinstance(data.get("block_structure"), list):
            data["block_structure"] = tuple(data["block_structure"])
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if data["block_structure"] is not None:
            data["block_structure"] = list(data["block_structure"])
        return data


@dataclass(frozen=True)
class QuantizationScheme:
    """Weight quantization ``weights`` (and input-activation quantization ``input_activations``,
    if any) applied to modules matching ``targets``."""

    weights: QuantizationArgs
    targets: tuple[str, ...] = ("Linear",)
    input_activations: QuantizationArgs | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.weights, QuantizationArgs):
            raise RecipeError(f"QuantizationScheme.weights must be QuantizationArgs, got {self.weights!r}")
        self.weights.check_for("weights")
        if self.input_activations is not None:
            if not isinstance(self.input_activations, QuantizationArgs):
                raise RecipeError(f"QuantizationScheme.input_activations must be QuantizationArgs, got "
                                  f"{self.input_activations!r}")
            self.input_activations.check_for("input_activations")
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        else:
            object.__setattr__(self, "targets", tuple(self.targets))


def recipe_actorder(value: Any, where: str) -> str | None:
    """A recipe's ``actorder`` (``where`` names the field) as layerwise's: ``static`` / ``weight`` -> ``"static"``,
    ``null`` / ``false`` -> ``None``. The group ordering is refused here, when the recipe is read, as in
    llm-compressor 0.14, instead of after a whole calibration when the checkpoint cannot hold it."""
    if value is None or value is False:
        return None
    spelled = "true" if value is True else repr(value)
    if value is True or (isinstance(value, str) and value.lower() in REMOVED_ACTORDERS):
        raise RecipeError(f"{where} {spelled} is the group activation order, which compressed-tensors removed "
                          f"(a checkpoint cannot load its group index back) and llm-compressor refuses; write "
                          f"actorder: weight (layerwise's static, the default: the same format, no group index) "
                          f"or actorder: null (the original column order)")
    if not isinstance(value, str) or value.lower() not in RECIPE_ACTORDERS:
        raise RecipeError(f"{where} {spelled} is not an activation order; valid: static (compressed-tensors' "
                          f"weight, the default) or null")
    return RECIPE_ACTORDERS[value.lower()]
