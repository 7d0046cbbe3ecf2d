"""GPTQ on a Llama-shaped model of real size, random weights: time and memory per pipeline.

Shows what layer-by-layer calibration buys: the execution device (the GPU where there is
one) holds one decoder layer and its batch, whatever the model's size. Random weights say
nothing about quality (bench/gptq_bench.py does); they are enough for speed and memory.

    python bench/scale_bench.py --shape 1b --samples 128 --seq-len 512
    python bench/scale_bench.py --shape tiny --samples 8 --seq-len 64     # smoke test on CPU
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

SHAPES = {
    # name: (hidden, intermediate, layers, heads, kv heads, vocab)
    "tiny": (256, 512, 4, 4, 2, 1024),
    "160m": (768, 2048, 12, 12, 4, 32000),
    "1b": (2048, 5632, 16, 32, 8, 32000),
    "3b": (3072, 8192, 28, 24, 8, 128256),
}

RECIPE = "GPTQModifier:\n  scheme: W4A16\n  ignore: [lm_head]\n"


def build(shape: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--pipeline", default="sequential")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()

    import layerwise

    model = build(args.shape)
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, vocab, (1, args.seq_len), generator=generator)}
               for _ in range(args.samples)]
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    layerwise.compress(model, RECIPE, dataset=batches, num_calibration_samples=args.samples,
                       max_seq_length=args.seq_len, pipeline=args.pipeline, show_progress=False)
    seconds = time.perf_counter() - start
    report = model.layerwise_report
    result = {
        "shape": args.shape, "params_b": round(params / 1e9, 3), "samples": args.samples,
        "seq_len": args.seq_len, "pipeline": report.pipeline, "device": torch.cuda.get_device_name()
        if cuda else "cpu", "seconds": round(seconds, 2),
        "modules": len(report.compressed_modules),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "model_fp32_gb": round(params * 4 / 2**30, 2),
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main()
