"""``check_model_patch``: what a model patch promises, checked on a model it is for.

1. **ignore**: every ignore entry matches a module (a typo would compress what was meant to stay);
2. **targets**: the sequential targets select modules, and none holds another (the inner one
   would be swallowed into its parent's piece);
3. **trace**, per modality the patch builds sample inputs for: one subgraph per target the
   forward calls, plus one, each target its own call; the replay equals the plain forward
   (<= 1e-5 relative), else a function needs ``opaque_functions`` or a module ``leaf_modules``;
4. **GPTQ**: GPTQ W4A16 (per channel) calibrates through ``sequential`` with no fallback;
5. **save and reload**: the compressed model saves, reloads with transformers, and reproduces
   layerwise's outputs.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from layerwise.matching import find_modules, unmatched
from layerwise.model_patch import ModelPatch, apply_patch

from .errors import PluginCheckError

CHECK = "check_model_patch"
MODALITIES = ("text", "image", "audio")
#: the largest relative difference between replay and plain forward that counts as equal
REPLAY_TOLERANCE = 1e-5


def check_model_patch(patch: ModelPatch, model: torch.nn.Module, modalities: Sequence[str] | None = None, *,
                      calibrate: bool = True) -> None:
    """Run every check of ``patch`` on ``model`` (random weights are fine); raises :class:`PluginCheckError`.

    ``modalities``: those to trace (default: every one ``patch.sample_inputs`` builds inputs for);
    the richest one (last) is calibrated with GPTQ and saved, unless ``calibrate=False``.
    """
    apply_patch(model, patch)
    _check_ignore(patch, model)
    _check_targets(patch, model)
    built = _sample_inputs(patch, model, modalities)
    for modality, inputs in built.items():
        _check_trace(patch, model, modality, inputs)
    if calibrate:
        modality, inputs = list(built.items())[-1]
        _check_gptq_and_reload(patch, model, modality, inputs)


def _fail(patch: ModelPatch, step: str, problem: str, fix: str = "") -> PluginCheckError:
    return PluginCheckError(CHECK, patch.name, step, problem, fix)


def _check_ignore(patch: ModelPatch, model: torch.nn.Module) -> None:
    missing = unmatched(model, patch.ignore)
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
        raise _fail(patch, step, f"tracing failed: {type(error).__name__}: {str(error).splitlines()[0]}",
                    "`layerwise trace --model <folder>` shows where; GUIDE.md section 4") from error
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


def _check_gptq_and_reload(patch: ModelPatch, model: torch.nn.Module, modality: str, inputs: dict[str, Any]) -> None:
    import layerwise
    from layerwise.plugins.modifiers.gptq import GPTQModifier
    from layerwise.plugins.savers.compressed_tensors import save_compressed

    work = copy.deepcopy(model)
    step = f"GPTQ ({modality})"
    try:
        layerwise.compress(work, GPTQModifier(scheme="W4A16", strategy="channel", block_size=16), dataset=[inputs],
                           pipeline="sequential", patch=patch, show_progress=False)
    except Exception as error:
        raise _fail(patch, step, f"compress failed: {type(error).__name__}: {str(error).splitlines()[0]}") from error
    report = work.layerwise_report
    if report.pipeline != "sequential" or report.fallbacks:
        raise _fail(patch, step, f"calibrated by {report.pipeline!r} after fallbacks: {report.fallbacks}",
                    "every target must trace into its own piece (see the trace step)")
    with tempfile.TemporaryDirectory(prefix="layerwise-check-") as folder:
        try:
            save_compressed(work, f"{folder}/out")
            reloaded = layerwise.load_compressed(f"{folder}/out", model_class=type(model)).eval()
        except Exception as error:
            raise _fail(patch, "save and reload", f"{type(error).__name__}: {str(error).splitlines()[0]}") from error
        with torch.no_grad():
            expected, got = _first_tensor(work(**inputs)), _first_tensor(reloaded(**inputs))
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        raise _fail(patch, "save and reload", f"the reloaded model's outputs differ by "
                    f"{(got - expected).abs().max().item():.3g} from layerwise's")


def _first_tensor(output: Any) -> torch.Tensor:
    for value in (output.values() if hasattr(output, "values") else output):
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError("the model returned no tensor")
