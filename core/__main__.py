"""``python -m layerwise ...``: the ``layerwise`` command, also what ``torchrun -m layerwise`` starts."""

import sys

from layerwise.cli import main

if __name__ == "__main__":
    sys.exit(main())
