"""The checks every layerwise plugin must pass, shipped for plugin authors (and used by layerwise itself).

``check_modifier(MyModifier, {...})``, ``check_model_patch(patch, model)`` ``check_pipeline(MyPipeline)`` and ``check_saver(my_saver)`` run a plugin
through the contract the host relies on and raise :class:`PluginCheckError` (an ``AssertionError``, so pytest shows it as a plain
failure) naming the plugin, the step and the likely fix. Installed with layerwise, the pytest
plugin :mod:`layerwise.testing.pytest_plugin` offers the same as fixtures.
"""

from .devices import DeviceMismatchError, SimulatedDevice, simulated_device
from .errors import PluginCheckError
from .modifiers import check_modifier, count_hooks, tiny_llama, token_batches
from .patches import StepResult, check_model_patch, patch_report
from .pipelines import check_pipeline
from .savers import check_saver
from .tokenizers import word_tokenizer

__all__ = ["DeviceMismatchError", "PluginCheckError", "SimulatedDevice", "StepResult", "check_model_patch", "check_modifier", "check_pipeline", "check_saver", "count_hooks", "patch_report",
           "simulated_device", "tiny_llama", "token_batches", "word_tokenizer"]
