"""Which transformers releases layerwise was tested on, and saying so when it runs on another.

layerwise reads transformers' internals (model code traced line by line, the attention and
mask registries, ``_no_split_modules``), and transformers ships a minor release every week or
two. The contract:

- :data:`TESTED_TRANSFORMERS` is the range the test suite passed on: its lowest release is
  pyproject's floor and tox's ``transformers-lowest`` env; its newest is pinned in
  ``constraints.txt``, which README's commands and CI install with. ``tests/test_release_train.py``
  keeps the four in step.
- Outside that range, :func:`warn_if_untested` warns once per process at the start of
  ``compress()`` / ``trace()`` and points at ``layerwise trace --verify``; a model patch whose
  ``verified_transformers`` do not span the running release is named too.
- :func:`environment` is what ``layerwise env`` prints for bug reports.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

from packaging.version import InvalidVersion, Version

from layerwise.common.user_warnings import warn_user

if TYPE_CHECKING:
    from layerwise.host.model_patch import ModelPatch


@dataclass(frozen=True)
class TestedRange:
    """The lowest and the newest release of a library the test suite passed on."""

    lowest: str
    newest: str

    @property
    def releases(self) -> tuple[str, str]:
        """The two ends, as a model patch's ``verified_transformers`` lists them."""
        return self.lowest, self.newest

    def since(self, release: str) -> tuple[str, str]:
        """``(release, newest)``: for a model patch whose checks pass only from a later release on."""
        return release, self.newest

    def covers(self, version: str) -> bool:
        """Whether ``version`` lies in the range (local labels such as ``+cpu`` ignored)."""
        return span_covers(self.releases, version)

    def __str__(self) -> str:
        return f"{self.lowest} to {self.newest}"


#: the transformers releases the whole test suite passed on (see the module docstring)
TESTED_TRANSFORMERS = TestedRange(lowest="5.20.2", newest="5.24.0")

#: distributions whose versions change what layerwise does, in the order ``layerwise env`` lists them
REPORTED_DISTRIBUTIONS = ("layerwise", "torch", "transformers", "compressed-tensors", "safetensors",
                          "tokenizers", "huggingface-hub", "pluggy")


class UntestedVersionWarning(UserWarning):
    """A library release layerwise (or a model patch) was not tested on is running."""


def _public(version: str) -> Version | None:
    try:
        return Version(Version(version).public)
    except InvalidVersion:
        return None


def span_covers(releases: tuple[str, ...], version: str) -> bool:
    """Whether ``version`` lies between the lowest and the newest of ``releases`` (inclusive)."""
    known = [v for v in map(_public, releases) if v is not None]
    running = _public(version)
    return bool(known) and running is not None and min(known) <= running <= max(known)


def describe_span(releases: tuple[str, ...]) -> str:
    """``5.5.0 to 5.24.0`` for a span, the one release for one, ``not stated`` for none."""
    known = sorted({v for v in releases if _public(v) is not None}, key=_public)
    if not known:
        return "not stated"
    return known[0] if len(known) == 1 else f"{known[0]} to {known[-1]}"


def patch_verified_on(patch: ModelPatch, version: str) -> bool:
    """False only when ``patch`` states the releases it was verified on and ``version`` is outside them."""
    return not patch.verified_transformers or span_covers(patch.verified_transformers, version)


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or ``None`` when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def environment() -> dict[str, object]:
    """What a bug report needs: versions, the tested range, and the accelerator torch sees."""
    versions = {name: installed_version(name) for name in REPORTED_DISTRIBUTIONS}
    running = versions["transformers"]
    return {
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "versions": versions,
        "transformers_tested": {"lowest": TESTED_TRANSFORMERS.lowest, "newest": TESTED_TRANSFORMERS.newest,
                                "running_is_tested": running is not None and TESTED_TRANSFORMERS.covers(running)},
        "accelerator": _accelerator(),
    }


def _accelerator() -> str:
    import torch

    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        return f"CUDA {torch.version.cuda}: {torch.cuda.device_count()} x {', '.join(names)}"
    return "none (CPU only)"


#: what has been warned about in this process: "transformers" and ``patch:<name>`` entries
_warned: set[str] = set()


def untested_message(version: str) -> str:
    return (f"transformers {version} is outside the range layerwise was tested on "
            f"({TESTED_TRANSFORMERS}). layerwise traces transformers' model code, so a release it has "
            f"not seen can trace differently: check your model with "
            f"`layerwise trace --model <folder> --verify`, or install a tested release, "
            f"e.g. pip install 'transformers>={TESTED_TRANSFORMERS.lowest},<={TESTED_TRANSFORMERS.newest}'")


def warn_if_untested(patch: ModelPatch | None = None) -> None:
    """Warn, once per process, when the running transformers is outside the tested range.

    With ``patch``: also warn (once per patch) when the running release is inside layerwise's
    range but outside the span the patch says it was verified on. A patch that states no
    versions is not warned about; ``layerwise plugins`` shows it as "not stated".
    """
    version = transformers_version()
    if not TESTED_TRANSFORMERS.covers(version):
        if "transformers" not in _warned:
            _warned.add("transformers")
            warn_user(untested_message(version), UntestedVersionWarning)
        return
    if patch is None or patch_verified_on(patch, version):
        return
    key = f"patch:{patch.name}"
    if key not in _warned:
        _warned.add(key)
        warn_user(f"model patch {patch.name!r} was verified on transformers "
                  f"{describe_span(patch.verified_transformers)}, not on the running {version}: check the "
                  f"model with `layerwise trace --model <folder> --verify`", UntestedVersionWarning)
