"""What a ``compress()`` call did, as data: the report kept on the model and saved as its summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompressionReport:
    """What a ``compress()`` call did; kept on the model as ``model.layerwise_report``."""

    pipeline: str
    modifiers: list[str]
    compressed_modules: list[str]
    seconds: float
    bytes_before: int
    bytes_after: int
    calibration_samples: int
    output_dir: str | None = None
    #: what the sequential targets selected and where they came from:
    #: ``6 x BertLayer (encoder.layer.0-5), found by structure``
    targets_found: str = ""
    #: ``given``, ``patch``, ``_no_split_modules``, ``structure`` or ``none``
    targets_source: str = ""
    layer_log: list[dict[str, Any]] = field(default_factory=list)
    #: the folder or hub id compressed, or the class name of a module passed in
    model: str | None = None
    #: the recipe as YAML (what ``recipe.yaml`` holds)
    recipe: str = ""
    sequential_targets: list[str] = field(default_factory=list)
    #: why a pipeline of the chain could not calibrate the model (one message per fallback)
    fallbacks: list[str] = field(default_factory=list)
    #: trace guards that failed on some batch, so that the graph was traced again for it
    guards_retraced: list[str] = field(default_factory=list)
    #: modules left uncompressed because a parameter held NaN or inf (``non_finite="skip"``)
    skipped_non_finite: list[str] = field(default_factory=list)
    #: how the pipeline cut the model into pieces, and why (``layers: ...`` / ``blocks: ...``)
    pieces: str = ""
    #: phase -> ``{"seconds", "flops", "calls", "gflops_per_second"}`` (forwards, GPTQ Hessians, solves, ...)
    accounting: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: ``memory`` (loaded whole) or ``stream`` (read from disk piece by piece), and why
    weights: str = "memory"
    #: where cached activations rested (``cpu`` / ``disk``), and why when chosen automatically
    activations: str = "cpu"
    #: the process's peak resident memory so far (bytes), and the GPU's peak allocation when one ran
    peak_rss_bytes: int = 0
    peak_gpu_bytes: int | None = None
    #: what rested on the execution device and why (weights moved once, or onloaded piece by piece)
    placement: str = ""
    #: the most bytes of cached activations held in memory at once (0: no cache, or a pipeline without one)
    cache_peak_bytes: int = 0
    #: the calibration data: ``description`` and ``sha256`` (empty when not recorded)
    calibration_data: dict[str, Any] = field(default_factory=dict)
    #: the report card (:meth:`layerwise.reports.quality.QualityReport.to_dict`) once the model was evaluated
    quality: dict[str, Any] | None = None
    #: the piece (1-based) an interrupted run was resumed from; ``None``: run from the start in one go.
    #: ``seconds`` and the sizes then count the interrupted run's work too
    resumed_from_piece: int | None = None
    #: the interrupted run had finished every piece (it stopped while writing the output): only that was redone
    resumed_after_last_piece: bool = False
    #: every setting of the run by name (``CompressOptions.as_dict()``): what a rerun needs to match it
    options: dict[str, Any] = field(default_factory=dict)
    #: the model's class (``LlamaForCausalLM``; a model-free run: its config's ``architectures``): the class the
    #: model card loads it with
    architecture: str = ""
    #: data-parallel processes that calibrated the run (torchrun); 1 for one process
    ranks: int = 1
    #: what the run left undone and why, in a line each (a model-free run's fused MoE experts left dense)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        """The summary ``layerwise compress`` prints, not the dataclass's field dump."""
        from layerwise.reports.text import summary_text

        return summary_text(self)
