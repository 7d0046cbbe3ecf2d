"""Data-parallel calibration on torch.distributed: two gloo processes against one.

One spawn of two ranks runs every scenario in turn (the imports cost more than the runs) and
leaves its results in files; the tests compare them with single-process runs on the same batches.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch

from layerwise.runtime.distributed import RankFailedError, Reducer, shard, spread
from tests.conftest import build_tiny_llama, run_ranks

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
mp = pytest.importorskip("torch.multiprocessing")

WORLD = 2
SAMPLES, LENGTH = 6, 24
GPTQ_W4A16 = "GPTQModifier:\n  scheme: W4A16\n  group_size: 32\n"  # the preset's groups of 128 > 64 columns
#: (name, recipe, with an output folder?, compress() options)
#: SQ + GPTQ W8A8 compares with ``propagate_error=False``: GPTQ at 8 bits after dynamically quantized
#: activations is chaotic, one tie rounded the other way (a Gram summed in another order) in layer 0
#: moves layer 1's inputs and flips ~0.7 % of its integers; one process given the same batches in
#: another order differs from itself as much. Fed the uncompressed activations, the pieces see the
#: same inputs on one rank or two, and the comparison is about what the ranks reduce.
RUNS = [("gptq", GPTQ_W4A16, True, {}), ("sq_gptq", "SQ_GPTQ_W8A8", False, {"propagate_error": False}),
        ("static", "W8A8_STATIC", False, {}),
        # GPTAQ: the cross terms with the uncompressed stream summed over the ranks like the Hessians
        ("gptaq", "GPTQModifier:\n  scheme: W4A16\n  group_size: 32\n  gptaq: true\n", False, {}),
        # AutoRound: the ranks' samples gathered in the batches' order, one rank tunes each block. 12 steps of
        # 3 of the 6 samples: tuning beats round-to-nearest in both blocks (3 steps of 2 kept round-to-nearest,
        # which no gathered sample or order changes), and which samples a step reads depends on their order
        ("autoround", "AutoRoundModifier:\n  scheme: W4A16\n  group_size: 32\n  iters: 12\n  batch_size: 3\n", False,
         {}),
        # the FP8 KV cache: each attention's key / value maxima taken over the ranks (max-reduced, so exact)
        ("kv_fp8", GPTQ_W4A16 + "  kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor, dynamic: false, "
                                "symmetric: true}\n", False, {})]
#: recipes run on two ranks and compared on their weights only (pruning masks; AWQ's merged sample)
OTHERS = {"wanda": "WandaModifier:\n  sparsity: 0.5\n", "sparsegpt": "SparseGPTModifier:\n  mask_structure: '2:4'\n",
          "awq": "AWQModifier:\n  scheme: W4A16_ASYM\n  group_size: 32\n"}


def batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, 128, (1, LENGTH), generator=g) for _ in range(SAMPLES)]
    return [{"input_ids": i, "attention_mask": torch.ones_like(i)} for i in ids]


#: the KV cache's scales, on the attention modules
KV_SCALES = ("k_scale", "v_scale", "q_scale")


def compressed(model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Every quantized module's weight, qparams and input scale, and each attention's KV cache scales (CPU
    copies; the scales under ``NAME#kv``)."""
    out = {}
    for name, module in model.named_modules():
        kv = {k: v.detach().clone() for k, v in module.named_buffers(recurse=False) if k in KV_SCALES}
        if kv:
            out[f"{name}#kv"] = kv
        if getattr(module, "quantization_args", None) is None:
            continue
        out[name] = {k: v.detach().clone() for k, v in
                     [("weight", module.weight), *module.named_buffers(recurse=False)]}
    return out


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def integers(entry: dict[str, torch.Tensor]) -> torch.Tensor:
    """The quantized integers of a fake-quantized weight: ``round(w / scale + zero_point)``."""
    w = entry["weight"].to(torch.float64)
    scale = entry["weight_scale"].to(torch.float64)
    zero = entry["weight_zero_point"].to(torch.float64)
    if scale.shape[-1] not in (1, w.shape[-1]):  # groups: one scale per run of columns
        group = w.shape[-1] // scale.shape[-1]
        scale, zero = scale.repeat_interleave(group, dim=-1), zero.repeat_interleave(group, dim=-1)
    return torch.round(w / scale + zero)


# -- the ranks ---------------------------------------------------------------------------------------
def _worker(rank: int, store: str, folder: str) -> None:
    import layerwise
    from layerwise.verbs import compression

    out = Path(folder)
    # a file store: no port to pick (a free port found by the parent can be taken before the ranks bind it)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    results: dict[str, object] = {}
    try:
        # the Reducer on its own
        reducer = Reducer(samples=rank + 1)
        t = torch.tensor([1.0 + rank, -float(rank)])
        results["reducer"] = {"sum": reducer.sum(t.clone()).tolist(), "max": reducer.max(t.clone()).tolist(),
                              "min": reducer.min(t.clone()).tolist(), "count": reducer.count(rank + 1),
                              "gather": reducer.gather(rank * 10), "shard": shard(list(range(5)))}
        # spread: layer i solved by rank i % 2, every rank gets every result
        solved_here: list[str] = []
        got = list(spread(["a", "b", "c"], lambda n: solved_here.append(n) or torch.tensor([ord(n)])))
        results["spread"] = {"solved_here": solved_here, "got": [(n, int(v)) for n, v in got]}

        claims: list[str] = []
        reserve = compression.reserve_output

        def recording(path, *args, **kwargs):
            claims.append(str(path))
            return reserve(path, *args, **kwargs)

        compression.reserve_output = recording
        for name, recipe, save, options in RUNS:
            model = build_tiny_llama()
            layerwise.compress(model, recipe, dataset=batches(), num_calibration_samples=SAMPLES,
                               output_dir=str(out / f"{name}-model") if save else None, show_progress=False,
                               options=layerwise.CompressOptions.of(**options))
            torch.save(compressed(model), out / f"{name}-rank{rank}.pt")
            results[name] = {"samples": model.layerwise_report.calibration_samples,
                             "output_dir": model.layerwise_report.output_dir,
                             "tuned": tuned_blocks(model.layerwise_report)}
        results["claims"] = claims
        for name, recipe in OTHERS.items():
            model = build_tiny_llama()
            layerwise.compress(model, recipe, dataset=batches(), num_calibration_samples=SAMPLES, show_progress=False, device="cpu")
            torch.save(weights(model), out / f"{name}-rank{rank}.pt")

        # weights streamed from disk on every rank, rank 0 writing: the same checkpoint as the in-memory run
        if rank == 0:
            build_tiny_llama().save_pretrained(out / "tiny-llama")
        dist.barrier()
        layerwise.compress(str(out / "tiny-llama"), GPTQ_W4A16, dataset=batches(), num_calibration_samples=SAMPLES, output_dir=str(out / "streamed-model"), show_progress=False, options=layerwise.CompressOptions.of(weights="stream"), device="cpu")

        # a rank failing inside calibration ends both with an error, and nothing is saved
        class Boom(layerwise.Modifier):
            def on_sequential_epoch_end(self, state, modules):
                if dist.get_rank() == 1 and any("layers.1" in m for m in modules):
                    raise ValueError("boom on purpose")

        try:
            layerwise.compress(build_tiny_llama(), [Boom(), *layerwise_recipe(GPTQ_W4A16)], dataset=batches(),
                               num_calibration_samples=SAMPLES, output_dir=str(out / "failed-model"),
                               show_progress=False, device="cpu")
            results["failure"] = "no error"
        except Exception as exc:  # noqa: BLE001 - recorded for the test to check
            results["failure"] = f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - surfaced by the test
        results["crash"] = traceback.format_exc()
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def layerwise_recipe(text: str) -> list:
    from layerwise.host.recipe import parse_recipe

    return parse_recipe(text)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    return run_ranks(_worker, tmp_path_factory.mktemp("ranks"), WORLD)


def rank_result(folder: Path, rank: int) -> dict:
    return json.loads((folder / f"rank{rank}.json").read_text())


def tuned_blocks(report) -> dict[str, str]:
    """AutoRound's blocks and how each ended: ``autoround`` (tuning kept) or ``rtn`` (round-to-nearest kept)."""
    return {r["name"]: r["method"] for r in report.layer_log if r.get("modifier") == "AutoRoundModifier"}


def single_process(recipe: str, **options) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str]]:
    """The compressed modules of one process's run, and :func:`tuned_blocks`."""
    import layerwise

    model = build_tiny_llama()
    layerwise.compress(model, recipe, dataset=batches(), num_calibration_samples=SAMPLES, show_progress=False,
                       options=layerwise.CompressOptions.of(**options))
    return compressed(model), tuned_blocks(model.layerwise_report)


#: GPTAQ's step ``W P H^-1`` passes the ranks' summation order through a solve: its scales agree to 1e-5
SCALE_RTOL = {"gptaq": 1e-5}


def assert_matches(reference: dict, distributed: dict, scale_rtol: float = 1e-6) -> None:
    assert set(reference) == set(distributed) and reference
    same = total = 0
    for name, ref in reference.items():
        got = distributed[name]
        assert set(ref) == set(got), name
        if name.endswith("#kv"):  # maxima over the ranks' samples: the very scales of one process
            assert all(torch.equal(ref[k], got[k]) for k in ref), f"{name}: {ref} != {got}"
            continue
        same += int((integers(ref) == integers(got)).sum())
        total += ref["weight"].numel()
        for key in ("weight_scale", "input_scale"):
            if key in ref:
                torch.testing.assert_close(got[key], ref[key], rtol=scale_rtol, atol=0, msg=f"{name}.{key}")
    assert same / total >= 0.999, f"only {same / total:.5f} of the quantized integers match"


# -- the tests -----------------------------------------------------------------------------------------
def test_reducer_sums_maxes_mins_counts_and_gathers(ranks):
    for rank in range(WORLD):
        r = rank_result(ranks, rank)["reducer"]
        assert r == {"sum": [3.0, -1.0], "max": [2.0, 0.0], "min": [1.0, -1.0], "count": 3, "gather": [0, 10],
                     "shard": [rank, rank + 2, rank + 4][:3 - rank]}


def test_spread_solves_each_layer_once_and_every_rank_gets_every_result(ranks):
    assert rank_result(ranks, 0)["spread"]["solved_here"] == ["a", "c"]
    assert rank_result(ranks, 1)["spread"]["solved_here"] == ["b"]
    for rank in range(WORLD):
        assert rank_result(ranks, rank)["spread"]["got"] == [["a", 97], ["b", 98], ["c", 99]]


@pytest.mark.parametrize(("name", "recipe", "options"), [(n, r, o) for n, r, _, o in RUNS], ids=[r[0] for r in RUNS])
def test_two_ranks_match_one_process(ranks, name, recipe, options):
    rank0, rank1 = (torch.load(ranks / f"{name}-rank{r}.pt") for r in range(WORLD))
    for module, tensors in rank0.items():  # every rank ends with the very same model
        for key, value in tensors.items():
            assert torch.equal(value, rank1[module][key]), f"{module}.{key} differs between the ranks"
    reference, tuned = single_process(recipe, **options)
    assert_matches(reference, rank0, SCALE_RTOL.get(name, 1e-6))
    assert rank_result(ranks, 0)[name]["tuned"] == rank_result(ranks, 1)[name]["tuned"] == tuned
    if name == "autoround":  # blocks that keep round-to-nearest would match whatever samples the ranks gathered
        assert tuned and set(tuned.values()) == {"autoround"}, tuned
    if "kv_cache_scheme" in recipe:  # every attention of the model has its KV scales, the same as one process's
        attentions = {n for n, m in build_tiny_llama().named_modules() if type(m).__name__.endswith("Attention")}
        assert {k.removesuffix("#kv") for k in rank0 if k.endswith("#kv")} == attentions and attentions
    assert rank_result(ranks, 0)[name]["samples"] == SAMPLES


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_pruning_and_awq_on_two_ranks(ranks, name):
    """Identical models on both ranks; pruning keeps the single process's mask (>= 99.9 %), AWQ, whose search
    rows are a different sample of the same tokens, stays close to it."""
    import layerwise

    rank0, rank1 = (torch.load(ranks / f"{name}-rank{r}.pt") for r in range(WORLD))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    model = build_tiny_llama()
    layerwise.compress(model, OTHERS[name], dataset=batches(), num_calibration_samples=SAMPLES, show_progress=False, device="cpu")
    reference = weights(model)
    if name == "awq":
        for key, value in reference.items():
            torch.testing.assert_close(rank0[key], value, rtol=0, atol=0.1 * float(value.abs().max()))
        return
    same = sum(int(((rank0[k] == 0) == (v == 0)).sum()) for k, v in reference.items())
    assert same / sum(v.numel() for v in reference.values()) >= 0.999


def test_only_rank_zero_claims_and_writes_the_output(ranks):
    assert (ranks / "gptq-model" / "config.json").exists()
    assert rank_result(ranks, 0)["claims"] == [str(ranks / n) for n in ("gptq-model", "streamed-model", "failed-model")]
    assert rank_result(ranks, 1)["claims"] == []
    assert rank_result(ranks, 0)["gptq"]["output_dir"] == str(ranks / "gptq-model")
    assert rank_result(ranks, 1)["gptq"]["output_dir"] is None
    from layerwise.reports.run_summary import read_summary

    assert read_summary(ranks / "gptq-model").report.ranks == 2  # the saved summary says how it was calibrated


def test_weights_streamed_on_every_rank_write_what_the_in_memory_run_writes(ranks):
    from safetensors.torch import load_file

    streamed, in_memory = (load_file(ranks / n / "model.safetensors") for n in ("streamed-model", "gptq-model"))
    assert streamed.keys() == in_memory.keys()
    assert [k for k in streamed if not torch.equal(streamed[k], in_memory[k])] == []


def test_a_rank_failing_ends_every_rank_with_the_error_and_no_output(ranks):
    assert rank_result(ranks, 1)["failure"] == "ValueError: boom on purpose"
    failure = rank_result(ranks, 0)["failure"]
    assert failure.startswith(f"{RankFailedError.__name__}: rank 1 of 2 failed: ValueError: boom on purpose")
    assert not (ranks / "failed-model").exists()
    assert not [p for p in ranks.iterdir() if p.name.startswith(".failed-model")]  # no temporary left either


def test_one_process_needs_no_process_group():
    reducer = Reducer(samples=3)
    t = torch.ones(2)
    assert reducer.sum(t) is t and reducer.count(4) == 4 and reducer.gather("x") == ["x"]
    assert shard([1, 2, 3]) == [1, 2, 3]
    assert list(spread(["a"], str.upper)) == [("a", "A")]
