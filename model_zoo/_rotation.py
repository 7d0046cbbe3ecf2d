"""Rotation layouts of the zoo's decoders that are Llama-like in their residual stream but not in their names.

Two variations on :data:`~layerwise.plugin.quantization.LLAMA_LIKE`:

* a mixture-of-experts decoder (:func:`moe_layout`): the MLP is a router plus experts, each a gated MLP as the
  patch's ``apply`` unfuses it (``mlp.experts.<e>.<gate|up|down>``), with DeepSeek's shared expert and dense
  first layers beside. Everything reading ``post_attention_layernorm`` must be rotated with it -- every gate and
  up, and the router, whose logits would change otherwise -- and every down writes to the stream;
* a vision-language model's text tower (:func:`text_tower_layout`): the same layout under the tower's path,
  anchored there so that the vision tower's own ``self_attn.q_proj`` or ``mlp.down_proj`` (CLIP, Qwen2.5-VL)
  stay as they are. The image features the projector writes into the token embeddings are stream vectors
  too: the projector's last Linear is rotated on its output side, as a writer.
"""

from __future__ import annotations

import re

from layerwise.plugin.quantization import RotationLayout

from .moe import EXPERT_NAMES

_ATTENTION = ("q_proj", "k_proj", "v_proj")


def moe_layout(expert_names: tuple[str, str, str] = EXPERT_NAMES, attention_inputs: tuple[str, ...] = _ATTENTION,
               heads: bool = True) -> RotationLayout:
    """Llama's layout with the MLP's readers widened to the router (``mlp.gate``) and every gated MLP under
    ``mlp`` (each expert, a shared expert, a dense layer's MLP); ``attention_inputs``: the attention's Linears
    reading ``input_layernorm``; ``heads``: whether it has a ``v_proj`` / ``o_proj`` pair per attention module."""
    gate, up, down = (f"re:.*mlp\\.(.*\\.)?{name}$" for name in expert_names)
    return RotationLayout(
        embeddings=("re:.*embed_tokens$",),
        norms=((tuple(f"re:.*self_attn\\.{n}$" for n in attention_inputs), "re:.*input_layernorm$"),
               (("re:.*mlp\\.gate$", gate, up), "re:.*post_attention_layernorm$"),
               (("re:^lm_head$",), "re:^model\\.norm$")),
        writers=("re:.*self_attn\\.o_proj$", down),
        online=(down,),
        heads=("re:.*self_attn\\.v_proj$", "re:.*self_attn\\.o_proj$") if heads else (),
        online_signs=(up, down),
    )


def text_tower_layout(tower: str, projector: str | None = None, cross_attention: bool = False) -> RotationLayout:
    """Llama's layout under the text tower at ``tower`` (e.g. ``model.language_model``); ``projector``: the Linear
    whose outputs replace the image tokens' embeddings (rotated as a writer); ``cross_attention``: Mllama's
    cross-attention layers, whose ``q_proj`` reads the stream and whose keys and values read the image features
    (not rotated)."""
    at = f"re:^{re.escape(tower)}\\..*"
    attention = [f"{at}self_attn\\.{n}$" for n in _ATTENTION]
    writers = [f"{at}self_attn\\.o_proj$", f"{at}mlp\\.down_proj$"]
    if cross_attention:
        attention.append(f"{at}cross_attn\\.q_proj$")
        writers.insert(1, f"{at}cross_attn\\.o_proj$")
    if projector:
        writers.append(f"re:^{re.escape(projector)}$")
    return RotationLayout(
        embeddings=(f"{at}embed_tokens$",),
        norms=((tuple(attention), f"{at}input_layernorm$"),
               ((f"{at}mlp\\.gate_proj$", f"{at}mlp\\.up_proj$"), f"{at}post_attention_layernorm$"),
               (("re:^lm_head$",), f"re:^{re.escape(tower)}\\.norm$")),
        writers=tuple(writers),
        online=(f"{at}mlp\\.down_proj$",),
        heads=(f"{at}self_attn\\.v_proj$", f"{at}self_attn\\.o_proj$"),
        online_signs=(f"{at}mlp\\.up_proj$", f"{at}mlp\\.down_proj$"),
    )
