"""Loads plugins from the ``layerwise`` entry-point group and builds the registries.

Rules (each has a test in tests/host/test_plugin_manager.py):

* entry points load one by one; one whose import or registration raises is
  reported with a warning, marked broken (``PluginInfo.broken`` says why) and
  skipped; the host and all other plugins keep working.
  ``LAYERWISE_STRICT_PLUGINS=1`` turns that into a :class:`~layerwise.errors.PluginError`
  naming the plugin, its distribution and the cause. Registration hooks run when
  :func:`get_host` loads the host (for a :class:`PluginHost` of your own: when
  ``registries`` is first used), so ``PluginInfo.registered`` is filled from then on;
* ``LAYERWISE_DISABLE_PLUGINS=a,b`` blocks plugins before they are imported. Each
  item is an entry-point name (``zoo_llama``) or a distribution name
  (``my-plugins``, compared after PEP 503 normalisation), which blocks every entry
  point of that distribution;
* no plugin is imported from anywhere but installed entry points (or an object
  handed to :meth:`PluginHost.register` explicitly, as tests do);
* two plugins registering the same name of the same kind raise
  :class:`~layerwise.errors.DuplicateNameError` naming both distributions;
* ``layerwise_select_pipeline``: plugins answer independently; two plugins choosing
  different pipelines for one model is a :class:`~layerwise.errors.PluginError` naming
  both. A choice that raises or names no registered pipeline is warned about and
  ignored (an error in strict mode);
* a hook implementation whose name matches no hookspec (a typo, or a hook from a newer
  layerwise) is warned about and listed in ``PluginInfo.warnings``; the plugin still loads.
"""

from __future__ import annotations

import importlib
import os
import re
import threading
from dataclasses import dataclass, field
from importlib.metadata import entry_points  # EntryPoint.dist exists since 3.10
from typing import Any

import pluggy

from layerwise.common.user_warnings import warn_user
from layerwise.errors import DuplicateNameError, PluginError
from layerwise.host import hookspecs
from layerwise.host.registry import Registry

GROUP = "layerwise"
KINDS = ("pipelines", "modifiers", "model_patches", "observers", "datasets", "savers")
#: how a registry names one thing of its kind in messages
SINGULAR = {"pipelines": "pipeline", "modifiers": "modifier", "model_patches": "model patch",
            "observers": "observer", "datasets": "dataset", "savers": "saver"}
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
    #: the entry point's target (``package.module``); empty for objects registered directly
    entry_point: str = ""
    #: non-fatal problems (e.g. hook implementations no hookspec knows)
    warnings: list[str] = field(default_factory=list)
    #: the registered objects, by kind and name (``registered`` holds just the names)
    objects: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def owner(self) -> str:
        release = f"{self.distribution} {self.version}" if self.version else self.distribution
        return f"{release} (plugin {self.name!r})"

    @property
    def status(self) -> str:
        """``"broken"``, ``"disabled"`` or ``"ok"``."""
        return "broken" if self.broken else "disabled" if self.disabled else "ok"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.entry_point,
            "status": self.status,
            "registered": self.registered,
            "broken": self.broken,
            "disabled": self.disabled,
            "warnings": list(self.warnings),
        }


def strict_from_env() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _disabled_names() -> set[str]:
    return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}


def normalize_distribution(name: str) -> str:
    """PEP 503 normalisation: ``My_Plugins`` and ``my-plugins`` are the same distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution_of(ep: Any) -> tuple[str, str]:
    """``(name, version)`` of the distribution that declares entry point ``ep``."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown>", "?"
    return (dist.metadata.get("Name") or "<unknown>"), (dist.version or "?")


class PluginHost:
    """The pluggy manager plus one :class:`Registry` per kind of plugin object.

    ``strict``: ``None`` (default) reads ``LAYERWISE_STRICT_PLUGINS``; ``True``/``False``
    override it (``layerwise plugins`` lists with ``strict=False`` so it can show everything).
    """

    def __init__(self, load_entry_points: bool = True, *, strict: bool | None = None) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.strict = strict
        self._registries: dict[str, Registry] | None = None
        self._loaded: set[tuple[str, str]] = set()
        self._lock = threading.RLock()
        if load_entry_points:
            self.load_entry_points()

    def _is_strict(self) -> bool:
        return strict_from_env() if self.strict is None else self.strict

    # -- loading ---------------------------------------------------------------
    def load_entry_points(self) -> None:
        """Load every entry point of the ``layerwise`` group not loaded yet (safe to call again)."""
        disabled = _disabled_names()
        disabled_dists = {normalize_distribution(n) for n in disabled}
        for ep in entry_points(group=GROUP):
            dist, version = distribution_of(ep)
            key = (normalize_distribution(dist), ep.name)
            if key in self._loaded:  # the same distribution found twice on sys.path, or loaded before
                continue
            self._loaded.add(key)
            # two distributions may use the same entry-point name; neither may hide the other
            name = ep.name if ep.name not in self.plugins else f"{dist}:{ep.name}"
            info = PluginInfo(name, dist, version, entry_point=ep.value)
            self.plugins[name] = info
            if ep.name in disabled or name in disabled or key[0] in disabled_dists:
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
        if name in self.plugins:
            raise ValueError(f"a plugin named {name!r} is already registered ({self.plugins[name].owner}); "
                             f"pick another name or unregister it first")
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
            return
        unknown = sorted(caller.name for caller in self.pm.get_hookcallers(plugin) or ()
                         if not caller.has_spec()
                         and any(not impl.optionalhook for impl in caller.get_hookimpls()
                                 if impl.plugin_name == info.name))
        for hook in unknown:
            message = f"implements {hook!r}, which is no layerwise hook (a typo? hooks: see layerwise.host.hookspecs)"
            info.warnings.append(message)
            warn_user(f"layerwise plugin {info.owner} {message}", RuntimeWarning)

    def _mark_broken(self, info: PluginInfo, reason: str, exc: BaseException) -> None:
        info.broken = reason
        if self.pm.has_plugin(info.name):
            self.pm.unregister(name=info.name)
        if self._is_strict():
            raise PluginError(
                f"layerwise plugin {info.name!r} from distribution {info.distribution} {info.version} "
                f"is broken: {reason} (unset {STRICT_ENV} to skip it, or set {DISABLE_ENV}={info.name})"
            ) from exc
        warn_user(
            f"layerwise plugin {info.owner} is broken and was skipped: {reason} "
            f"(set {STRICT_ENV}=1 to make this an error, or {DISABLE_ENV}={info.name} to silence it)",
            RuntimeWarning,
        )

    # -- registries ------------------------------------------------------------
    @property
    def registries(self) -> dict[str, Registry]:
        """One registry per kind; built on first use. Raises :class:`DuplicateNameError` on a name conflict."""
        with self._lock:
            if self._registries is None:
                self._registries = self._build_registries()
            return self._registries

    def survey(self) -> tuple[dict[str, Registry], list[str]]:
        """Build the registries without stopping at name conflicts, for ``layerwise plugins``.

        Returns the registries (on a conflict the first registration is kept) and one
        message per conflict. Every plugin's ``registered`` lists all it tried to
        register. Compression always uses :attr:`registries`, which raises instead.
        """
        with self._lock:
            conflicts: list[str] = []
            return self._build_registries(conflicts), conflicts

    def _build_registries(self, conflicts: list[str] | None = None) -> dict[str, Registry]:
        registries = {kind: Registry(SINGULAR[kind], kind.replace("_", " ")) for kind in KINDS}
        for info in list(self.plugins.values()):
            info.registered, info.objects = {}, {}
            if info.broken or not self.pm.has_plugin(info.name):
                continue
            for kind in KINDS:
                hook = f"layerwise_register_{kind}"
                register = self._register_callback(registries[kind], kind, info, conflicts)
                try:
                    for impl in getattr(self.pm.hook, hook).get_hookimpls():
                        if impl.plugin_name == info.name:
                            impl.function(*[{"register": register}[arg] for arg in impl.argnames])
                except DuplicateNameError:  # never one plugin's fault alone
                    raise
                except Exception as exc:  # noqa: BLE001
                    for registry in registries.values():
                        registry.remove_owner(info.owner)
                    info.registered, info.objects = {}, {}
                    self._mark_broken(info, f"{hook} raised {type(exc).__name__}: {exc}", exc)
                    break
        return registries

    @staticmethod
    def _register_callback(registry: Registry, kind: str, info: PluginInfo, conflicts: list[str] | None):
        def register(*args: Any) -> None:
            if kind == "model_patches":
                from layerwise.host.model_patch import ModelPatch

                if len(args) != 1 or not isinstance(args[0], ModelPatch):
                    raise TypeError(f"register() for model patches takes one ModelPatch, got {args!r}")
                name, obj = args[0].name, args[0]
            else:
                if len(args) != 2:
                    raise TypeError(f"register() for {kind} takes (name, object), got {len(args)} argument(s)")
                name, obj = args
                if kind == "savers":  # one contract for every saver: a function becomes a FunctionSaver
                    from layerwise.host.saver import as_saver

                    obj = as_saver(obj)
            try:
                registry.add(name, obj, info.owner)
            except DuplicateNameError as exc:
                if conflicts is None:
                    raise
                conflicts.append(str(exc))
            info.registered.setdefault(kind, []).append(name)
            info.objects.setdefault(kind, {})[name] = obj

        return register

    # -- pipeline choice -------------------------------------------------------
    def select_pipeline(self, model: Any, modifiers: list[Any]) -> str | None:
        """Ask plugins whether one of them wants to choose the pipeline (see the module docstring)."""
        arguments = {"model": model, "modifiers": modifiers}
        answers: list[tuple[PluginInfo, str]] = []
        for impl in self.pm.hook.layerwise_select_pipeline.get_hookimpls():
            info = self.plugins.get(impl.plugin_name) or PluginInfo(impl.plugin_name, "<local>", "")
            try:
                choice = impl.function(*[arguments[arg] for arg in impl.argnames])
            except Exception as exc:  # noqa: BLE001 - one plugin's bug must not stop compression
                self._choice_failed(info, f"layerwise_select_pipeline raised {type(exc).__name__}: {exc}", exc)
                continue
            if choice is None:
                continue
            if not isinstance(choice, str) or choice not in self.registries["pipelines"]:
                self._choice_failed(info, f"layerwise_select_pipeline chose {choice!r}, which is no registered "
                                          f"pipeline ({', '.join(self.registries['pipelines'].names())})", None)
                continue
            answers.append((info, choice))
        if len({choice for _, choice in answers}) > 1:
            chosen = "; ".join(f"{info.owner} chose {choice!r}" for info, choice in answers)
            raise PluginError(f"plugins disagree on the pipeline for {type(model).__name__}: {chosen}. "
                              f"Pass pipeline=... explicitly or disable one of them ({DISABLE_ENV}=<plugin>)")
        return answers[0][1] if answers else None

    def _choice_failed(self, info: PluginInfo, reason: str, exc: BaseException | None) -> None:
        if self._is_strict():
            raise PluginError(f"layerwise plugin {info.name!r} from distribution {info.distribution} "
                              f"{info.version}: {reason}") from exc
        warn_user(f"layerwise plugin {info.owner}: {reason}; its choice is ignored", RuntimeWarning)

    def broken(self) -> list[PluginInfo]:
        return [p for p in self.plugins.values() if p.broken]


_host: PluginHost | None = None
_lock = threading.Lock()


def get_host() -> PluginHost:
    """The process-wide plugin host, loaded on first use with its registries built.

    Raises :class:`DuplicateNameError` when two plugins register one name (and, in
    strict mode, :class:`PluginError` for a broken plugin).
    """
    global _host
    with _lock:
        if _host is None:
            host = PluginHost()
            host.registries  # noqa: B018 - run the registration hooks now, so failures surface at load time
            _host = host
        return _host


def reset_host() -> None:
    """Forget the loaded plugins; the next :func:`get_host` reloads entry points.

    Also clears importlib's caches, so distributions installed since are found.
    """
    global _host
    with _lock:
        _host = None
        importlib.invalidate_caches()


def registry(kind: str) -> Registry:
    """The registry of one kind (``"modifiers"``, ``"pipelines"``, ...)."""
    return get_host().registries[kind]
