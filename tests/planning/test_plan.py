"""``layerwise plan``: built on meta from the config, the same checks as compress, numbers from shapes."""

from __future__ import annotations

import pytest
import torch

import layerwise
from layerwise.cli import main
from layerwise.planning.estimate import Quantized, forward_flops, hessian_flops
from layerwise.planning.plan import PlanError, plan_lines
from layerwise.runtime.placement import DEVICE_MEMORY_FRACTION, WORKING_SET_FACTOR

GROUP32 = "{QuantizationModifier: {scheme: W4A16, group_size: 32}}"


@pytest.fixture
def bf16_llama_dir(tmp_path):
    from tests.conftest import build_tiny_llama, make_word_tokenizer

    model = build_tiny_llama().to(torch.bfloat16)
    folder = tmp_path / "tiny-llama-bf16"
    model.save_pretrained(folder)
    make_word_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


def _no_weight_read(monkeypatch):
    """Any read of a tensor's bytes fails the test: a plan reads headers only."""
    import safetensors

    from layerwise.model_io.streaming import safetensors_io

    def refuse(*args, **kwargs):
        raise AssertionError("the plan read weights")

    monkeypatch.setattr(safetensors_io.MappedFiles, "tensor", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(torch, "load", refuse)


def test_a_plan_reads_no_weight_and_reports_targets_pieces_and_layers(bf16_llama_dir, monkeypatch):
    _no_weight_read(monkeypatch)
    plan = layerwise.plan(str(bf16_llama_dir), GROUP32)
    assert plan.ok, plan.errors
    assert plan.patch == "llama" and plan.dtype == torch.bfloat16
    assert plan.targets == ("LlamaDecoderLayer",) and "model.layers.0-1" in plan.targets_found
    assert [p.label for p in plan.pieces][:2] == ["model.layers.0", "model.layers.1"] and len(plan.pieces) == 3
    assert len(plan.layers) == 14 and "lm_head" not in plan.layers  # the preset ignores the head
    assert plan.checkpoint is not None and plan.checkpoint.tensors == 21
    assert plan.samples == 0 and "forwards" not in plan.flops  # data-free: no calibration forwards


@pytest.mark.parametrize("recipe", ["W8A16", "W4A16_ASYM_G32", "W8A8", "FP8_DYNAMIC", "FP8_BLOCK_SMALL", "NVFP4A16",
                                    "MXFP4A16", "MXFP8A16"])
def test_the_planned_output_size_is_what_the_saver_counts(bf16_llama_dir, recipe):
    recipes = {"W4A16_ASYM_G32": "{QuantizationModifier: {scheme: W4A16_ASYM, strategy: channel}}",
               "FP8_BLOCK_SMALL": "{QuantizationModifier: {scheme: {preset: FP8_BLOCK, block_structure: [32, 48], "
                                      "input_activations: {type: float, strategy: group, group_size: 32, "
                                      "dynamic: true}}}}"}
    recipe = recipes.get(recipe, recipe)
    plan = layerwise.plan(str(bf16_llama_dir), recipe)
    assert plan.ok, plan.errors
    model = layerwise.compress(str(bf16_llama_dir), recipe, show_progress=False)
    assert plan.output_bytes == model.layerwise_report.bytes_after
    assert plan.weight_bytes == model.layerwise_report.bytes_before


def test_a_target_typo_fails_the_plan_and_compress_before_the_model_loads(bf16_llama_dir, monkeypatch, capsys):
    from layerwise.tracing.targets import TargetError

    plan = layerwise.plan(str(bf16_llama_dir), GROUP32, options=layerwise.CompressOptions.of(
        sequential_targets=["LlamaDecoderLayr"]))
    assert not plan.ok and "LlamaDecoderLayer" in plan.errors[0]  # did you mean
    assert main(["plan", "--model", str(bf16_llama_dir), "--recipe", GROUP32, "--targets", "LlamaDecoderLayr"]) == 1
    assert "verdict: will not run as asked" in capsys.readouterr().out

    from layerwise.verbs import compression

    monkeypatch.setattr(compression, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(TargetError, match="LlamaDecoderLayer"):
        layerwise.compress(str(bf16_llama_dir), GROUP32, show_progress=False, options=layerwise.CompressOptions.of(
            sequential_targets=["LlamaDecoderLayr"], weights="memory"))


def test_smoothing_mappings_that_match_nothing_are_an_error(bf16_llama_dir):
    recipe = ("{SmoothQuantModifier: {mappings: [[[re:.*nothing_proj], re:.*input_layernorm]]}, "
              "QuantizationModifier: {scheme: W8A8}}")
    plan = layerwise.plan(str(bf16_llama_dir), recipe, dataset=["some text"] * 4)
    assert not plan.ok and "SmoothQuantModifier" in plan.errors[0]
    found = layerwise.plan(str(bf16_llama_dir), "{SmoothQuantModifier: {}, QuantizationModifier: {scheme: W8A8}}",
                           dataset=["some text"] * 4)
    assert found.ok, found.errors
    assert any("input_layernorm -> " in m and "q_proj" in m for m in found.mappings["SmoothQuantModifier"])


def test_memory_choices_follow_the_machine_planned_for(bf16_llama_dir):
    size = layerwise.plan(str(bf16_llama_dir), GROUP32).checkpoint.bytes
    roomy = layerwise.plan(str(bf16_llama_dir), GROUP32, host_memory=2**40)
    assert roomy.chosen.weights == "memory" and all(c.fits for c in roomy.choices)
    # less than 1.5x the checkpoint: auto streams (compress's rule); a chosen weights=memory does not fit
    small = layerwise.plan(str(bf16_llama_dir), GROUP32, host_memory=size)
    assert small.chosen.weights == "stream"
    tight = layerwise.plan(str(bf16_llama_dir), GROUP32, host_memory=size,
                           options=layerwise.CompressOptions.of(weights="memory"))
    assert not tight.ok and "does not fit" not in tight.errors[0] and "weights=memory" in tight.errors[0]


def test_a_gpu_too_small_for_a_piece_is_an_error_naming_it(bf16_llama_dir):
    plan = layerwise.plan(str(bf16_llama_dir), "GPTQ_W8A16", dataset=["a b c"] * 8, max_seq_length=64,
                          gpu_memory=2**18, serve_on="A100")
    assert not plan.ok and "on the GPU" in plan.errors[0] and "model.layers" in plan.errors[0]
    hessians = plan.pieces[0].statistics
    assert hessians == sum(4 * layer.columns ** 2 for layer in plan.layers.values() if ".layers.0." in layer.name)


def test_serving_on_a_named_gpu_without_a_kernel_fails_the_plan(bf16_llama_dir, capsys):
    asym8 = "{QuantizationModifier: {scheme: W8A16, symmetric: false}}"
    assert main(["plan", "--model", str(bf16_llama_dir), "--recipe", asym8, "--serve-on", "H100"]) == 1
    out = capsys.readouterr().out
    assert "none (asymmetric 8-bit" in out and "verdict: will not run as asked" in out
    assert main(["plan", "--model", str(bf16_llama_dir), "--recipe", "W8A16", "--serve-on", "H100"]) == 0
    assert "native (Machete (Hopper))" in capsys.readouterr().out


def test_forward_flops_count_two_per_weight_and_token_plus_attention(tiny_llama):
    config = tiny_llama.config
    per_layer = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64) + 2 * 3 * 64 * 128  # q, k, v (2 kv heads), o; gate, up, down
    matrices = config.num_hidden_layers * per_layer // 2 + 128 * 64  # + lm_head (the embedding is left out)
    tokens, seq = 10, 5
    expected = 2 * matrices * tokens + 4 * seq * 64 * 2 * tokens
    assert forward_flops(tiny_llama, tokens, seq, 2, 64) == expected


def test_autoround_s_steps_and_gptaq_s_second_stream_are_counted(bf16_llama_dir):
    """AutoRound runs each block forward and backward on iters x batch_size samples: far more work than the
    calibration forward, which the estimate used to stop at; GPTAQ carries the original model's stream too."""
    samples = [{"input_ids": torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(i))}
               for i in range(8)]
    gptq = layerwise.plan(str(bf16_llama_dir), "{GPTQModifier: {scheme: W4A16, group_size: 32}}", dataset=samples)
    steps, forwards = {}, {}
    for iters in (10, 20, 30):
        recipe = f"{{AutoRoundModifier: {{scheme: W4A16, group_size: 32, iters: {iters}, batch_size: 4}}}}"
        planned = layerwise.plan(str(bf16_llama_dir), recipe, dataset=samples)
        steps[iters], forwards[iters] = planned.flops["tuning steps"], planned.flops["forwards"]
    # each 10 steps: 40 samples forward and backward (x3), against one forward of the 8 samples in each stream
    assert steps[20] - steps[10] == pytest.approx(steps[30] - steps[20])
    assert steps[30] > 10 * forwards[30] and forwards[10] == forwards[30]  # 30 x 4 x 3 against 3 x 8
    gptaq = layerwise.plan(str(bf16_llama_dir), "{GPTQModifier: {scheme: W4A16, group_size: 32, gptaq: true}}",
                           dataset=samples)
    # GPTQ cuts at layers (one forward); GPTAQ at blocks, each run observed and again quantized, beside the
    # original model's stream: three
    assert (gptq.cut, gptaq.cut) == ("layers", "blocks")
    assert gptaq.flops["forwards"] == pytest.approx(3 * gptq.flops["forwards"])


def test_compress_refuses_what_the_plan_refuses_with_a_plan_error(bf16_llama_dir, monkeypatch):
    from layerwise.runtime import memory_policy

    monkeypatch.setattr(memory_policy, "available_memory", lambda: 4096)
    with pytest.raises(PlanError, match="weights=memory, offload=cpu needs"):
        layerwise.compress(str(bf16_llama_dir), GROUP32, show_progress=False,
                           options=layerwise.CompressOptions.of(weights="memory", offload="cpu"))


def test_compress_refuses_an_output_the_disk_cannot_hold_before_reading_a_weight(bf16_llama_dir, tmp_path,
                                                                                 monkeypatch):
    """compress ran the plan without its output folder, so a disk too small failed at the save, after the work;
    and no placement ``auto`` may pick writes less output, so it stops the run whatever the placement."""
    from layerwise.planning import plan as planning

    monkeypatch.setattr(planning, "_disk_free", lambda output_dir: 1024)
    _no_weight_read(monkeypatch)
    with pytest.raises(PlanError, match="of disk"):
        layerwise.compress(str(bf16_llama_dir), GROUP32, output_dir=tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()
    found = layerwise.plan(str(bf16_llama_dir), GROUP32, output_dir=tmp_path / "out")
    assert [f.topic for f in found.findings if f.level == "error"] == ["disk"]


def test_a_streamed_output_is_planned_with_the_shard_it_copies_its_parts_into(bf16_llama_dir, tmp_path):
    found = layerwise.plan(str(bf16_llama_dir), GROUP32, output_dir=tmp_path / "out")
    disk = {(c.weights, c.offload): c.disk for c in found.choices}
    assert disk[("stream", "cpu")] == 2 * disk[("memory", "cpu")] == 2 * found.output_bytes


def _deepseek_v3_dir(tmp_path) -> str:
    """A DeepSeek-V3-shaped config only: one dense layer, then MoE layers of 16 routed experts and a shared one."""
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=256, dtype="bfloat16",
        architectures=["DeepseekV3ForCausalLM"])
    config.save_pretrained(tmp_path / "ds")
    return str(tmp_path / "ds")


def test_a_deepseek_v3_shaped_plan_reports_the_numbers_it_did_before_the_fast_expert_build(tmp_path):
    """A DeepSeek-V3-shaped config (one dense layer, then MoE layers of 16 routed experts and a shared one, MLA),
    config only: the experts unfused on meta without ``nn.Module.__init__`` (model_zoo.moe._built) and the piece
    accounting's single pass give the per-piece memory, layer count and FLOPs that b765e21 (before both)
    reported for the same plan; the choices' cache is the layer cut's (residual + the dense MLP's input, and one
    sample's rotary cos / sin: every sample has one length, and the cache holds equal values once)."""
    plan = layerwise.plan(_deepseek_v3_dir(tmp_path), "{GPTQModifier: {scheme: W4A16, group_size: 16}}",
                          dataset=["a b c d"] * 512, gpu_memory=80 * 2**30,
                          host_memory=256 * 2**30, serve_on="H100")
    assert plan.ok and len(plan.layers) == 176 and list(plan.targets) == ["DeepseekV3DecoderLayer"]
    assert [[p.label, p.weights, p.activations, p.statistics, p.temporary] for p in plan.pieces] == [
        ["model.layers.0", 72032, 98304, 152576, 2097152], ["model.layers.1", 233824, 98304, 680960, 1572864],
        ["model.layers.2", 233824, 98304, 680960, 1572864], ["model.layers.3", 233824, 98304, 680960, 1572864],
        ["the rest (embeddings, head, ...)", 65664, 98304, 0, 4194304]]
    assert (plan.weight_bytes, plan.output_bytes) == (839168, 315392)
    assert plan.flops == {"forwards": 139854872576.0, "Hessians": 143881404416.0, "solves": 44018248.0}
    assert [[c.weights, c.offload, c.host_peak - plan.baseline_bytes, c.disk, c.fits] for c in plan.choices] == [
        ["memory", "cpu", 53276160, 0, True], ["memory", "disk", 1081344, 52436992, True]]


def test_a_config_only_folder_that_does_not_fit_says_what_would(tmp_path):
    """No safetensors to stream from, a data-free recipe: the plan says why auto keeps the weights in memory and
    offers what can help (not 'fewer samples', which a data-free run has none of)."""
    plan = layerwise.plan(_deepseek_v3_dir(tmp_path), "{QuantizationModifier: {scheme: W4A16, group_size: 16}}",
                          host_memory=2**20)
    assert not plan.ok and "no safetensors checkpoint here to stream from" in plan.auto_note
    (error,) = [e for e in plan.errors if "no placement fits" in e]
    assert "--model-free" in error and "fewer samples" not in error


def test_a_kv_cache_is_planned_with_its_serving_and_a_second_stream_doubles_the_cache(bf16_llama_dir, tmp_path,
                                                                                      capsys):
    data = [{"input_ids": torch.randint(0, 100, (1, 16))} for _ in range(4)]
    kv = "{QuantizationModifier: {scheme: null, kv_cache_scheme: fp8_head}}"
    plan = layerwise.plan(str(bf16_llama_dir), kv, dataset=data, serve_on="H100")
    assert plan.ok and "per KV head" in plan.kv_cache and plan.kv_serving.status == "native"
    # per-head scales are read by FlashAttention 3 only: on an A100 the plan (and the CLI's exit status) fails
    text = tmp_path / "calib.txt"
    text.write_text("\n\n".join(" ".join(f"w{i + j}" for j in range(20)) for i in range(8)))
    flags = ["plan", "--model", str(bf16_llama_dir), "--recipe", GROUP32, "--dataset", str(text), "--num-samples", "4"]
    assert main([*flags, "--kv-cache", "fp8_head", "--serve-on", "A100"]) == 1
    assert "kv cache:    FP8 E4M3, static scales per KV head" in capsys.readouterr().out
    assert main([*flags, "--kv-cache", "fp8", "--serve-on", "A100"]) == 0
    refused = layerwise.plan(str(bf16_llama_dir), kv, dataset=data, serve_on="A100")
    assert not refused.ok and any("per-head KV scales" in e for e in refused.errors)
    plain = layerwise.plan(str(bf16_llama_dir), "GPTQ_W4A16", dataset=data)
    gptaq = layerwise.plan(str(bf16_llama_dir), "{GPTQModifier: {scheme: W4A16, gptaq: true}}", dataset=data)
    assert not plain.reference_stream and gptaq.reference_stream
    assert gptaq.cache_bytes == 2 * plain.cache_bytes


def test_a_model_free_plan_builds_no_model_and_forecasts_the_run(tmp_path):
    import json

    from layerwise.verbs.options import CompressOptions
    from tests.model_io.model_free.test_model_free import G32, _save_llama

    folder = _save_llama(tmp_path / "mystery")  # sharded, and an architecture transformers does not know
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mystery-lm", architectures=["MysteryForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    options = CompressOptions.of(weights="model-free", workers=2)
    plan = layerwise.plan(str(folder), G32, output_dir=tmp_path / "out", options=options, serve_on="H100")
    assert plan.ok, plan.errors
    forecast = plan.model_free
    assert forecast.shards == len(list(folder.glob("*.safetensors"))) and forecast.workers == 2
    assert len(plan.layers) == 14 and plan.chosen.weights == "model-free"
    assert plan.chosen.host_peak == plan.baseline_bytes + 2 * forecast.per_worker
    report = layerwise.compress(str(folder), G32, output_dir=tmp_path / "out", options=options)
    written = sum(f.stat().st_size for f in (tmp_path / "out").glob("*.safetensors"))
    assert abs(plan.output_bytes - written) < 0.05 * written  # the shards' JSON headers aside (a few KB here)
    assert len(report.compressed_modules) == 14
    # too little memory for the workers: the plan (and its exit status) says so before any work
    small = layerwise.plan(str(folder), G32, options=options, host_memory=plan.baseline_bytes // 2)
    assert not small.ok and "model-free run needs" in small.errors[0]


@pytest.mark.parametrize("pieces", ["layers", "blocks"])
def test_the_planned_cache_is_what_the_run_holds_at_its_widest_cut(pieces):
    """At blocks a cut holds the residual stream (and rotary cos / sin, token ids); before the layers also the
    down projection's input beside it, four times as wide here: the plan tells the two apart."""
    from tests.conftest import build_tiny_llama

    model = build_tiny_llama(intermediate_size=256)
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 128, (1, 32), generator=generator)} for _ in range(16)]
    recipe = "{GPTQModifier: {scheme: W4A16, group_size: 32}}"
    options = layerwise.CompressOptions.of(pieces=pieces)
    plan = layerwise.plan(model, recipe, dataset=data, max_seq_length=32, options=options)
    report = layerwise.compress(model, recipe, dataset=data, max_seq_length=32, options=options,
                                show_progress=False).layerwise_report
    assert plan.cut == pieces and report.pieces.startswith(pieces)
    assert report.cache_peak_bytes > 0
    assert abs(plan.cache_bytes / report.cache_peak_bytes - 1) < 0.1, (plan.cache_bytes, report.cache_peak_bytes)


def test_the_gpu_peak_follows_the_runtime_placement_rule(bf16_llama_dir):
    """Room for everything: the weights move once and the cache stays on the GPU; a GPU too small for the cache
    keeps only what the budget leaves (the rest spills to CPU memory), its peak under the budget."""
    data = [{"input_ids": torch.randint(0, 100, (1, 64))} for _ in range(64)]
    recipe = "{GPTQModifier: {scheme: W4A16, group_size: 32}}"
    roomy = layerwise.plan(str(bf16_llama_dir), recipe, dataset=data, max_seq_length=64, gpu_memory=2**34)
    resident, cached, work = roomy.gpu_peak_parts
    assert roomy.cut == "layers" and resident == roomy.weight_bytes and cached == roomy.cache_bytes > 0
    assert roomy.gpu_peak == resident + cached + work and work == max(
        p.activations + p.statistics + p.temporary for p in roomy.pieces if p.runs)
    working_set = WORKING_SET_FACTOR * 64 * roomy.widest_linear * 4  # the runtime's rule for a piece's temporaries
    free = int((roomy.weight_bytes + roomy.cache_bytes // 2 + working_set) / DEVICE_MEMORY_FRACTION)
    tight = layerwise.plan(str(bf16_llama_dir), recipe, dataset=data, max_seq_length=64, gpu_memory=free)
    assert tight.gpu_peak_parts[0] == roomy.weight_bytes
    assert abs(tight.gpu_peak_parts[1] - roomy.cache_bytes // 2) <= 8
    assert roomy.gpu_peak is not None and layerwise.plan(str(bf16_llama_dir), recipe, dataset=data).gpu_peak is None


def test_the_plan_counts_the_tokens_of_short_samples_as_the_run_reads_them(tiny_llama_dir, tmp_path):
    """Chunks shorter than max_seq_length: the plan tokenizes the data with the folder's tokenizer, so its cache is
    the run's, not every sample taken at its longest (which the plan falls back to without a tokenizer)."""
    text = tmp_path / "calib.txt"
    text.write_text("\n\n".join(" ".join(f"w{(i * 7 + j) % 90}" for j in range(5 + 3 * i)) for i in range(16)))
    recipe = "{GPTQModifier: {scheme: W4A16, group_size: 32}}"
    plan = layerwise.plan(str(tiny_llama_dir), recipe, dataset=str(text), max_seq_length=64)
    report = layerwise.compress(str(tiny_llama_dir), recipe, dataset=str(text), max_seq_length=64,
                                show_progress=False).layerwise_report
    assert plan.samples == report.calibration_samples > 1
    assert plan.tokens_counted is not None and plan.tokens_counted < plan.samples * 64
    assert abs(plan.cache_bytes / report.cache_peak_bytes - 1) < 0.1, (plan.cache_bytes, report.cache_peak_bytes)
    assert "tokenized now" in "\n".join(plan_lines(plan))


def test_the_executable_plans_and_a_caller_in_process_keeps_its_garbage_collector(bf16_llama_dir, capsys):
    """``layerwise plan`` leaves its meta model to the process exit (the collector off, then frozen); ``main``
    called in a process that goes on must not switch the caller's collector off."""
    import gc
    import subprocess
    import sys

    assert main(["plan", "--model", str(bf16_llama_dir), "--recipe", "W8A16"]) == 0
    assert gc.isenabled()
    capsys.readouterr()
    done = subprocess.run([sys.executable, "-m", "layerwise", "plan", "--model", str(bf16_llama_dir), "--recipe",
                           "W8A16"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "verdict: runs as asked" in done.stdout


def test_moe_experts_are_served_by_vllm_s_fused_moe_rules(tmp_path):
    """vLLM runs each experts module as one fused layer: asymmetric int experts have no kernel there (dense
    layers do: Marlin's uint4), and an expert's projections must share one scheme."""
    folder = _deepseek_v3_dir(tmp_path)
    asym = layerwise.plan(folder, "{QuantizationModifier: {scheme: W4A16_ASYM, strategy: channel}}", serve_on="H100")
    rows = {what: support.status for what, _, support in asym.serving}
    assert rows == {"weights int4 channel asym": "native", "weights int4 channel asym (MoE experts)": "none"}, rows
    assert not asym.ok and any("symmetric" in e and "MoE experts" in e for e in asym.errors)
    assert layerwise.plan(folder, "{QuantizationModifier: {scheme: W4A16, strategy: channel}}", serve_on="H100").ok
    mixed = ("[{QuantizationModifier: {scheme: W4A16, strategy: channel, targets: ['re:.*experts.*(gate|up)_proj$']}}, "
             "{QuantizationModifier: {scheme: W8A16, targets: ['re:.*experts.*down_proj$']}}]")
    plan = layerwise.plan(folder, mixed, serve_on="H100")
    assert not plan.ok and any("model.layers.1.mlp.experts" in e and "same scheme" in e for e in plan.errors)


def test_a_gpu_name_read_as_another_says_so(bf16_llama_dir):
    plan = layerwise.plan(str(bf16_llama_dir), "W8A16", serve_on="GH200")
    assert plan.serve_on.name == "H200" and any("'GH200' is read as H200" in f.text for f in plan.findings)
    exact = layerwise.plan(str(bf16_llama_dir), "W8A16", serve_on="h100")
    assert not any("read as" in f.text for f in exact.findings)


def test_a_kv_cache_set_twice_is_refused_before_the_run(bf16_llama_dir):
    """A recipe's kv_cache_scheme and --kv-cache's modifier would each calibrate the k/v scales; the last would be
    saved and the first silently dropped."""
    from layerwise.cli.arguments import with_kv_cache

    recipe = with_kv_cache("QuantizationModifier:\n  scheme: W8A16\n  kv_cache_scheme: fp8\n", "fp8_head")
    plan = layerwise.plan(str(bf16_llama_dir), recipe, dataset=["a b c d"] * 4)
    assert not plan.ok and any("the KV cache is set twice" in error for error in plan.errors)
    both = ("- QuantizationModifier: {scheme: W8A16}\n"
            "- QuantizationModifier: {scheme: null, kv_cache_scheme: fp8, attention_scheme: fp8}\n")  # one cache
    assert not any("set twice" in e for e in layerwise.plan(str(bf16_llama_dir), both, dataset=["a b"] * 4).errors)


def test_hessian_flops_count_the_strips_of_the_device_the_plan_runs_on():
    """On CUDA a run folds each Gram matrix in strips as tall as CUDA_STRIP_BYTES allow (one product up to
    4096 inputs), so it computes more of the lower triangle than the CPU's 128-row strips: the plan counts that."""
    layers = [Quantized("a", 2048, 2048, None, None, True), Quantized("b", 2048, 8192, None, None, True)]
    tokens = 1000
    cpu, cuda = hessian_flops(layers, tokens, "cpu"), hessian_flops(layers, tokens, "cuda")
    whole_2048 = 2 * tokens * 2048 * 2048  # one strip: the whole product
    upper_2048 = sum(2 * tokens * 128 * (2048 - i) for i in range(0, 2048, 128))
    assert cpu < cuda
    assert cuda - cpu > whole_2048 - upper_2048 - 1  # the 2048-wide layer alone accounts for at least this
    assert hessian_flops(layers[:1], tokens, "cuda") == whole_2048
    assert hessian_flops(layers[:1], tokens) == upper_2048


def test_autoround_float32_steps_where_bfloat16_multiplies_faster_get_a_note_naming_step_dtype(monkeypatch):
    """A float32 model's AutoRound steps on a device whose bfloat16 matmuls are >= 1.5x its float32 ones (measured
    here, from the table for a named GPU): the plan names step_dtype: bfloat16; not when it is set, not when
    bfloat16 is no faster, not for GPTQ."""
    from layerwise.planning import plan as planning
    from layerwise.planning.hardware import Rates
    from tests.conftest import build_tiny_llama

    speedup = {"bfloat16": 3.0}
    monkeypatch.setattr(planning, "measured_rates", lambda device, dtype, *a, **k: Rates(1e11, 1e11,
                                                                                        "measured now (test)"))
    monkeypatch.setattr(planning, "matmul_rate", lambda device, dtype, *a, **k: 1e11 * (
        speedup["bfloat16"] if dtype == torch.bfloat16 else 1.0))
    model = build_tiny_llama()
    data = [{"input_ids": torch.randint(0, 128, (1, 32))} for _ in range(16)]

    def notes(recipe, **kwargs):
        found = layerwise.plan(model, recipe, dataset=data, max_seq_length=32, **kwargs)
        return [f.text for f in found.findings if "step_dtype" in f.text]

    autoround = "{AutoRoundModifier: {scheme: W4A16, group_size: 32, iters: 10}}"
    (note,) = notes(autoround)
    assert "AutoRoundModifier runs its steps in float32" in note and "3.0x faster: step_dtype: bfloat16" in note
    assert not notes("{AutoRoundModifier: {scheme: W4A16, group_size: 32, iters: 10, step_dtype: bfloat16}}")
    assert not notes("{GPTQModifier: {scheme: W4A16, group_size: 32}}")
    speedup["bfloat16"] = 1.2
    assert not notes(autoround)
    (on_h100,) = notes(autoround, gpu_memory=80 * 2**30, serve_on="H100")  # the datasheet: tensor cores vs float32
    assert "x faster: step_dtype: bfloat16" in on_h100
