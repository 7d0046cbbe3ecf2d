"""Trace wall time and peak RSS, weights on the meta device, each case in a fresh process.

    python bench/trace_bench.py            # all cases, prints a markdown table
    python bench/trace_bench.py --case llama3-8b

Reference (llm-compressor 0.14, same 2-core machine): 8B-shaped 0.53 s, DeepSeek-V3-shaped
0.60 s, about 520 MB peak RSS for the whole process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIG = {
    "llama3-8b": ("LlamaForCausalLM", "LlamaConfig", dict(
        num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)),
    "deepseek-v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        num_hidden_layers=61, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280,
        max_position_embeddings=163840)),
}


def _measure(case: str) -> dict:
    """Runs inside the child process."""
    import resource

    import torch
    import transformers as tf

    from layerwise.tracing import trace

    if case in BIG:
        cls, cfg_cls, kwargs = BIG[case]
        with torch.device("meta"):
            model = getattr(tf, cls)(getattr(tf, cfg_cls)(**kwargs)).eval()
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 1000, (1, 32), generator=gen)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    else:
        sys.path.insert(0, str(ROOT / "tests" / "core" / "tracing"))
        import models

        model = models.build(case, device="meta")
        inputs = models.sample_inputs(model)
    params = sum(p.numel() for p in model.parameters())
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    result = trace(model, inputs, patch=False)  # the tracer alone: a patch's apply (MoE unfusing) is a load cost
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"case": case, "params_b": params / 1e9, "seconds": seconds, "peak_rss_mb": rss,
            "rss_before_trace_mb": rss_before, "subgraphs": len(result.subgraphs),
            "nodes": len(result.graph_module.graph.nodes)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help="run one case in this process and print JSON")
    parser.add_argument("--skip-coverage", action="store_true")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_measure(args.case)))
        return 0
    sys.path.insert(0, str(ROOT / "tests" / "core" / "tracing"))
    import models

    cases = list(BIG) + ([] if args.skip_coverage else models.COVERAGE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    print("| case | params (B, meta) | trace s | peak RSS MB | RSS before trace MB | subgraphs | nodes |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for case in cases:
        proc = subprocess.run([sys.executable, __file__, "--case", case], capture_output=True, text=True, env=env)
        if proc.returncode:
            print(f"| {case} | failed: {proc.stderr.strip().splitlines()[-1][:80]} | | | | | |")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"| {r['case']} | {r['params_b']:.3f} | {r['seconds']:.3f} | {r['peak_rss_mb']:.0f} | "
              f"{r['rss_before_trace_mb']:.0f} | {r['subgraphs']} | {r['nodes']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
