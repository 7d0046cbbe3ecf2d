"""Built-in plugins, registered through the `layerwise` entry-point group like any third-party plugin."""
