"""Mixtral: one decoder layer at a time, experts as per-expert Linear layers, every expert
calibrated on every token (see :mod:`layerwise.model_zoo.moe`)."""

from __future__ import annotations

from layerwise import hookimpl

from .moe import text_moe_patch

MIXTRAL = text_moe_patch("mixtral", "Mixtral", "mixtral", "Mixtral")


@hookimpl
def layerwise_register_model_patches(register):
    register(MIXTRAL)
