"""compressed-tensors' ``quantization_config`` dicts, built without importing compressed-tensors.

Saving needs plain JSON values, and importing compressed-tensors' classes to validate and dump them was
about an eighth of a data-free run's time on a 122M-weight model (0.1-0.2 s warm, more on a cold, loaded
machine). These functions give what compressed-tensors 0.20's ``QuantizationArgs(**fields)``,
``QuantizationScheme`` and ``QuantizationConfig`` ``.model_dump(mode="json")`` give for the fields the saver
passes (``_ct_args``): its serializer leaves out ``actorder``, ``block_structure`` and ``scale_dtype`` when
``None``, an ``observer`` that is ``None``, empty ``observer_kwargs``, and ``zp_dtype`` of symmetric args.
``tests/plugins/savers/test_ct_config.py`` compares them with compressed-tensors' own for every preset and
variant the saver writes; compressed-tensors, transformers and vLLM read them back.
"""

from __future__ import annotations

from typing import Any


def args_json(fields: dict[str, Any]) -> dict[str, Any]:
    """A ``QuantizationArgs`` dict from the saver's fields (num_bits, type, symmetric, strategy, group_size,
    dynamic, observer, and optional scale_dtype / zp_dtype (torch dtypes), block_structure, actorder)."""
    data = {key: fields.get(key, default) for key, default in
            (("num_bits", 8), ("type", "int"), ("symmetric", True), ("group_size", None), ("strategy", None),
             ("dynamic", False))}
    for key in ("block_structure", "actorder", "observer"):
        if fields.get(key) is not None:
            data[key] = list(fields[key]) if key == "block_structure" else fields[key]
    if fields.get("scale_dtype") is not None:
        data["scale_dtype"] = str(fields["scale_dtype"])
    if fields.get("zp_dtype") is not None and not data["symmetric"]:
        data["zp_dtype"] = str(fields["zp_dtype"])
    return data


def scheme_json(targets: list[str], weights: dict[str, Any] | None, input_activations: dict[str, Any] | None,
                fmt: str | None = None) -> dict[str, Any]:
    """A ``QuantizationScheme`` dict (``weights`` / ``input_activations`` from :func:`args_json`)."""
    return {"targets": list(targets), "weights": weights, "input_activations": input_activations,
            "output_activations": None, "format": fmt}


def config_json(groups: dict[str, dict[str, Any]], fmt: str, ignore: list[str]) -> dict[str, Any]:
    """A compressed ``QuantizationConfig`` dict (``groups`` from :func:`scheme_json`)."""
    return {"config_groups": groups, "quant_method": "compressed-tensors", "kv_cache_scheme": None, "format": fmt,
            "quantization_status": "compressed", "global_compression_ratio": None, "ignore": list(ignore),
            "moe_sparsity_config": None}
