"""The public verbs: ``compress()``, ``evaluate()`` (the report card) and the embedded demo.

Owns the order of a run (check what the user typed, load, calibrate, save, report) and the
options a run takes. May import every package below it (host, tracing, runtime, model I/O,
algorithms, reports); imports no plugin by name: plugins are reached through the registries.
"""
