"""For dataset-loader authors: the loader contract and the keys a calibration batch holds."""

from layerwise.model_io.calibration_data import MODEL_INPUT_KEYS, TEXT_KEYS, DatasetLoader

__all__ = ["MODEL_INPUT_KEYS", "TEXT_KEYS", "DatasetLoader"]
