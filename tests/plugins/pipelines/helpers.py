"""A deterministic test modifier and calibration helpers shared by the pipeline tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layerwise.host.lifecycle import Lifecycle
from layerwise.host.modifier import Modifier
from layerwise.host.state import CompressionState


@dataclass
class RoundingModifier(Modifier):
    """Records every input each targeted Linear sees and rounds a piece's weights when it ends."""

    grid: float = 0.125

    def __post_init__(self) -> None:
        super().__post_init__()
        self.seen: dict[str, list[torch.Tensor]] = {}
        self.events: list[tuple] = []
        self.rounded: list[str] = []

    def linears(self, state):
        return {n: m for n, m in state.model.named_modules()
                if isinstance(m, torch.nn.Linear) and "layers." in n}

    def on_calibration_start(self, state):
        self.events.append(("calibration_start",))
        for name, module in self.linears(state).items():
            self.register_hook(module, self._record(name), "forward_pre")

    def _record(self, name):
        def hook(module, args):
            self.seen.setdefault(name, []).append(args[0].detach().clone())
        return hook

    def on_sequential_epoch_end(self, state, modules):
        self.events.append(("sequential_epoch_end", tuple(modules)))
        for name, module in self.linears(state).items():
            inside = any(name == m or name.startswith(m + ".") for m in modules)
            if inside and name not in self.rounded:
                with torch.no_grad():
                    module.weight.copy_(torch.round(module.weight / self.grid) * self.grid)
                self.rounded.append(name)

    def on_calibration_end(self, state):
        self.events.append(("calibration_end",))


def make_lifecycle(model, *modifiers, patch=None, targets=("LlamaDecoderLayer",)):
    state = CompressionState(model=model, modifiers=list(modifiers), patch=patch,
                             sequential_targets=list(targets))
    lifecycle = Lifecycle(state)
    lifecycle.initialize()
    return lifecycle


def make_batches(vocab=128, lengths=(7, 9, 5), seed=1):
    g = torch.Generator().manual_seed(seed)
    batches = []
    for n in lengths:
        ids = torch.randint(0, vocab, (1, n), generator=g)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return batches
