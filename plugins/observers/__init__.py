"""Built-in range observers for quantization: min-max, its moving average, and an MSE search."""

from layerwise.plugin import hookimpl

from .minmax import MinMaxObserver, MovingAverageMinMaxObserver
from .mse import MSEObserver

__all__ = ["MSEObserver", "MinMaxObserver", "MovingAverageMinMaxObserver"]


@hookimpl
def layerwise_register_observers(register):
    register("minmax", MinMaxObserver)
    register("moving_average_minmax", MovingAverageMinMaxObserver)
    register("mse", MSEObserver)
