"""The plugin host and the contracts plugins implement.

Owns the hook specifications, plugin discovery and the registries, and the interfaces a plugin
subclasses or fills in: ``Modifier``, ``Pipeline``, ``ModelPatch``, the lifecycle a pipeline
drives, the state of a run, recipes (what the user wrote, turned into modifiers) and module
matching. May import ``layerwise.common``, ``layerwise.errors`` and the algorithms' plain data
(schemes); never a runtime, I/O or plugin module.
"""
