"""Loads plugins from the ``layerwise`` entry-point group and builds the registries.

Rules (each has a test in tests/core/test_plugin_manager.py):

* entry points load one by one; one whose import or registration raises is
  reported with a warning, marked broken, and skipped; the host and all other
  plugins keep working. ``LAYERWISE_STRICT_PLUGINS=1`` turns that into an error;
* ``LAYERWISE_DISABLE_PLUGINS=a,b`` blocks plugins by entry-point name (or by
  distribution name) before they are imported;
* no plugin is imported from anywhere but installed entry points (or an object
  handed to :meth:`PluginHost.register` explicitly, as tests do);
* two plugins registering the same name of the same kind raise
  :class:`~layerwise.errors.DuplicateNameError` naming both.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .errors import DuplicateNameError, PluginError
from .registry import Registry

from importlib.metadata import entry_points  # EntryPoint.dist exists since 3.10

GROUP = "layerwise"
KINDS = ("pipelines", "modifiers", "model_patches", "observers", "datasets", "savers")
STRICT_ENV = "LAYERWISE_STRICT_PLUGINS"
DISABLE_ENV = "LAYERWISE_DISABLE_PLUGINS"


@dataclass
class PluginInfo:
    """What `layerwise plugins` shows about one plugin."""

    name: str
    distribution: str
    version: str
    registered: dict[str, list[str]] = field(default_factory=dict)
    broken: str | None = None
    disabled: bool = False

    @property
    def owner(self) -> str:
        return f"{self.distribution} {self.version} (plugin {self.name!r})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "registered": self.registered,
            "broken": self.broken,
            "disabled": self.disabled,
        }


def _strict() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _disabled_names() -> set[str]:
    return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}


class PluginHost:
    """The pluggy manager plus one :class:`Registry` per kind of plugin object."""

    def __init__(self, load_entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self._registries: dict[str, Registry] | None = None
        if load_entry_points:
            self.load_entry_points()

    # -- loading ---------------------------------------------------------------
    def load_entry_points(self) -> None:
        disabled = _disabled_names()
        seen: set[tuple[str, str]] = set()
        for ep in entry_points(group=GROUP):
            dist = ep.dist.metadata["Name"] if ep.dist is not None else "<unknown>"
            version = ep.dist.version if ep.dist is not None else "?"
            if (dist, ep.name) in seen:  # the same distribution found twice on sys.path
                continue
            seen.add((dist, ep.name))
            info = PluginInfo(ep.name, dist, version)
            self.plugins[ep.name] = info
            if ep.name in disabled or dist in disabled:
                info.disabled = True
                continue
            try:
                module = ep.load()
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the host
                self._mark_broken(info, f"import failed: {type(exc).__name__}: {exc}", exc)
                continue
            self._register_loaded(module, info)
        self._registries = None

    def register(self, plugin: Any, name: str | None = None, distribution: str = "<local>",
                 version: str = "") -> PluginInfo:
        """Register a plugin object directly (tests, notebooks); same rules as entry points."""
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        info = PluginInfo(name, distribution, version)
        self.plugins[name] = info
        self._register_loaded(plugin, info)
        self._registries = None
        return info

    def unregister(self, name: str) -> None:
        if self.pm.has_plugin(name):
            self.pm.unregister(name=name)
        self.plugins.pop(name, None)
        self._registries = None

    def _register_loaded(self, plugin: Any, info: PluginInfo) -> None:
        try:
            self.pm.register(plugin, name=info.name)
        except Exception as exc:  # noqa: BLE001 - e.g. a hookimpl with a wrong signature
            self._mark_broken(info, f"registration failed: {type(exc).__name__}: {exc}", exc)

    def _mark_broken(self, info: PluginInfo, reason: str, exc: BaseException) -> None:
        info.broken = reason
        if self.pm.has_plugin(info.name):
            self.pm.unregister(name=info.name)
        if _strict():
            raise PluginError(f"plugin {info.owner} is broken: {reason}") from exc
        warnings.warn(
            f"layerwise plugin {info.owner} is broken and was skipped: {reason} "
            f"(set {STRICT_ENV}=1 to make this an error, or {DISABLE_ENV}={info.name} to silence it)",
            RuntimeWarning,
            stacklevel=3,
        )

    # -- registries ------------------------------------------------------------
    @property
    def registries(self) -> dict[str, Registry]:
        if self._registries is None:
            self._registries = self._build_registries()
        return self._registries

    def _build_registries(self) -> dict[str, Registry]:
        registries = {kind: Registry(kind.rstrip("s").replace("_", " ")) for kind in KINDS}
        for info in list(self.plugins.values()):
            plugin = self.pm.get_plugin(info.name)
            if plugin is None or info.broken:
                continue
            info.registered = {}
            for kind in KINDS:
                impl = getattr(plugin, f"layerwise_register_{kind}", None)
                if impl is None:
                    continue
                try:
                    impl(register=self._register_callback(registries[kind], kind, info))
                except DuplicateNameError:  # never one plugin's fault alone
                    raise
                except Exception as exc:  # noqa: BLE001
                    for registry in registries.values():
                        registry.remove_owner(info.owner)
                    info.registered = {}
                    self._mark_broken(info, f"layerwise_register_{kind} raised {type(exc).__name__}: {exc}", exc)
                    break
        return registries

    @staticmethod
    def _register_callback(registry: Registry, kind: str, info: PluginInfo):
        def register(*args: Any) -> None:
            if kind == "model_patches":
                (patch,) = args
                name, obj = patch.name, patch
            else:
                name, obj = args
            registry.add(name, obj, info.owner)
            info.registered.setdefault(kind, []).append(name)

        return register

    def select_pipeline(self, model: Any, modifiers: list[Any]) -> str | None:
        """Ask plugins whether one of them wants to choose the pipeline."""
        return self.pm.hook.layerwise_select_pipeline(model=model, modifiers=modifiers)

    def broken(self) -> list[PluginInfo]:
        return [p for p in self.plugins.values() if p.broken]


_host: PluginHost | None = None
_lock = threading.Lock()


def get_host() -> PluginHost:
    """The process-wide plugin host, loaded on first use."""
    global _host
    with _lock:
        if _host is None:
            _host = PluginHost()
        return _host


def reset_host() -> None:
    """Forget the loaded plugins; the next :func:`get_host` reloads entry points."""
    global _host
    with _lock:
        _host = None


def registry(kind: str) -> Registry:
    """The registry of one kind (``"modifiers"``, ``"pipelines"``, ...)."""
    return get_host().registries[kind]
