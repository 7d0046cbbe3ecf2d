"""How far a compressed language model's next-token predictions moved from the original's: the math.

Per scored token, from the two models' logits over the same context:

- the negative log-likelihood of the true next token under each (their perplexities);
- ``KL(P_original || P_compressed)`` in nats: the information lost by predicting with the compressed
  model where the original predicted (llama.cpp's ``--kl-divergence``; rounding can make a token's sum a
  hair below zero, which is counted as zero);
- top-1 agreement: both rank the same token first;
- top-5 agreement: the share of the original's five most likely tokens that are also among the
  compressed model's five.

:class:`TokenAgreement` adds these up window by window and keeps every token's KL, so that the median,
99th percentile and maximum are exact; a model compared with itself gives KL 0 and agreement 1.0
exactly. Pure functions of tensors: running the models is :mod:`layerwise.reports.quality`'s job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: the size of the top-k sets compared
TOP_K = 5


@dataclass(frozen=True)
class TokenMetrics:
    """The comparison over every scored token."""

    perplexity_original: float
    perplexity_compressed: float
    kl_mean: float
    kl_median: float
    kl_p99: float
    kl_max: float
    top1_agreement: float
    top5_agreement: float
    tokens: int
    #: mean KL of each window's scored tokens, in window order
    kl_per_window: tuple[float, ...]
    #: mean KL at each position of a window over the windows that score it (position 0 scores nothing)
    kl_per_position: tuple[float, ...]


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Float32 log-softmax over the vocabulary (the last dimension)."""
    return torch.log_softmax(logits.float(), dim=-1)


class TokenAgreement:
    """Accumulates :func:`compare` window by window; :meth:`result` gives the :class:`TokenMetrics`."""

    def __init__(self, length: int) -> None:
        self.length = length
        self._kl: list[torch.Tensor] = []
        self._window_kl: list[float] = []
        self._position_sum = torch.zeros(length, dtype=torch.float64)
        self._position_count = torch.zeros(length, dtype=torch.float64)
        self._nll = [0.0, 0.0]
        self._top1 = 0
        self._top5 = 0.0

    def add(self, reference: torch.Tensor, candidate: torch.Tensor, targets: torch.Tensor, first: int) -> None:
        """One window: ``reference`` / ``candidate`` are the log-probabilities (``[positions, vocab]``) that
        predict ``targets`` (``[positions]``), whose first element sits at window position ``first``."""
        kl = torch.nn.functional.kl_div(candidate, reference, log_target=True, reduction="none").sum(-1)
        kl = kl.clamp_min(0.0).to(torch.float32).cpu()
        self._kl.append(kl)
        self._window_kl.append(kl.double().mean().item())
        self._position_sum[first:first + kl.numel()] += kl.double()
        self._position_count[first:first + kl.numel()] += 1
        picked = targets.unsqueeze(-1).to(reference.device)
        self._nll[0] -= reference.gather(-1, picked).double().sum().item()
        self._nll[1] -= candidate.gather(-1, picked.to(candidate.device)).double().sum().item()
        k = min(TOP_K, reference.shape[-1])
        top_reference = reference.topk(k, dim=-1).indices
        top_candidate = candidate.topk(k, dim=-1).indices.to(top_reference.device)
        self._top1 += int((top_reference[:, 0] == top_candidate[:, 0]).sum())
        shared = (top_reference.unsqueeze(-1) == top_candidate.unsqueeze(-2)).any(-1).sum()
        self._top5 += float(shared) / k

    def result(self) -> TokenMetrics:
        kl = torch.cat(self._kl).double() if self._kl else torch.zeros(0, dtype=torch.float64)
        count = kl.numel()
        if count == 0:
            raise ValueError("no token was scored")
        ordered = kl.sort().values
        scored = self._position_count > 0
        per_position = torch.where(scored, self._position_sum / self._position_count.clamp_min(1), 0.0)
        return TokenMetrics(
            perplexity_original=math.exp(self._nll[0] / count),
            perplexity_compressed=math.exp(self._nll[1] / count),
            kl_mean=kl.mean().item(), kl_median=quantile(ordered, 0.5), kl_p99=quantile(ordered, 0.99),
            kl_max=ordered[-1].item(), top1_agreement=self._top1 / count, top5_agreement=self._top5 / count,
            tokens=count, kl_per_window=tuple(self._window_kl), kl_per_position=tuple(per_position.tolist()))


def quantile(ordered: torch.Tensor, q: float) -> float:
    """The ``q`` quantile of sorted values, linearly interpolated (numpy's default)."""
    position = q * (ordered.numel() - 1)
    low = math.floor(position)
    high = min(low + 1, ordered.numel() - 1)
    return (ordered[low] + (ordered[high] - ordered[low]) * (position - low)).item()
