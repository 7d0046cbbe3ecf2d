"""``check_model_patch``: what a model patch promises, checked step by step on a model it is for.

1. **ignore**: every ignore entry matches a module (a typo would compress what was meant to stay);
2. **targets**: the sequential targets select modules, and none holds another (the inner one
   would be swallowed into its parent's piece);
3. **opaque functions**: each is a function some module of the model calls by name (the tracer
   swaps names in the forwards' globals: an entry nothing calls protects nothing);
4. **mappings**: every regex of ``smoothing_mappings`` matches a module (SmoothQuant / AWQ read them),
   and, per modality, scaling every resolved mapping by random positive scales leaves the outputs
   unchanged (a reader of the smoothed output left out, or a norm that is not an input norm, shows);
   with a ``rotation_layout`` (not a refusal), rotating the residual stream, the inputs of its ``online`` layers by an
   online Hadamard (with the random signs of ``online_signs``) and its attention ``heads``, leaves the
   outputs unchanged too;
5. **trace**, per modality the patch builds sample inputs for: one subgraph per target the
   forward calls, plus one, each target its own call; the replay equals the plain forward
   (<= 1e-5 relative), else a function needs ``opaque_functions`` or a module ``leaf_modules``;
6. **RTN** and 7. **GPTQ**: W4A16 (per channel) through ``sequential``, no fallback of any kind;
8. **reload**: the GPTQ model saves, reloads with transformers and reproduces layerwise's outputs.

:func:`check_model_patch` raises at the first failure; :func:`patch_report` runs every step and
records each (what ``layerwise plugins --check`` prints).
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from layerwise.algorithms.quantization.storage import linear_weight
from layerwise.common.matching import find_modules, unmatched
from layerwise.common.quiet import without_progress_bars
from layerwise.host.model_patch import ModelPatch
from layerwise.host.patch_selection import apply_patch

from .errors import PluginCheckError

CHECK = "check_model_patch"
MODALITIES = ("text", "image", "audio")
#: the largest relative difference between replay and plain forward that counts as equal
REPLAY_TOLERANCE = 1e-5
#: the largest relative output change random smoothing scales may cause (fp32 rounding only)
MAPPING_TOLERANCE = 1e-4
#: every step, in the order they run (``trace`` runs once per modality)
STEPS = ("ignore", "targets", "opaque functions", "mappings", "trace", "RTN", "GPTQ", "reload")


@dataclass(frozen=True)
class StepResult:
    """One step of the check: passed, failed (with the kit's message) or skipped (an earlier step failed)."""

    step: str
    status: str  # "passed" | "failed" | "skipped"
    seconds: float = 0.0
    message: str = ""


def check_model_patch(patch: ModelPatch, model: torch.nn.Module, modalities: Sequence[str] | None = None, *,
                      calibrate: bool = True) -> None:
    """Run every check of ``patch`` on ``model`` (random weights are fine); raises :class:`PluginCheckError`.

    ``modalities``: those to trace (default: every one ``patch.sample_inputs`` builds inputs for);
    the richest one (last) is calibrated with RTN and GPTQ and saved, unless ``calibrate=False``.
    """
    for _, run in _steps(patch, model, modalities, calibrate):
        run()


def patch_report(patch: ModelPatch, model: torch.nn.Module, modalities: Sequence[str] | None = None, *,
                 calibrate: bool = True) -> list[StepResult]:
    """Every step's result; after a failure the steps that build on it are skipped, the others still run."""
    results: list[StepResult] = []
    failed = False
    for step, run in _steps(patch, model, modalities, calibrate):
        if failed and step.split()[0] in ("RTN", "GPTQ", "reload"):
            results.append(StepResult(step, "skipped"))
            continue
        start = time.perf_counter()
        try:
            run()
        except PluginCheckError as error:
            results.append(StepResult(step, "failed", time.perf_counter() - start, str(error)))
            failed = failed or step.startswith(("sample inputs", "trace", "targets", "GPTQ"))
        else:
            results.append(StepResult(step, "passed", time.perf_counter() - start))
    return results


def _steps(patch: ModelPatch, model: torch.nn.Module, modalities: Sequence[str] | None,
           calibrate: bool) -> Iterator[tuple[str, Callable[[], None]]]:
    """(step name, thunk) pairs; later thunks read what earlier ones left in ``done``."""
    apply_patch(model, patch)
    done: dict[str, Any] = {}
    yield "ignore", lambda: _check_ignore(patch, model)
    yield "targets", lambda: _check_targets(patch, model)
    yield "opaque functions", lambda: _check_opaque_functions(patch, model)
    yield "mappings", lambda: _check_mappings(patch, model)
    try:
        built = _sample_inputs(patch, model, modalities)
    except PluginCheckError as error:
        yield "sample inputs", lambda failure=error: _raise(failure)
        return
    for modality, inputs in built.items():
        if patch.smoothing_mappings:
            yield f"mappings exact ({modality})", lambda m=modality, i=inputs: _check_mappings_exact(patch, model, m, i)
        if patch.rotation_layout is not None and not patch.rotation_layout.refusal:
            yield f"rotation exact ({modality})", lambda m=modality, i=inputs: _check_rotation_exact(patch, model, m, i)
    for modality, inputs in built.items():
        yield f"trace ({modality})", lambda m=modality, i=inputs: _check_trace(patch, model, m, i)
    if not calibrate:
        return
    modality, inputs = list(built.items())[-1]
    yield "RTN", lambda: _check_calibration(patch, model, modality, inputs, gptq=False)
    yield f"GPTQ ({modality})", lambda: done.update(gptq=_check_calibration(patch, model, modality, inputs, gptq=True))
    yield "reload", lambda: _check_reload(patch, done["gptq"], inputs)


def _raise(error: Exception) -> None:
    raise error


def _fail(patch: ModelPatch, step: str, problem: str, fix: str = "") -> PluginCheckError:
    return PluginCheckError(CHECK, patch.name, step, problem, fix)


def _elsewhere(patch: ModelPatch, model: torch.nn.Module, entries: list[Any],
               unused_in: Callable[[torch.nn.Module, list[Any]], list[Any]]) -> list[Any]:
    """``entries`` unused in ``model`` that no other tiny model of the patch uses either (one patch
    may cover several layouts: BERT's ``classifier`` exists under BertForSequenceClassification only)."""
    for build in patch.tiny_models:
        if not entries:
            break
        other = build()
        if type(other) is not type(model):
            apply_patch(other, patch)
            entries = unused_in(other, entries)
    return entries


def _check_ignore(patch: ModelPatch, model: torch.nn.Module) -> None:
    missing = _elsewhere(patch, model, unmatched(model, patch.ignore), unmatched)
    if missing:
        raise _fail(patch, "ignore", f"ignore entr{'ies' if len(missing) > 1 else 'y'} "
                    f"{', '.join(map(repr, missing))} match no module of {type(model).__name__}",
                    "use class names, qualified names or 're:' patterns that exist in the model")


def _check_targets(patch: ModelPatch, model: torch.nn.Module) -> None:
    blocks = find_modules(model, patch.sequential_targets, patch.ignore)
    if not blocks:
        raise _fail(patch, "targets", f"sequential_targets {list(patch.sequential_targets)} select no module of "
                    f"{type(model).__name__}", "name the class of the transformer block (LlamaDecoderLayer, ...)")
    for outer in blocks:
        inner = next((b for b in blocks if b.startswith(outer + ".")), None)
        if inner is not None:
            raise _fail(patch, "targets", f"target {inner!r} is inside target {outer!r}: the targets nest, so the "
                        f"inner one would be swallowed into its parent's piece",
                        "name the blocks of one level only (e.g. the decoder layer, not also its MLP)")


def _check_opaque_functions(patch: ModelPatch, model: torch.nn.Module) -> None:
    for function in patch.opaque_functions:
        if not isinstance(getattr(function, "__layerwise_opaque__", function), types.FunctionType):
            raise _fail(patch, "opaque functions", f"{_label(function)} is not a plain function",
                        "list module-level functions; keep a module whole with leaf_modules instead")
    unused = _elsewhere(patch, model, _unseen_functions(model, list(patch.opaque_functions)), _unseen_functions)
    if unused:
        raise _fail(patch, "opaque functions", f"{_label(unused[0])} is not a global of any module that defines a "
                    f"layer of {type(model).__name__}, so the tracer never meets it",
                    "list the function the forward calls by that name (it may have moved in this "
                    "transformers release), or drop the entry")


def _label(function: Any) -> str:
    original = getattr(function, "__layerwise_opaque__", function)
    return f"{getattr(original, '__module__', '?')}.{getattr(original, '__qualname__', original)}"


def _unseen_functions(model: torch.nn.Module, functions: list[Any]) -> list[Any]:
    """``functions`` no module defining one of ``model``'s layers holds as a global (how forwards call them)."""
    scopes = [sys.modules.get(name) for name in {type(m).__module__ for m in model.modules()}]
    seen = {id(value) for scope in scopes if scope is not None for value in vars(scope).values()}
    return [f for f in functions if id(f) not in seen and id(getattr(f, "__layerwise_opaque__", f)) not in seen]


def _check_mappings(patch: ModelPatch, model: torch.nn.Module) -> None:
    for balance, smoothed in patch.smoothing_mappings:
        missing = unmatched(model, [*balance, smoothed])
        if missing:
            raise _fail(patch, "mappings", f"smoothing mapping {list(balance)} <- {smoothed!r}: "
                        f"{', '.join(map(repr, missing))} match no module of {type(model).__name__}",
                        "write 're:' patterns over the qualified names `print(model)` shows")


def _check_mappings_exact(patch: ModelPatch, model: torch.nn.Module, modality: str, inputs: dict[str, Any]) -> None:
    from layerwise.algorithms.quantization.mappings import resolve_mappings
    from layerwise.algorithms.quantization.smoothing import apply_smoothing

    with torch.no_grad(), patch.calibrating(model):
        expected = _first_tensor(model(**inputs))
    resolved = resolve_mappings(model, patch.smoothing_mappings, owner="check_model_patch",
                                patch_name=patch.name).mappings
    generator = torch.Generator().manual_seed(0)

    def moved(mappings) -> float:
        work = copy.deepcopy(model)
        for mapping in mappings:
            width = int(linear_weight(work.get_submodule(mapping.balance[0])).shape[1])
            apply_smoothing(work, mapping, torch.rand(width, generator=generator) * 1.5 + 0.5)
        with torch.no_grad(), patch.calibrating(work):
            got = _first_tensor(work(**inputs))
        return float((got - expected).abs().max() / expected.abs().max().clamp(min=1e-12))

    if resolved and moved(resolved) > MAPPING_TOLERANCE:
        culprit = next((m for m in resolved if moved([m]) > MAPPING_TOLERANCE), resolved[0])
        raise _fail(patch, f"mappings exact ({modality})", f"scaling {culprit.smoothed} -> "
                    f"{list(culprit.balance)} changes the model's outputs", "every layer reading the smoothed "
                    "output must be a balance layer, and the smoothed module must be an input norm (or Linear) "
                    "whose output goes nowhere else (GUIDE.md, 'Smoothing mappings')")


def _check_rotation_exact(patch: ModelPatch, model: torch.nn.Module, modality: str, inputs: dict[str, Any]) -> None:
    """Rotating a copy's residual stream (norms folded, a random orthogonal matrix) and, where the layout
    lists them, the inputs of its online layers (with their signs) and its attention heads (Hadamards) keeps its
    outputs."""
    from layerwise.algorithms.quantization.online_rotation import (
        OnlineRotationError,
        flip_online_signs,
        rotate_inputs_online,
    )
    from layerwise.algorithms.quantization.rotation import (
        RotationError,
        rotate_heads,
        rotate_residual_stream,
    )

    step = f"rotation exact ({modality})"
    with torch.no_grad(), patch.calibrating(model):
        expected = _first_tensor(model(**inputs))
    work = copy.deepcopy(model)
    try:
        rotate_residual_stream(work, patch.rotation_layout, "orthogonal", seed=0, owner="check_model_patch")
        if patch.rotation_layout.online:
            if patch.rotation_layout.online_signs:
                flip_online_signs(work, patch.rotation_layout.online_signs, owner="check_model_patch")
            rotate_inputs_online(work, patch.rotation_layout.online, owner="check_model_patch")
        if patch.rotation_layout.heads:
            rotate_heads(work, patch.rotation_layout.heads, owner="check_model_patch")
    except (RotationError, OnlineRotationError) as exc:
        raise _fail(patch, step, str(exc), "fix the patch's rotation_layout (GUIDE.md, 'Rotations')") from None
    with torch.no_grad(), patch.calibrating(work):
        got = _first_tensor(work(**inputs))
    moved = float((got - expected).abs().max() / expected.abs().max().clamp(min=1e-12))
    if moved > MAPPING_TOLERANCE:
        raise _fail(patch, step, f"rotating the residual stream (and the layout's online and head layers) moves "
                    f"the outputs by {moved:.2g} (relative)",
                    "every Linear reading the stream must follow a listed norm, every Linear adding to it "
                    "must be a writer, and an online layer's input must reach nothing else (GUIDE.md, 'Rotations')")


def _sample_inputs(patch: ModelPatch, model: torch.nn.Module, modalities: Sequence[str] | None) -> dict[str, Any]:
    if patch.sample_inputs is None:
        raise _fail(patch, "sample inputs", "the patch has no sample_inputs builder, so nothing can be traced",
                    "give it sample_inputs(config, modality) returning the forward's keyword arguments")
    built = {}
    for modality in modalities or MODALITIES:
        try:
            built[modality] = patch.sample_inputs(model.config, modality)
        except ValueError:
            if modalities:  # asked for explicitly
                raise
    if not built:
        raise _fail(patch, "sample inputs", f"sample_inputs builds inputs for none of {list(MODALITIES)}")
    return built


def _called_targets(patch: ModelPatch, model: torch.nn.Module, inputs: dict[str, Any]) -> list[str]:
    blocks = find_modules(model, patch.sequential_targets, patch.ignore)
    called: list[str] = []
    handles = [m.register_forward_pre_hook(lambda mod, args, n=n: called.append(n)) for n, m in blocks.items()]
    try:
        with torch.no_grad(), patch.calibrating(model):
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return sorted(set(called))


def _check_trace(patch: ModelPatch, model: torch.nn.Module, modality: str, inputs: dict[str, Any]) -> None:
    from layerwise.tracing import trace

    step = f"trace ({modality})"
    called = _called_targets(patch, model, inputs)
    try:
        result = trace(model, inputs, patch.sequential_targets, patch.ignore, opaque_functions=patch.opaque_functions,
                       leaf_modules=patch.leaf_modules, skip_uncalled_targets=True, patch=patch)
    except Exception as error:
        raise _fail(patch, step, f"tracing failed: {type(error).__name__}: {error}",
                    "a function that reads tensor values belongs in opaque_functions, a module the tracer "
                    "cannot enter in leaf_modules; `layerwise trace --model <folder>` shows where "
                    "(GUIDE.md section 4)") from error
    if sorted(result.target_names) != called or len(result.subgraphs) != len(called) + 1:
        lost = sorted(set(called) - set(result.target_names))
        raise _fail(patch, step, f"{len(result.subgraphs)} subgraphs for {len(called)} called targets; not a call "
                    f"of their own: {lost[:3]}", "a statement wrapped around a target swallows it: make the wrapped "
                    "code a leaf module or an opaque function (GUIDE.md section 4)")
    difference = result.verify(inputs)
    if not difference <= REPLAY_TOLERANCE:
        raise _fail(patch, step, f"the replay differs from the plain forward by {difference:.3g} (relative)",
                    "some function the tracer recorded as fixed must run for real at replay: add it to "
                    "opaque_functions, or keep its module whole with leaf_modules (GUIDE.md section 4.3)")


def _check_calibration(patch: ModelPatch, model: torch.nn.Module, modality: str, inputs: dict[str, Any], *,
                       gptq: bool) -> torch.nn.Module:
    """Compress a copy (GPTQ through ``sequential``, RTN data-free); any fallback (pipeline or algorithm)
    is a failure, and so is an ignored Linear that got quantized."""
    import layerwise
    from layerwise.algorithms.quantization.storage import quantized_modules
    from layerwise.common.user_warnings import AlgorithmFallbackWarning
    from layerwise.host.pipeline_selection import PipelineFallbackWarning
    from layerwise.host.plugin_manager import registry

    work = copy.deepcopy(model)
    step = f"GPTQ ({modality})" if gptq else "RTN"
    modifiers = registry("modifiers")
    modifier = (modifiers.get("GPTQModifier")(scheme="W4A16", strategy="channel", block_size=16) if gptq
                else modifiers.get("QuantizationModifier")(scheme="W4A16", strategy="channel"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            layerwise.compress(work, modifier, dataset=[inputs] if gptq else None, show_progress=False, options=layerwise.CompressOptions.of(pipeline="sequential" if gptq else None, patch=patch))
        except Exception as error:
            raise _fail(patch, step, f"compress failed: {type(error).__name__}: {error}") from error
    report = work.layerwise_report
    if report.pipeline != ("sequential" if gptq else "datafree") or report.fallbacks:
        raise _fail(patch, step, f"calibrated by {report.pipeline!r} after fallbacks: {report.fallbacks}",
                    "every target must trace into its own piece (see the trace step)")
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, (PipelineFallbackWarning, AlgorithmFallbackWarning))]
    if fallbacks:
        raise _fail(patch, step, f"a fallback warning: {fallbacks[0]}",
                    "every targeted Linear must receive calibration data (a calibration_context for "
                    "routed experts, sample inputs that reach every tower)")
    ignored = set(find_modules(model, ["Linear"])) - set(find_modules(model, ["Linear"], patch.ignore))
    quantized = set(quantized_modules(work))
    if not quantized or quantized & ignored:
        raise _fail(patch, step, f"quantized though ignored: {sorted(quantized & ignored)[:3]}" if quantized else
                    "no Linear layer was quantized", "the compressor must honour the patch's ignore list")
    return work


def _check_reload(patch: ModelPatch, work: torch.nn.Module, inputs: dict[str, Any]) -> None:
    import layerwise
    from layerwise.host.plugin_manager import registry

    save_compressed = registry("savers").get("compressed-tensors")

    with tempfile.TemporaryDirectory(prefix="layerwise-check-") as folder:
        try:
            with without_progress_bars():
                save_compressed(work, f"{folder}/out")
                reloaded = layerwise.load_compressed(f"{folder}/out", model_class=type(work)).eval()
        except Exception as error:
            raise _fail(patch, "reload", f"{type(error).__name__}: {str(error).splitlines()[0]}") from error
        with torch.no_grad():
            expected, got = _first_tensor(work(**inputs)), _first_tensor(reloaded(**inputs))
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        raise _fail(patch, "reload", f"the reloaded model's outputs differ by "
                    f"{(got - expected).abs().max().item():.3g} from layerwise's")


def _first_tensor(output: Any) -> torch.Tensor:
    for value in (output.values() if hasattr(output, "values") else output):
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError("the model returned no tensor")
