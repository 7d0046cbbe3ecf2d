"""A tiny config for an architecture: its config class's defaults with the size fields shrunk.

The result is the keyword dict the generated package passes to the config class, so it
holds only what differs from the defaults and matters (sizes, counts, token ids the small
vocabulary must contain): short enough to read and edit. transformers spells one size in
several ways (``hidden_size``, GPT-2's ``n_embd``, T5's ``d_model``), so :data:`SIZES`
lists each spelling and a field is shrunk only where the config has it.

Sub-configs (``text_config``, an encoder and a decoder) are shrunk the same way when they
are text; a vision or audio tower is refused: its sizes, image or audio geometry and
placeholder tokens must agree with each other, which a rule of thumb cannot promise.
"""

from __future__ import annotations

from typing import Any

from layerwise.common.quiet import quiet_transformers

from .errors import ScaffoldError

#: the tiny size of each field, under every name transformers' configs give it
SIZES: dict[str, int] = {
    # width
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "word_embed_proj_dim": 64,
    # feed-forward width
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "d_ff": 128,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    # depth
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "num_decoder_layers": 2,
    "encoder_layers": 2, "decoder_layers": 2,
    # attention heads
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "d_kv": 16, "rotary_dim": 16,
    # vocabulary and context
    "vocab_size": 256, "max_position_embeddings": 256, "n_positions": 256, "max_target_positions": 256,
    # audio (Whisper-style: the features span 2 * max_source_positions frames)
    "num_mel_bins": 16, "max_source_positions": 32,
    # mixture of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    # multi-head latent attention (DeepSeek)
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
}
#: counts a default may already keep below the tiny size (one expert per token stays one)
AT_MOST = frozenset({"num_experts_per_tok", "n_shared_experts", "n_group", "topk_group", "first_k_dense_replace",
                     "num_key_value_heads"})
#: fields whose default ``None`` means "derive it" (shrunk anyway); other ``None`` defaults switch
#: a feature off (``q_lora_rank``) and stay off
DERIVED_WHEN_NONE = frozenset({"n_inner", "num_decoder_layers", "head_dim", "num_key_value_heads"})
#: fixed values: untied output embeddings, so the head is a Linear of its own to leave alone
FIXED: dict[str, Any] = {"tie_word_embeddings": False}
#: words in a sub-config's name, or fields on it, that mark a non-text tower
_MEDIA_WORDS = ("vision", "visual", "image", "audio", "speech", "video")
_MEDIA_FIELDS = ("image_size", "num_mel_bins", "patch_size", "num_channels")


def tiny_config_fields(config_class: type, architecture: str = "") -> dict[str, Any]:
    """The keyword arguments that make ``config_class`` tiny (sub-configs as nested dicts)."""
    with quiet_transformers():
        default = config_class()
    fields = _shrunk(default)
    for sub_name in _sub_config_names(config_class):
        sub = getattr(default, sub_name, None)
        if sub is None:
            continue
        if _is_media(sub_name, sub):
            raise ScaffoldError(
                f"{architecture or config_class.__name__} has a {sub_name} ({type(sub).__name__}): new-patch "
                f"generates text and audio models only; write the tiny model and its image or audio "
                f"sample_inputs by hand (the zoo's llava.py and qwen2_vl.py show how)")
        sub_fields = _shrunk(sub)
        if sub_fields and _built_by_auto_config(config_class, sub_name):
            sub_fields = {"model_type": sub.model_type, **sub_fields}
        if sub_fields:
            fields[sub_name] = sub_fields
    for key, value in _token_id_fixes(build_config(config_class, fields)).items():
        fields[key] = {**fields.get(key, {}), **value} if isinstance(value, dict) else value
    _check_applied(config_class, fields, architecture)
    return fields


def build_config(config_class: type, fields: dict[str, Any]) -> Any:
    """``config_class(**fields)``: what the generated ``tiny_<slug>()`` does."""
    try:
        with quiet_transformers():
            return config_class(**fields)
    except Exception as error:  # a validator refusing the shrunk sizes: say which and why
        raise ScaffoldError(f"{config_class.__name__} refuses the tiny sizes {_short(fields)}: "
                            f"{type(error).__name__}: {error}; write the tiny config by hand") from error


def default_values(config_class: type, fields: dict[str, Any]) -> dict[str, Any]:
    """The class defaults of the keys in ``fields`` (nested alike), for showing beside the tiny values."""
    def read(config: Any, wanted: dict[str, Any]) -> dict[str, Any]:
        return {key: read(getattr(config, key), value) if isinstance(value, dict) else getattr(config, key, None)
                for key, value in wanted.items() if key != "model_type"}

    with quiet_transformers():
        return read(config_class(), fields)


def _sub_configs(config_class: type) -> dict[str, type]:
    return dict(getattr(config_class, "sub_configs", None) or {})


def _sub_config_names(config_class: type) -> list[str]:
    return list(_sub_configs(config_class))


def _is_media(name: str, config: Any) -> bool:
    return any(word in name.lower() for word in _MEDIA_WORDS) or any(hasattr(config, f) for f in _MEDIA_FIELDS)


def _built_by_auto_config(config_class: type, sub_name: str) -> bool:
    """Whether the parent builds this sub-config through AutoConfig: its dict must then name its model_type."""
    return getattr(_sub_configs(config_class).get(sub_name), "__name__", "") == "AutoConfig"


def _shrunk(config: Any) -> dict[str, Any]:
    """The size and fixed fields of one (sub-)config that differ from its defaults."""
    values = config.to_dict()
    out: dict[str, Any] = {}
    for key, size in SIZES.items():
        if key not in values:
            continue
        current = values[key]
        if current is None:
            if key in DERIVED_WHEN_NONE:
                out[key] = size
            continue
        if not isinstance(current, int) or isinstance(current, bool):
            continue
        wanted = min(current, size) if key in AT_MOST else size
        if wanted != current:
            out[key] = wanted
    out.update({key: value for key, value in FIXED.items() if key in values and values[key] != value})
    return out


def _token_id_fixes(config: Any) -> dict[str, Any]:
    """``*_token_id`` fields outside the small vocabulary, moved to its top ids (equal ids stay equal)."""
    fixes = _ids_inside(config, _vocab_size(config, config))
    for sub_name in _sub_config_names(type(config)):
        sub = getattr(config, sub_name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            sub_fixes = _ids_inside(sub, _vocab_size(sub, config))
            if sub_fixes:
                fixes[sub_name] = sub_fixes
    return fixes


def _vocab_size(config: Any, parent: Any) -> int | None:
    vocab = getattr(config, "vocab_size", None)
    if vocab is None and hasattr(parent, "get_text_config"):
        vocab = getattr(parent.get_text_config(), "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def _ids_inside(config: Any, vocab: int | None) -> dict[str, Any]:
    if vocab is None:
        return {}
    values = {k: v for k, v in config.to_dict().items() if k.endswith("_token_id")}
    outside = sorted({i for v in values.values() for i in (v if isinstance(v, list) else [v])
                      if isinstance(i, int) and i >= vocab})
    moved = {old: vocab - 1 - n for n, old in enumerate(outside)}

    def inside(value: Any) -> Any:
        return [moved.get(i, i) for i in value] if isinstance(value, list) else moved.get(value, value)

    return {k: inside(v) for k, v in values.items() if inside(v) != v}


def _check_applied(config_class: type, fields: dict[str, Any], architecture: str) -> None:
    """Build the config from ``fields`` and make sure every size took (a parent may drop a nested one).

    A :data:`FIXED` preference the class overrides (T5 always ties its embeddings) is dropped
    from ``fields`` instead: the model works either way.
    """
    config = build_config(config_class, fields)
    for key, value in list(fields.items()):
        target = getattr(config, key, None)
        pairs = list(value.items()) if isinstance(value, dict) else [(None, value)]
        for sub_key, sub_value in pairs:
            got = target if sub_key is None else getattr(target, sub_key, None)
            if sub_key == "model_type" or got == sub_value:
                continue
            if (sub_key or key) in FIXED:
                del (fields if sub_key is None else fields[key])[sub_key or key]
                continue
            where = key if sub_key is None else f"{key}.{sub_key}"
            raise ScaffoldError(f"{architecture or config_class.__name__}: {config_class.__name__} does not keep "
                                f"the tiny value {where}={sub_value!r} (it holds {got!r}); write the tiny config "
                                f"by hand")


def _short(fields: dict[str, Any]) -> str:
    shown = ", ".join(f"{k}={v!r}" for k, v in list(fields.items())[:6])
    return "{" + shown + (", ..." if len(fields) > 6 else "") + "}"
