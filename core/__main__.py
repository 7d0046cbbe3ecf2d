"""``python -m layerwise ...``: the ``layerwise`` command, also what ``torchrun -m layerwise`` starts."""

from layerwise.cli import console

if __name__ == "__main__":
    console()
