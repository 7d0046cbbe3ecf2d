"""Built-in calibration pipelines, registered through the same hook a third-party plugin uses."""

from layerwise.plugin import hookimpl

from .basic import BasicPipeline
from .datafree import DataFreePipeline
from .independent import IndependentPipeline
from .layer_sequential import LayerSequentialPipeline
from .sequential import SequentialPipeline

PIPELINES = [BasicPipeline, LayerSequentialPipeline, SequentialPipeline, IndependentPipeline, DataFreePipeline]


@hookimpl
def layerwise_register_pipelines(register):
    for cls in PIPELINES:
        register(cls.name, cls)
