"""Maps the repository's three folders into the one `layerwise` namespace.

pyproject.toml holds the metadata; this file only lists the packages, because
setuptools cannot discover sub-packages of a folder installed under another name.
Nothing named `core` or `plugins` is installed at the top of site-packages.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {"layerwise": "core", "layerwise.plugins": "plugins", "layerwise.model_zoo": "model_zoo"}


def _packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        for init in sorted(Path(folder).rglob("__init__.py")):
            relative = init.parent.relative_to(folder).parts
            found.append(".".join((name, *relative)))
    return found


setup(packages=_packages(), package_dir=ROOTS)
