"""SmoothQuant's smoothing scales (Xiao et al., 2023), as a pure function.

Per input channel ``j`` of a mapping's balance layers:
``s_j = max|X_j| ** alpha / max|W_:j| ** (1 - alpha)``, where ``max|X_j|`` is taken over every
calibration token and ``max|W_:j|`` over every row of every balance layer. Dividing the inputs by
``s`` and multiplying the weight columns by ``s`` moves ``alpha`` of the activations' outlier
range into the weights (:func:`~layerwise.algorithms.quantization.smoothing.apply_smoothing` folds it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: the smallest weight magnitude and the smallest scale used: a weight column of zeros would make
#: ``s`` infinite (``alpha < 1``), a channel no token ever used (``max|X| = 0``) would make it zero
#: (``alpha > 0``); both channels carry nothing, so any finite positive scale keeps the function
MIN_SCALE = 1e-5


def smoothquant_scales(activation_max: torch.Tensor, weights: Sequence[torch.Tensor],
                       strength: float) -> torch.Tensor:
    """The float32 scales for inputs whose per-channel ``max|x|`` is ``activation_max``.

    ``weights`` are the balance layers' weights in the Linear layout ``(out, in)``; ``strength`` is
    ``alpha`` in ``[0, 1]`` (0: flatten the weights only, 1: the activations only).
    """
    weight_max = torch.stack([w.detach().abs().to(torch.float32).amax(dim=0) for w in weights]).amax(dim=0)
    x_max = activation_max.detach().to(device=weight_max.device, dtype=torch.float32)
    if x_max.shape != weight_max.shape:
        raise ValueError(f"{x_max.numel()} activation maxima for balance layers reading {weight_max.numel()} channels")
    scales = x_max.pow(strength) / weight_max.clamp(min=MIN_SCALE).pow(1 - strength)
    return scales.clamp(min=MIN_SCALE)
