"""Run a piece on several short calibration samples at once when it treats every token on its own.

Most pieces of a layer cut never mix tokens: an attention output projection with its residual
add and norm, an MLP, a down projection. Run one short sample at a time (an encoder's sentence,
a few dozen tokens), such a piece multiplies matrices a few dozen rows tall and the per-call
overhead costs more than the arithmetic. Joined along the token axis, the samples go through
in one call per :data:`TOKEN_BUDGET` tokens, and the outputs are split back per sample. Long
samples are left alone: at 512 tokens the products already run near the machine's peak and the
copies of joining cost more than they save.

Whether a piece is token-wise is not guessed from its code: before calibration (when the
pipeline checks its cut), the first two samples are replayed through the pieces one by one and
each piece is run once more on the two joined; a piece is joined only when that gives the same
outputs (up to the rounding of differently shaped matrix products). A piece whose inputs or
outputs are not all ``(1, tokens, ...)`` tensors (an attention mask, a pooled vector) is never
joined. Observed forwards are not joined either: hooks see one sample per call, as always.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from layerwise.plugin.pipelines import move_to, output_difference

#: tokens per joined call
TOKEN_BUDGET = 1024
#: samples at least this long run alone
JOIN_BELOW = 256
#: the largest relative difference between joined and one-by-one outputs that still counts as the same
SAME_OUTPUTS = 1e-5
#: what a non-tensor input may be to be shared by joined samples (it must be equal in all of them)
_CONSTANTS = (type(None), bool, int, float, str)


def token_count(values: Mapping[str, Any]) -> int | None:
    """The token count ``T`` when every tensor in ``values`` is ``(1, T, ...)``; ``None`` when not joinable."""
    count = None
    for value in values.values():
        if isinstance(value, torch.Tensor):
            if value.dim() < 2 or value.shape[0] != 1 or (count is not None and value.shape[1] != count):
                return None
            count = value.shape[1]
        elif not isinstance(value, _CONSTANTS):
            return None
    return count


def _same_constants(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return all(isinstance(a[k], torch.Tensor) or a[k] == b[k] for k in a)


def join(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One input mapping for several samples: tensors concatenated along the token axis."""
    return {name: torch.cat([s[name] for s in samples], dim=1) if isinstance(value, torch.Tensor) else value
            for name, value in samples[0].items()}


def split(outputs: Mapping[str, Any], counts: list[int]) -> list[dict[str, Any]] | None:
    """Joined outputs back per sample (copies: each sample's values own their memory, which the cache
    counts); ``None`` when an output is not a ``(1, sum(counts), ...)`` tensor."""
    total = sum(counts)
    parts: dict[str, tuple[torch.Tensor, ...]] = {}
    for name, value in outputs.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[0] != 1 or value.shape[1] != total:
            return None
        parts[name] = value.split(counts, dim=1)
    return [{name: chunks[k].clone() for name, chunks in parts.items()} for k in range(len(counts))]


def run_joined(sub: Any, samples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]] | None:
    """Each sample's outputs from one call of ``sub`` on the samples joined; ``None`` when the outputs are
    not all per token."""
    counts = [token_count(s) for s in samples]
    return split(sub.run(join(samples)), counts)  # type: ignore[arg-type]


@torch.no_grad()
def token_wise_pieces(subgraphs: Sequence[Any], first: Mapping[str, Any], second: Mapping[str, Any],
                      device: torch.device | None) -> set[int]:
    """Indices of the subgraphs (one trace's, in order) that give the same outputs for two samples joined.

    ``first`` and ``second`` are two batches of that trace, both shorter than :data:`JOIN_BELOW`
    tokens (else nothing is checked: long samples are never joined). The last subgraph feeds
    nothing in a layer cut and is not checked.
    """
    values = [move_to(dict(first), device), move_to(dict(second), device)]
    if any((token_count({k: v for k, v in b.items() if isinstance(v, torch.Tensor)}) or JOIN_BELOW) >= JOIN_BELOW
           for b in values):
        return set()
    found = set()
    for sub in subgraphs[:-1]:
        inputs = [{name: v[name] for name in sub.input_names} for v in values]
        joined = None
        if None not in map(token_count, inputs) and _same_constants(*inputs):
            joined = run_joined(sub, inputs)       # before the one-by-one runs: a piece may write into
        alone = [sub.run(one) for one in inputs]   # its inputs, and joining copied them
        if joined is not None and all(set(j) == set(a) and output_difference(a, j, relative=True) <= SAME_OUTPUTS
                                      for j, a in zip(joined, alone)):
            found.add(sub.index)
        for v, out in zip(values, alone):
            v.update(out)
            for name in sub.consumed_names:
                v.pop(name, None)
    return found


class TokenBatcher:
    """Groups a token-wise piece's short samples to run together, and runs a group."""

    def __init__(self, token_wise: set[int] | None = None, budget: int = TOKEN_BUDGET) -> None:
        self.token_wise = token_wise or set()
        self.budget = budget

    def groups(self, batches: list[int], subgraph_of: Callable[[int], Any],
               fetch: Callable[[int], Mapping[str, Any]]) -> Iterator[tuple[list[int], list[Mapping[str, Any]]]]:
        """``batches`` in order, with their input values, in groups to run together: one token-wise
        subgraph, samples shorter than :data:`JOIN_BELOW`, equal constants, at most ``budget`` tokens."""
        group: list[int] = []
        values: list[Mapping[str, Any]] = []
        tokens = 0
        for batch in batches:
            sub, mine = subgraph_of(batch), fetch(batch)
            count = token_count(mine) if sub.index in self.token_wise else None
            if count is not None and count >= JOIN_BELOW:
                count = None
            joinable = count is not None and (not group or (subgraph_of(group[0]) is sub
                                                          and _same_constants(values[0], mine)))
            if group and (not joinable or tokens + (count or 0) > self.budget):
                yield group, values
                group, values, tokens = [], [], 0
            if count is None:
                yield [batch], [mine]
                continue
            group.append(batch)
            values.append(mine)
            tokens += count
        if group:
            yield group, values

    @torch.no_grad()
    def run(self, sub: Any, samples: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Each sample's outputs: one call for a group of several, the plain call for one."""
        if len(samples) == 1:
            return [sub.run(samples[0])]
        outputs = run_joined(sub, samples)
        if outputs is None:  # checked on two samples; this group's outputs came out otherwise
            raise RuntimeError(f"subgraph {sub.index} joined {len(samples)} samples but its outputs are "
                               f"not per token")
        return outputs
