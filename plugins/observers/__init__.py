"""Built-in range observers for quantization."""

from layerwise.hookspecs import hookimpl

from .minmax import MinMaxObserver

__all__ = ["MinMaxObserver"]


@hookimpl
def layerwise_register_observers(register):
    register("minmax", MinMaxObserver)
