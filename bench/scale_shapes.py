"""The Llama shapes the scale benches build: shared by scale_bench.py and scale_stream.py."""

SHAPES = {
    # name: (hidden, intermediate, layers, heads, kv heads, vocab)
    "tiny": (256, 512, 4, 4, 2, 1024),
    "160m": (768, 2048, 12, 12, 4, 32000),
    "1b": (2048, 5632, 16, 32, 8, 32000),
    "3b": (3072, 8192, 28, 24, 8, 128256),
}
