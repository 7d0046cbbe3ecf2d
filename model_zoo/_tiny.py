"""Shared sizes for the zoo's tiny models: seeded, random weights, built from config classes offline.

Every zoo patch lists builders of such models in ``ModelPatch.tiny_models``; the plugin kit
(``layerwise plugins --check``, :func:`layerwise.testing.check_model_patch`) and the tests run on them.
"""

from __future__ import annotations

from typing import Any

import torch

#: a 2-layer decoder small enough to calibrate in well under a second
TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False)
#: a 2-layer vision encoder to go with it
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def seeded(model_class: str, config: Any, seed: int = 0) -> torch.nn.Module:
    """``transformers.<model_class>(config)`` with weights drawn from ``seed``, in eval mode."""
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, model_class)(config).eval()
