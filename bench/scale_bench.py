"""GPTQ on a Llama-shaped model of real size, random weights: time and memory per pipeline.

Shows what layer-by-layer calibration buys: the execution device (the GPU where there is
one) holds one decoder layer and its batch, whatever the model's size. Random weights say
nothing about quality (bench/gptq_bench.py does); they are enough for speed and memory.

    python bench/scale_bench.py --shape 1b --samples 128 --seq-len 512
    python bench/scale_bench.py --shape tiny --samples 8 --seq-len 64     # smoke test on CPU

Each ``--case`` is one function in ``CASES``:

* ``pipeline`` (default): one in-memory run, its time and peak memory;
* ``ranks``: GPTQ W4A16 of a Llama-shaped model saved to disk, one process against two gloo
  ranks (each rank gets an equal share of the CPU threads), wall times, their ratio and the
  share of identical quantized integers::

    python bench/scale_bench.py --case ranks --hidden 1024 --layers 8 --samples 32 --seq-len 512

* ``stream``: the model saved to disk (safetensors) and compressed in fresh processes with its
  weights streamed from disk and loaded whole: peak RSS of each against the checkpoint's size,
  the two outputs compared tensor by tensor; then a streamed run SIGKILLed in the middle of a
  piece halfway through, resumed, and compared with the uninterrupted one::

    python bench/scale_bench.py --case stream --shape 1b --samples 8 --seq-len 128
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
from scale_shapes import SHAPES

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


def case_pipeline(args: argparse.Namespace) -> dict:
    """One in-memory GPTQ run of ``--shape``: time and peak memory."""
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
    layerwise.compress(model, RECIPE, dataset=batches, num_calibration_samples=args.samples, max_seq_length=args.seq_len, show_progress=False, options=layerwise.CompressOptions.of(pipeline=args.pipeline))
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
    return result


# -- ranks: one process against two gloo ranks ------------------------------------------------------
def _ranks_worker(rank: int, world: int, port: int, folder: str, samples: int, seq_len: int, vocab: int) -> None:
    import torch.distributed as dist

    import layerwise

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the machine's cores
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, vocab, (1, seq_len), generator=generator)} for _ in range(samples)]
    start = time.perf_counter()
    model = layerwise.compress(os.path.join(folder, "model"), RECIPE, dataset=batches, num_calibration_samples=samples,
                               max_seq_length=seq_len, show_progress=False)
    seconds = time.perf_counter() - start
    if rank == 0:
        state = {name: (m.weight.detach().clone(), m.weight_scale.detach().clone(),
                        m.weight_zero_point.detach().clone()) for name, m in model.named_modules()
                 if getattr(m, "quantization_args", None) is not None}
        torch.save(state, os.path.join(folder, f"ranks{world}.pt"))
    with open(os.path.join(folder, f"ranks{world}-rank{rank}.json"), "w") as handle:
        json.dump({"seconds": seconds}, handle)
    if world > 1:
        dist.destroy_process_group()


def _integers(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    w, scale, zero = weight.double(), scale.double(), zero.double()
    group = w.shape[-1] // scale.shape[-1]
    return torch.round(w / scale.repeat_interleave(group, -1) + zero.repeat_interleave(group, -1))


def case_ranks(args: argparse.Namespace) -> dict:
    """GPTQ W4A16 of a saved Llama-shaped model: 1 process vs ``--ranks`` gloo ranks, same batches."""
    import socket
    import tempfile

    import torch.multiprocessing as mp
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate or int(args.hidden * 2.75) // 128 * 128,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), vocab_size=args.vocab,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(os.path.join(folder, "model"))
        del model
        result: dict = {"case": "ranks", "hidden": args.hidden, "layers": args.layers, "params_m": round(params / 1e6, 1),
                        "samples": args.samples, "seq_len": args.seq_len, "cpus": os.cpu_count()}
        for world in (1, args.ranks):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            start = time.perf_counter()
            mp.start_processes(_ranks_worker, args=(world, port, folder, args.samples, args.seq_len, args.vocab),
                               nprocs=world, join=True, start_method="spawn")
            wall = time.perf_counter() - start
            ranks = [json.loads(Path(folder, f"ranks{world}-rank{r}.json").read_text()) for r in range(world)]
            result[f"ranks{world}_compress_s"] = round(max(r["seconds"] for r in ranks), 2)
            result[f"ranks{world}_wall_s"] = round(wall, 2)
        one, many = (torch.load(os.path.join(folder, f"ranks{w}.pt")) for w in (1, args.ranks))
        same = sum(int((_integers(*one[k]) == _integers(*many[k])).sum()) for k in one)
        total = sum(one[k][0].numel() for k in one)
        scales = max(float(((one[k][1].double() - many[k][1].double()).abs() / one[k][1].double().abs()).max())
                     for k in one)
    result["ratio_compress"] = round(result[f"ranks{args.ranks}_compress_s"] / result["ranks1_compress_s"], 3)
    result["identical_integers"] = round(same / total, 6)
    result["max_scale_rel_diff"] = scales
    return result


#: ``--case`` name -> the function that runs it and returns its result (a JSON-able dict)
def case_stream(args: argparse.Namespace) -> dict:
    """Weights streamed from disk and resume after a SIGKILL (bench/scale_stream.py)."""
    from scale_stream import case_stream as run

    return run(args)


CASES = {"pipeline": case_pipeline, "ranks": case_ranks, "stream": case_stream}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), default="pipeline")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--pipeline", default="sequential")
    ranks = parser.add_argument_group("--case ranks")
    ranks.add_argument("--ranks", type=int, default=2, help="gloo ranks to compare with one process")
    ranks.add_argument("--hidden", type=int, default=1024)
    ranks.add_argument("--intermediate", type=int, default=None, help="default: 2.75 x hidden, rounded down to a multiple of 128")
    ranks.add_argument("--layers", type=int, default=8)
    ranks.add_argument("--vocab", type=int, default=8192)
    stream = parser.add_argument_group("--case stream")
    stream.add_argument("--work", default="/tmp/layerwise-scale-bench", help="where the checkpoint and outputs go")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    result = CASES[args.case](args)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main()
