"""Sample-input helpers shared by the zoo's ``sample_inputs(config, modality)`` builders.

Everything here is seeded and offline: random token ids that avoid the model's special
tokens, placeholder runs for images, and random pixel / audio tensors of the right shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

TEXT, IMAGE, AUDIO = "text", "image", "audio"


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_modality(family: str, modality: str, supported: Sequence[str]) -> None:
    if modality not in supported:
        raise ValueError(f"{family} models take {', '.join(supported)}; not {modality!r}")


def special_ids(*configs: Any, extra: Iterable[int | None] = ()) -> set[int]:
    """Every ``*_token_id`` / ``*_token_index`` integer found on ``configs`` (and ``extra``)."""
    found: set[int] = set()
    for config in configs:
        if config is None:
            continue
        for key, value in vars(config).items():
            if ("token_id" in key or "token_index" in key) and isinstance(value, int):
                found.add(value)
    found.update(v for v in extra if isinstance(v, int))
    return found


def text_ids(vocab_size: int, batch: int = 2, seq_len: int = 16, seed: int = 0,
             avoid: Iterable[int] = ()) -> torch.Tensor:
    """Random ids in ``[0, vocab_size)`` that are none of ``avoid`` (special / placeholder tokens)."""
    avoid = sorted({a for a in avoid if 0 <= a < vocab_size})
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    if avoid:
        allowed[torch.tensor(avoid)] = False
    pool = allowed.nonzero().flatten()
    picks = torch.randint(0, len(pool), (batch, seq_len), generator=generator(seed))
    return pool[picks]


def text_inputs(vocab_size: int, batch: int = 2, seq_len: int = 16, seed: int = 0,
                avoid: Iterable[int] = ()) -> dict[str, torch.Tensor]:
    ids = text_ids(vocab_size, batch, seq_len, seed, avoid)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def place_run(ids: torch.Tensor, start: int, tokens: Sequence[int]) -> torch.Tensor:
    """Write ``tokens`` into every row of ``ids`` from position ``start`` on (in place, returned)."""
    ids[:, start:start + len(tokens)] = torch.tensor(list(tokens), dtype=ids.dtype)
    return ids


def image_prompt(vocab_size: int, image_run: Sequence[int], batch: int = 2, text_before: int = 3,
                 text_after: int = 6, seed: int = 0, avoid: Iterable[int] = ()) -> torch.Tensor:
    """``text_before`` random tokens, the image's token run, ``text_after`` random tokens, per row."""
    seq_len = text_before + len(image_run) + text_after
    ids = text_ids(vocab_size, batch, seq_len, seed, avoid)
    return place_run(ids, text_before, image_run)


def pixels(*shape: int, seed: int = 1) -> torch.Tensor:
    """Normalised-looking random pixels (fp32)."""
    return torch.randn(*shape, generator=generator(seed))


def pair(value: Any) -> tuple[int, int]:
    """``14`` or ``[14, 14]`` -> ``(14, 14)``."""
    if isinstance(value, (list, tuple)):
        return int(value[0]), int(value[-1])
    return int(value), int(value)
