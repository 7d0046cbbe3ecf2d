"""AWQ against round-to-nearest, layer by layer, on a trained model (tiny-llama-doc).

For every norm mapping AWQ smoothed (``input_layernorm`` -> q/k/v, ``post_attention_layernorm`` ->
gate/up) the error is measured on held-out text, as the composite the model computes: the fp32
model's input ``h`` of the norm, then ``balance(norm(h))`` of the fp32 model (reference), of the AWQ
model (its smoothed norm, its quantized layer) and of the RTN model (fp32 norm, quantized layer):
``||y - y_ref|| / ||y_ref||`` summed over the eval windows (a ``v_proj`` whose outputs the
``v_proj -> o_proj`` mapping divided by its scales is multiplied back first). ``v_proj -> o_proj`` mappings have no
such composite (attention sits between them): their search loss against round-to-nearest on the
calibration rows, from AWQ's own summary, is printed instead. Both quantize with the same scheme
(W4A16_ASYM group 128 by default, ``--bits 3`` for 3-bit).

    python bench/awq_layer_bench.py             # markdown on stdout
    python bench/awq_layer_bench.py --bits 3 --quick
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gptq_bench import CALIB, EVAL, TINY_LLAMA, _windows


def compressed(algorithm: str, bits: int, calib: list) -> tuple[torch.nn.Module, object]:
    """tiny-llama-doc compressed by ``algorithm`` (the modifier class's name), and the modifier."""
    import layerwise
    from layerwise.host.plugin_manager import registry
    from layerwise.model_io.loading import load_model

    modifier = registry("modifiers").get(algorithm)(scheme="W4A16_ASYM", num_bits=bits, ignore=["lm_head"])
    model = layerwise.compress(load_model(TINY_LLAMA), [modifier], dataset=calib, show_progress=False)
    return model, modifier


def norm_inputs(model: torch.nn.Module, windows: list) -> dict[str, list[torch.Tensor]]:
    """Each decoder norm's input in the fp32 model, per eval window."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = [m.register_forward_pre_hook(lambda mod, args, n=n: seen.setdefault(n, []).append(args[0].detach()))
               for n, m in model.named_modules() if n.endswith(("input_layernorm", "post_attention_layernorm"))]
    with torch.no_grad():
        for ids in windows:
            model(input_ids=ids)
    for handle in handles:
        handle.remove()
    return seen


def composite_errors(fp32, models: dict[str, torch.nn.Module], inputs: dict, mappings,
                     undo: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, float]]:
    """``undo[model][layer]``: scales a later mapping divided the layer's outputs by (v_proj for v -> o),
    multiplied back so the layer is compared with what it computes for the rest of the model."""
    errors: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for norm, layers in mappings:
            for layer in layers:
                sums = {name: [0.0, 0.0] for name in models}
                for h in inputs[norm]:
                    ref = fp32.get_submodule(layer)(fp32.get_submodule(norm)(h))
                    for name, model in models.items():
                        out = model.get_submodule(layer)(model.get_submodule(norm)(h))
                        if layer in undo.get(name, {}):
                            out = out * undo[name][layer]
                        sums[name][0] += (out - ref).square().sum().item()
                        sums[name][1] += ref.square().sum().item()
                errors[layer] = {name: (a / b) ** 0.5 for name, (a, b) in sums.items()}
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=4, choices=(3, 4))
    parser.add_argument("--quick", action="store_true", help="16 calibration and 8 eval windows")
    args = parser.parse_args()
    from layerwise.model_io.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(TINY_LLAMA)
    n_calib, n_eval = (16, 8) if args.quick else (128, 32)
    calib = [{"input_ids": w, "attention_mask": torch.ones_like(w)} for w in _windows(tokenizer, CALIB, n_calib, 512)]
    held_out = _windows(tokenizer, EVAL, n_eval, 512)
    fp32 = load_model(TINY_LLAMA)
    (awq, awq_modifier), (rtn, _) = (compressed("AWQModifier", args.bits, calib),
                                      compressed("QuantizationModifier", args.bits, calib))
    mappings = [(f"model.layers.{i}.{norm}", [f"model.layers.{i}.{prefix}.{p}_proj" for p in projections])
                for i in range(len(fp32.model.layers))
                for norm, prefix, projections in (("input_layernorm", "self_attn", "qkv"),
                                                  ("post_attention_layernorm", "mlp", ("gate", "up")))]
    errors = composite_errors(fp32, {"AWQ": awq, "RTN": rtn}, norm_inputs(fp32, held_out), mappings,
                              {"AWQ": awq_modifier.scales})
    print(f"#### AWQ vs RTN per layer, int{args.bits} asymmetric group 128, tiny-llama-doc "
          f"({len(calib)} x 512-token calibration windows, {len(held_out)} held-out windows)\n")
    print("| layer | AWQ error | RTN error | AWQ / RTN |\n|---|---|---|---|")
    for layer, e in errors.items():
        print(f"| {layer} | {e['AWQ']:.4f} | {e['RTN']:.4f} | {e['AWQ'] / e['RTN']:.3f} |")
    worse = [layer for layer, e in errors.items() if e["AWQ"] > e["RTN"]]
    print(f"\nAWQ below RTN on {len(errors) - len(worse)} of {len(errors)} norm-mapped layers"
          + (f"; above on {', '.join(worse)}" if worse else ""))
    searched = [r for r in awq_modifier.summary if r["smoothed"].endswith("v_proj") and "loss" in r]
    if searched:
        print("\n| v_proj -> o_proj (calibration rows) | AWQ loss | RTN loss | AWQ / RTN |\n|---|---|---|---|")
        for r in searched:
            print(f"| {r['smoothed']} | {r['loss']:.4g} | {r['rtn_loss']:.4g} | {r['loss'] / r['rtn_loss']:.3f} |")


if __name__ == "__main__":
    main()
