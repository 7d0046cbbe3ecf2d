"""The model card: ``README.md`` in the output folder, in the Hugging Face model-card conventions.

YAML front matter (``base_model`` when the model came from a hub id, ``base_model_relation``,
``library_name: transformers``, the library that loads the checkpoint, ``tags``: ``compressed-tensors``,
``layerwise``, the schemes and algorithms of the recipe, and, once evaluated, ``model-index`` with the
metrics), then what was done, how to load it, the metrics table against the original, the recipe, the
calibration data's description and sha256, pictures of the per-layer error and of the KL divergence
(SVG files beside the card, linked from it; PNG copies too where ``cairosvg`` is installed) and the
versions.

**A user's README is never overwritten.** Every card layerwise writes holds :data:`CARD_MARK`; a
``README.md`` without it (written by a person, or a card whose mark was deleted to keep edits) is kept:
:func:`write_card` leaves it and says so, and replacing an output folder carries it over
(:mod:`layerwise.model_io.saving`). Reads the saved (dict) form of the quality report: no torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from layerwise.common.files import replace_file
from layerwise.reports.quality_text import as_document, task_text, window_text
from layerwise.reports.run_report import CompressionReport
from layerwise.reports.run_summary import RunSummary, read_summary
from layerwise.reports.text import loss_of, size_text

CARD_FILE = "README.md"
KL_PICTURE = "layerwise_kl.svg"
LOSS_PICTURE = "layerwise_layer_loss.svg"
#: the line that marks a README as layerwise's card, to be rewritten; without it the file is the user's
CARD_MARK = ("<!-- model card written by layerwise; layerwise rewrites this file while this line is here: "
             "delete the line to make the file yours -->")
#: the Hub's pipeline tag for each kind of model the card can describe
PIPELINE_TAGS = {"causal-lm": "text-generation", "encoder": "feature-extraction",
                 "seq2seq": "text2text-generation"}
#: recipe modifier -> tag (round-to-nearest quantization adds none beyond its scheme)
MODIFIER_TAGS = {"GPTQModifier": "gptq", "AWQModifier": "awq", "SmoothQuantModifier": "smoothquant",
                 "SparseGPTModifier": "sparsegpt", "WandaModifier": "wanda"}
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def is_layerwise_card(path: str | os.PathLike) -> bool:
    """Whether the file at ``path`` is a card layerwise wrote (it holds :data:`CARD_MARK`)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return CARD_MARK in handle.read(1 << 20)
    except OSError:
        return False


def card_files(summary: RunSummary | CompressionReport, quality: Any | None = None,
               name: str | None = None) -> dict[str, str]:
    """File name -> text: the card and its pictures, for a saver's ``extra_files`` or :func:`write_card`.

    ``quality`` defaults to the one the summary holds; ``name`` (the card's title) to the output folder's name.
    """
    summary = summary if isinstance(summary, RunSummary) else _current(summary)
    report = summary.report
    quality = as_document(quality) if quality is not None else report.quality
    name = name or (Path(report.output_dir).name if report.output_dir else None) or report.model or "model"
    files: dict[str, str] = {}
    if any(loss_of(record) is not None for record in report.layer_log):
        from layerwise.reports.svg import loss_svg

        files[LOSS_PICTURE] = loss_svg(report.layer_log, title=f"{'/'.join(report.modifiers)} loss per layer")
    if quality and quality.get("tokens"):
        from layerwise.reports.kl_svg import kl_svg

        files[KL_PICTURE] = kl_svg(quality)
    files[CARD_FILE] = render_card(summary, quality, name, pictures=set(files))
    return files


def output_card_files(report: CompressionReport, output_dir: str | os.PathLike) -> dict[str, str]:
    """The card and its pictures for a new output folder; a README of the user's in the folder about to be
    replaced is carried over as it was instead of the card."""
    output_dir = Path(output_dir)
    files = card_files(report, name=output_dir.name)
    readme = output_dir / CARD_FILE
    if readme.is_file() and not is_layerwise_card(readme):
        files[CARD_FILE] = readme.read_text(encoding="utf-8")
    return files


def write_card(folder: str | os.PathLike, summary: RunSummary | None = None, quality: Any | None = None
               ) -> Path | None:
    """Write the card and its pictures into ``folder``; returns the card's path, or ``None`` when a
    ``README.md`` of the user's is there (it is kept; the pictures are written all the same).

    ``summary`` defaults to the folder's ``layerwise_summary.json``, ``quality`` to the one it holds.
    """
    folder = Path(folder).expanduser()
    summary = summary if summary is not None else read_summary(folder)
    files = card_files(summary, quality, name=folder.resolve().name)
    readme = folder / CARD_FILE
    keep = readme.exists() and not is_layerwise_card(readme)
    for file_name, text in files.items():
        if file_name == CARD_FILE and keep:
            continue
        replace_file(folder / file_name, text)
        if file_name.endswith(".svg"):
            png_beside(folder / file_name)
    return None if keep else readme


def png_beside(svg: Path) -> Path | None:
    """A PNG of ``svg`` next to it where the optional renderer ``cairosvg`` is installed; else nothing."""
    try:
        import cairosvg
    except (ImportError, OSError):  # not installed, or its C library is missing
        return None
    png = svg.with_suffix(".png")
    cairosvg.svg2png(url=str(svg), write_to=str(png), background_color="white")
    return png


def render_card(summary: RunSummary, quality: Mapping[str, Any] | None, name: str,
                pictures: set[str] | frozenset[str] = frozenset()) -> str:
    """The card's text: YAML front matter, :data:`CARD_MARK`, then the markdown body."""
    report = summary.report
    front = front_matter(report, quality, name)
    body = [f"# {name}", "", _what_was_done(summary), "",
            *_loading(name, quality, _low_bit_float(report), report.architecture, _rotates_online(report)),
            *_online_rotation_note(report, name), *_serving(report, name)]
    if quality:
        body += ["## Quality against the original", "", *metrics_table(quality), "", _measured_on(quality), ""]
        if KL_PICTURE in pictures:
            body += [f"![KL divergence per window and per position]({KL_PICTURE})", ""]
    body += ["## Recipe", "", "```yaml", report.recipe.rstrip() or "# not recorded", "```", "",
             "## Calibration data", "", _calibration(report), ""]
    if LOSS_PICTURE in pictures:
        body += ["## Per-layer error", "", f"The solver's loss per layer (`layerwise report {name}` lists it):", "",
                 f"![per-layer loss]({LOSS_PICTURE})", ""]
    body += ["## Versions", "", _versions(summary), ""]
    return "---\n" + yaml.safe_dump(front, sort_keys=False, allow_unicode=True) + "---\n" + CARD_MARK + "\n\n" + \
        "\n".join(body)


def front_matter(report: CompressionReport, quality: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    """The card's metadata, in the Hub's field names."""
    front: dict[str, Any] = {}
    if _is_hub_id(report.model):
        front["base_model"] = report.model
        front["base_model_relation"] = "quantized"
    front["library_name"] = "transformers"
    front["tags"] = recipe_tags(report)
    if quality and quality.get("kind") in PIPELINE_TAGS:
        front["pipeline_tag"] = PIPELINE_TAGS[quality["kind"]]
    metrics = _index_metrics(quality) if quality else []
    if metrics:
        data = quality.get("data") or {}
        front["model-index"] = [{"name": name, "results": [{
            "task": {"type": PIPELINE_TAGS.get(quality.get("kind"), "other")},
            "dataset": {"name": str(data.get("description", "held-out text")), "type": "text"},
            "metrics": metrics}]}]
    return front


def recipe_tags(report: CompressionReport) -> list[str]:
    """``compressed-tensors``, ``layerwise``, then each algorithm and scheme the recipe names."""
    tags = ["compressed-tensors", "layerwise"]
    for key, value in _items(_parsed_recipe(report)):
        if key in MODIFIER_TAGS:
            tags.append(MODIFIER_TAGS[key])
        elif key == "scheme" and isinstance(value, str):
            tags.append(value.lower())
        elif key == "num_bits" and isinstance(value, int):
            tags.append(f"{value}-bit")
        elif key == "sparsity" and isinstance(value, (int, float)):
            tags.append("sparse")
    for modifier in report.modifiers:
        if modifier in MODIFIER_TAGS:
            tags.append(MODIFIER_TAGS[modifier])
    return list(dict.fromkeys(tags))


def metrics_table(quality: Mapping[str, Any]) -> list[str]:
    """The markdown table: each metric for the original and the compressed model."""
    rows = [("metric", "original", "compressed"), ("---", "---:", "---:")]
    tokens = quality.get("tokens")
    if tokens:
        rows.append(("perplexity", f"{tokens['perplexity_original']:.4f}", f"{tokens['perplexity_compressed']:.4f}"))
        for label, key in (("mean", "kl_mean"), ("median", "kl_median"), ("99th percentile", "kl_p99"),
                           ("max", "kl_max")):
            rows.append((f"KL divergence from the original, {label} (nats/token)", "0", f"{tokens[key]:.3e}"))
        rows.append(("top-1 agreement with the original", "1", f"{tokens['top1_agreement']:.4f}"))
        rows.append(("top-5 agreement with the original", "1", f"{tokens['top5_agreement']:.4f}"))
    embeddings = quality.get("embeddings")
    if embeddings:
        rows.append(("embedding cosine to the original", "1", f"{embeddings['mean_cosine']:.4f}"))
        rows.append(("nearest-neighbour agreement", "1", f"{embeddings['nearest_neighbour_agreement']:.4f}"))
    for task, runs in (quality.get("tasks") or {}).items():
        original, compressed = runs.get("original") or {}, runs.get("compressed") or {}
        for metric in [m for m in compressed if "stderr" not in m]:
            rows.append((f"{task}: {metric}", _number(original.get(metric)), _number(compressed.get(metric))))
    return ["| " + " | ".join(row) + " |" for row in rows]


def _index_metrics(quality: Mapping[str, Any]) -> list[dict[str, Any]]:
    metrics = []
    tokens = quality.get("tokens")
    if tokens:
        metrics += [{"type": "perplexity", "value": round(tokens["perplexity_compressed"], 4), "name": "perplexity"},
                    {"type": "perplexity", "value": round(tokens["perplexity_original"], 4),
                     "name": "perplexity of the original"},
                    {"type": "kl_divergence", "value": float(f"{tokens['kl_mean']:.4g}"),
                     "name": "mean KL divergence from the original"},
                    {"type": "accuracy", "value": round(tokens["top1_agreement"], 4),
                     "name": "top-1 agreement with the original"}]
    embeddings = quality.get("embeddings")
    if embeddings:
        metrics += [{"type": "cosine_similarity", "value": round(embeddings["mean_cosine"], 4),
                     "name": "embedding cosine to the original"}]
    return metrics


def _what_was_done(summary: RunSummary) -> str:
    report = summary.report
    source = f"`{report.model}`" if report.model else "a model"
    if report.model and _is_hub_id(report.model):
        source = f"[{report.model}](https://huggingface.co/{report.model})"
    return (f"{source} compressed by layerwise {summary.layerwise_version} with "
            f"{', '.join(report.modifiers) or 'no modifier'} and saved in the compressed-tensors format: "
            f"{len(report.compressed_modules)} modules compressed, {size_text(report.bytes_before, report.bytes_after)}.")


def _low_bit_float(report: CompressionReport) -> bool:
    """Does the recipe quantize weights to an FP4 / MX format (compressed-tensors 0.20 runs those in bfloat16
    only)? Read from the modifiers' arguments, so a scheme written out as a mapping counts as a preset does."""
    from layerwise.host.recipe import parse_recipe

    try:
        modifiers = parse_recipe(report.recipe) if report.recipe else []
    except Exception:  # noqa: BLE001 - a recipe of a plugin not installed here: its text is what there is
        return bool(re.search(r"nvfp4|mxfp|e8m0|tensor_group", report.recipe, re.IGNORECASE))
    return any(getattr(getattr(m, "args", None), "float_format", None) for m in modifiers)


def _loading(name: str, quality: Mapping[str, Any] | None, low_bit_float: bool = False,
             architecture: str = "", online_rotations: bool = False) -> list[str]:
    if online_rotations:  # plain from_pretrained drops the rotations: the block to copy must be layerwise's
        return ["## How to load", "", "```python", "import layerwise", "",
                f'model = layerwise.load_compressed("{name}")', "```", ""]
    causal = (quality or {}).get("kind") == "causal-lm" or architecture.endswith("ForCausalLM")
    auto = "AutoModelForCausalLM" if causal else "AutoModel"
    dtype = ", dtype=torch.bfloat16" if low_bit_float else ""
    imports = ["import torch", f"from transformers import {auto}"] if low_bit_float else [f"from transformers import {auto}"]
    return ["## How to load", "", "```python", *imports, "",
            f'model = {auto}.from_pretrained("{name}"{dtype})', "```", "",
            f'`layerwise.load_compressed("{name}")` loads it too, including what plain transformers cannot run: '
            f'FP4 / MX formats in a float32 model, and the sparse-bitmask folders of older layerwise releases.',
            ""]


def _serving(report: CompressionReport, name: str) -> list[str]:
    """The vLLM command; with an FP8 KV cache its flag, and why the quality table includes that cache."""
    kv = any(key in ("kv_cache_scheme", "attention_scheme") and value is not None
             for key, value in _items(_parsed_recipe(report)))  # FP8 attention quantizes the cache too
    lines = ["## How to serve", "", "```bash", f"vllm serve {name}" + (" --kv-cache-dtype fp8" if kv else ""), "```",
             ""]
    if kv:
        lines += ["The KV cache is FP8 with calibrated scales (`k_scale` / `v_scale` per attention layer): vLLM uses "
                  "them with `--kv-cache-dtype fp8`. Plain transformers computes attention with an unquantized "
                  "cache; `layerwise.load_compressed` (and so `layerwise eval`) applies the scales as vLLM does.", ""]
    lines += ["`layerwise plan --model ... --serve-on GPU` says, before a run, whether vLLM has a kernel for each "
              "scheme on that GPU.", ""]
    return lines


def _online_rotation_note(report: CompressionReport, name: str) -> list[str]:
    """A folder with online rotations (``transform_config``) must not be loaded by plain transformers, which
    drops them: say so, and what loads it."""
    if not _rotates_online(report):
        return []
    return [f"**This model rotates some layers' inputs online** (a Hadamard, in `quantization_config."
            f"transform_config`): transformers ignores that key, so `from_pretrained` alone gives wrong outputs. "
            f'`layerwise.load_compressed("{name}")` puts the rotations back.', ""]


def _rotates_online(report: CompressionReport) -> bool:
    return re.search(r"^\s*online:\s*true\s*$", report.recipe, re.MULTILINE) is not None


def _measured_on(quality: Mapping[str, Any]) -> str:
    data = quality.get("data") or {}
    what = window_text(data) if quality.get("tokens") else f"{data.get('texts')} texts"
    text = (f"Measured by `layerwise eval` on {data.get('description')} (sha256 `{data.get('sha256')}`): {what}; "
            f"{quality.get('device')}, the two models {quality.get('placement')}.")
    for task, runs in (quality.get("tasks") or {}).items():
        text += f" Task {task} (lm-evaluation-harness): {task_text(runs)}."
    return text


def _calibration(report: CompressionReport) -> str:
    data = report.calibration_data or {}
    if not report.calibration_samples:
        return "None: the recipe needs no calibration data."
    if data.get("description"):
        return (f"{data['description']}, sha256 `{data.get('sha256', 'not recorded')}`; "
                f"{report.calibration_samples} samples.")
    return f"{report.calibration_samples} samples (their source and hash were not recorded by this run)."


def _versions(summary: RunSummary) -> str:
    versions = summary.environment.get("versions") or {}
    named = [f"layerwise {summary.layerwise_version}"]
    named += [f"{library} {versions[library]}" for library in ("torch", "transformers", "compressed-tensors")
              if versions.get(library)]
    return ", ".join(named) + "."


def _current(report: CompressionReport) -> RunSummary:
    """A :class:`RunSummary` for a report not yet saved: this process's environment and version."""
    from layerwise import __version__
    from layerwise.host.versions import environment

    return RunSummary(report=report, environment=environment(), layerwise_version=__version__)


def _parsed_recipe(report: CompressionReport) -> Any:
    """The run's recipe as YAML data (``None`` when it was not recorded or does not parse)."""
    try:
        return yaml.safe_load(report.recipe) if report.recipe.strip() else None
    except yaml.YAMLError:
        return None


def _items(node: Any) -> list[tuple[str, Any]]:
    """Every (key, value) of a parsed recipe, depth first."""
    found: list[tuple[str, Any]] = []
    if isinstance(node, Mapping):
        for key, value in node.items():
            found.append((str(key), value))
            found += _items(value)
    elif isinstance(node, list):
        for item in node:
            found += _items(item)
    return found


def _is_hub_id(model: str | None) -> bool:
    return bool(model) and _HUB_ID.fullmatch(model) is not None and not Path(model).expanduser().exists()


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"



