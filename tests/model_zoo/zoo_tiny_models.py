"""The zoo's tiny models by architecture: each builder is one of the zoo's own ``ModelPatch.tiny_models``.

``ARCHS[name]`` gives the builder (``tiny_<name>`` of the patch), the zoo module holding the patch,
the expected patch name and the modalities its ``sample_inputs`` supports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from layerwise.host.model_patch import ModelPatch


@dataclass(frozen=True)
class Arch:
    name: str
    module: str           # model_zoo module name
    patch: str            # expected patch name
    modalities: tuple[str, ...]

    @property
    def build(self) -> Callable[[], Any]:
        """The zoo's own builder of this architecture's tiny model."""
        module = importlib.import_module(f"layerwise.model_zoo.{self.module}")
        patches = [value for value in vars(module).values() if isinstance(value, ModelPatch)]
        return next(b for p in patches if p.name == self.patch for b in p.tiny_models
                    if b.__name__ == f"tiny_{self.name}")


def _archs(*rows: tuple[str, str, str, tuple[str, ...]]) -> dict[str, Arch]:
    return {row[0]: Arch(*row) for row in rows}


TEXT_IMAGE = ("text", "image")
ARCHS: dict[str, Arch] = _archs(
    ("qwen2_vl", "qwen2_vl", "qwen2_vl", TEXT_IMAGE),
    ("qwen2_5_vl", "qwen2_vl", "qwen2_5_vl", TEXT_IMAGE),
    ("mllama", "mllama", "mllama", TEXT_IMAGE),
    ("llava", "llava", "llava", TEXT_IMAGE),
    ("pixtral", "llava", "llava", TEXT_IMAGE),
    ("mistral3", "llava", "mistral3", TEXT_IMAGE),
    ("idefics3", "idefics3", "idefics3", TEXT_IMAGE),
    ("gemma3", "gemma3", "gemma3", TEXT_IMAGE),
    ("whisper", "whisper", "whisper", ("audio",)),
    ("qwen3_moe", "qwen3_moe", "qwen3_moe", ("text",)),
    ("mixtral", "mixtral", "mixtral", ("text",)),
    ("deepseek_v3", "deepseek_v3", "deepseek_v3", ("text",)),
)
