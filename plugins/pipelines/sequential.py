"""``sequential``: the traced subgraphs, one after another, with cached intermediates.

Where the model is cut (``PipelineOptions.pieces``):

* **layers** (the default where exact): the model is traced with the layers the modifiers
  read (:meth:`Modifier.calibration_inputs`: GPTQ's Linears) as targets, cut *before* each
  group of layers that read one value (q/k/v, gate/up). A piece's entry layers read the
  previous piece's outputs, so their statistics come straight from the cache: their
  forward pre-hooks are called with the cached inputs, the forward itself is skipped; they
  are compressed; then the piece runs once, with compressed weights, producing the next
  piece's inputs. Every piece runs once per batch and every layer sees the inputs of the
  model compressed so far ("true sequential").
* **blocks**: one subgraph per sequential target (decoder layer) plus the rest. Every
  batch flows through subgraph 1 with the modifiers' hooks on, its modules are
  compressed, the subgraph re-runs with the compressed weights (``propagate_error``) to
  produce the next subgraph's inputs, and so on. Used when a modifier needs whole
  forwards, with ``propagate_error=False``, when asked, or when the model does not trace
  inside its blocks (the reason is in ``state.pieces`` and the run report).

The choice of cut is :mod:`.pieces`. Before any modifier sees data, every batch is checked against the trace's guards; a batch
that breaks one gets a trace of its own (:mod:`layerwise.tracing.retrace`), cut at the same
targets, so each piece runs every batch through the subgraph of that batch's trace. Values
are freed after their last consumer. A batch whose outputs of a piece hold NaN or inf is
dropped from the later pieces, with a warning naming it
(:func:`layerwise.runtime.finite.drop_if_non_finite`).

Tracing happens before any modifier sees data: a model that cannot be traced fails
with :class:`~layerwise.host.pipeline.PipelineFailed` and nothing was changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from layerwise.plugin import Lifecycle
from layerwise.plugin.calibration import Accounting, drop_if_non_finite
from layerwise.plugin.pipelines import (
    IntermediatesCache,
    ModuleOffloader,
    Pipeline,
    PipelineFailed,
    PipelineOptions,
    inputs_held_unchanged,
    keep_temporaries_in_heap,
    plan_placement,
)

from ._common import (
    FATAL_ERRORS,
    calibration_hooks_paused,
    calibration_mode,
    execution_device,
    progress,
)
from .pieces import choose_pieces, resident
from .token_batches import TokenBatcher, token_wise_pieces


@dataclass
class Piece:
    """Piece ``index`` of the model: the same targets in every trace, one subgraph per trace."""

    index: int
    subgraphs: list[Any]
    assignment: list[int]

    @property
    def target_names(self) -> list[str]:
        return self.subgraphs[0].target_names

    @property
    def modules(self) -> list[str]:
        return list(dict.fromkeys(m for sub in self.subgraphs for m in sub.modules))

    @property
    def onload_names(self) -> list[str]:
        """Its modules plus the parameters and buffers it reads of containers run elsewhere (see the tracer's
        ``Subgraph.onload_names``): what the execution device must hold while it runs."""
        return list(dict.fromkeys(m for sub in self.subgraphs for m in sub.onload_names))

    @property
    def input_names(self) -> list[str]:
        return list(dict.fromkeys(n for sub in self.subgraphs for n in sub.input_names))

    def subgraph(self, batch: int) -> Any:
        """The subgraph of the trace that serves ``batch``."""
        return self.subgraphs[self.assignment[batch]]

    def run(self, batch: int, cache: IntermediatesCache) -> dict[str, Any]:
        """This piece's outputs for one batch, through the subgraph of that batch's trace."""
        sub = self.subgraph(batch)
        return sub.run(cache.fetch(batch, sub.input_names))

    def free(self, cache: IntermediatesCache, num_batches: int) -> None:
        """Drop the values each batch's own trace reads for the last time here (names differ per trace)."""
        if len(self.subgraphs) == 1:
            cache.free(self.subgraphs[0].consumed_names)
            return
        for batch in range(num_batches):
            cache.free(self.subgraph(batch).consumed_names, batch=batch)


class SequentialPipeline(Pipeline):
    name = "sequential"
    streams_weights = True

    def run(self, model: torch.nn.Module, batches: Sequence[dict[str, Any]], lifecycle: Lifecycle,
            options: PipelineOptions) -> None:
        if not batches:
            raise PipelineFailed("sequential needs at least one calibration batch")
        device = execution_device(model, lifecycle, options)
        accounting = getattr(lifecycle.state, "accounting", None)
        accounting = accounting if accounting is not None else Accounting()
        whole = ModuleOffloader(model, device)
        weights, working_set = whole.nbytes([""]), _working_set(model, batches)
        # the weights move once when they fit (then the layer cut is checked against the model itself)
        placement = plan_placement(device, weights, weights, working_set, can_move=options.stream is None)
        moved = whole.onloaded([""]) if placement.weights_moved else contextlib.nullcontext()
        with calibration_mode(model, lifecycle), _entered_timed(accounting, "weights to the device", moved):
            with accounting.timed("tracing and the cut's check"):
                traces, assignment, at_layers = choose_pieces(model, batches, options, lifecycle, device)
            pieces = [Piece(k, [t.subgraphs[k] for t in traces.traces], assignment)
                      for k in range(len(traces.traces[0].subgraphs))]
            offloader = ModuleOffloader(model, device, protected=[t for p in pieces for t in p.target_names],
                                        source=options.stream, keep_loaded=True)
            if not placement.weights_moved:  # the cache's budget leaves room for the largest piece's weights
                largest = max(offloader.nbytes(p.onload_names) for p in pieces)
                placement = plan_placement(device, weights, largest, working_set, can_move=False) \
                    if options.stream is not None else plan_placement(device, weights, largest, working_set)
            if hasattr(lifecycle.state, "placement"):
                lifecycle.state.placement = placement.reason
            def new_cache() -> IntermediatesCache:
                return IntermediatesCache(options.offload, execution_device=device, offload_dir=options.offload_dir,
                                          device_budget=0 if options.offload == "disk" else placement.cache_budget)

            cache = new_cache()
            # a second stream through the uncompressed weights, for modifiers that compare with it (GPTAQ)
            reference = new_cache() if _reads_reference(lifecycle) else None
            if reference is not None and at_layers:
                raise PipelineFailed("a modifier reading the uncompressed model's inputs needs the blocks cut")
            run = _Runner(pieces, offloader, cache, lifecycle, options, len(batches), accounting,
                          batcher=TokenBatcher(_token_wise(model, traces, assignment, batches, options, device)
                                               if at_layers else set()), reference=reference)
            try:
                wanted = set().union(*(p.input_names for p in pieces))
                for index, batch in enumerate(batches):
                    for stream in (cache, reference) if reference is not None else (cache,):
                        stream.update(index, {k: v for k, v in batch.items() if k in wanted})
                with lifecycle.calibrating():
                    run.resume()
                    run.layers() if at_layers else run.blocks()
                    run.leftovers()
            finally:
                if hasattr(lifecycle.state, "cache_peak"):
                    lifecycle.state.cache_peak = cache.peak_bytes + (reference.peak_bytes if reference else 0)
                cache.close()
                if reference is not None:
                    reference.close()


@contextlib.contextmanager
def _entered_timed(accounting: Accounting, phase: str, manager: Any) -> Iterator[None]:
    """``with manager:`` whose entering alone (moving the weights) is timed into ``phase``."""
    with contextlib.ExitStack() as stack:
        with accounting.timed(phase):
            stack.enter_context(manager)
        yield


def _reads_reference(lifecycle: Lifecycle) -> bool:
    return any(getattr(m, "needs_reference_inputs", False) for m in lifecycle.modifiers)


@dataclass
class _Runner:
    """One calibration run over the pieces: at layers (one forward each) or at blocks (two)."""

    pieces: list[Piece]
    offloader: ModuleOffloader
    cache: IntermediatesCache
    lifecycle: Lifecycle
    options: PipelineOptions
    num_batches: int
    accounting: Accounting
    compressed: bool = False  # has any modifier changed a weight yet? (then no other pipeline may take over)
    #: joins short samples in the forwards of pieces found token-wise (none: every sample alone)
    batcher: TokenBatcher = field(default_factory=TokenBatcher)
    #: the inputs of each piece in the uncompressed model (modifiers with ``needs_reference_inputs``), or None
    reference: IntermediatesCache | None = None

    def __post_init__(self) -> None:
        self.dropped: set[int] = set()  # batches whose activations became non-finite
        self.finished = _finished_after(self.pieces)
        self.start = 0  # the first piece to run (a resumed run starts after its checkpoint)

    def resume(self) -> None:
        """An interrupted run's checkpoint, when there is one, puts back everything up to its last piece."""
        checkpoint = self.options.checkpoint
        if checkpoint is not None:
            self.start, self.dropped = checkpoint.restore(self.options.stream, self.cache, self.lifecycle,
                                                          self.reference)
            self.compressed = self.compressed or self.start > 0

    def _checkpoint(self, position: int) -> None:
        """Piece ``position`` is done (written, its inputs freed): save the run for a resume (with the
        uncompressed model's stream too, when a modifier reads it)."""
        if self.options.checkpoint is not None:
            self.options.checkpoint.save(position, len(self.pieces), self.options.stream, self.cache,
                                         self.num_batches, self.dropped, self.lifecycle, reference=self.reference)

    def leftovers(self) -> None:
        """Weights streamed from disk: modules no piece ran are compressed one by one (as
        ``calibration_end`` would, with no data) and written, so nothing computes on unloaded weights."""
        if self.options.stream is None:
            return
        for name in self.options.stream.leftovers():
            with self.offloader.onloaded([name]):
                self.lifecycle.sequential_epoch_end([name])
                self.offloader.retire([name])

    def layers(self) -> None:
        """Each piece: gather its entry layers' inputs from the cache, compress, run once with the result.

        The entry layers' statistics need no forward (their inputs are the previous piece's outputs),
        and every later layer sees the inputs of the model compressed so far ("true sequential").
        The last piece's outputs feed nothing, so it never runs.
        """
        last = len(self.pieces) - 1
        for position, piece in enumerate(progress(self.pieces, "calibrating pieces", self.options.show_progress)):
            if position < self.start:
                continue
            with self.offloader.onloaded(piece.onload_names):
                entries = self._observe_entries(piece)
                self.lifecycle.sequential_epoch_end(list(piece.modules))
                self.compressed = self.compressed or entries
                if position < last:
                    with calibration_hooks_paused(self.lifecycle):
                        self._forward(piece, keep=True)
                self.offloader.retire(self.finished[position])
            piece.free(self.cache, self.num_batches)
            self._checkpoint(position)

    def blocks(self) -> None:
        """Each piece: run it observed, compress its modules, run it again compressed to feed the next.

        Whole blocks run twice per batch, so their temporaries stay in the C heap between calls
        (:func:`~layerwise.runtime.heap.keep_temporaries_in_heap`: a Wanda run on tiny-llama-doc 15 % faster).
        The layer cut leaves glibc's defaults: there it gained nothing and its peak varied more.
        """
        keep_temporaries_in_heap()
        last = len(self.pieces) - 1
        tail = list(self.pieces[last].modules)
        tail_inputs = self.lifecycle.calibration_inputs(tail)
        tail_runs = tail_inputs is None or bool(tail_inputs)
        propagate = self.options.propagate_error
        for position, piece in enumerate(progress(self.pieces, "calibrating subgraphs", self.options.show_progress)):
            # the tail's outputs are never used: it runs only when a modifier reads data in it (an LLM's
            # lm_head, usually ignored, costs more than a decoder layer), and so does what feeds it
            if position < self.start:
                continue
            feeds_next = position + 1 < last or (position + 1 == last and tail_runs)
            keep = feeds_next and not propagate
            with self.offloader.onloaded(piece.onload_names):
                if (position < last or tail_runs) and self.reference is not None:
                    self._forward_beside_reference(piece, keep=keep, feeds_next=feeds_next)
                elif position < last or tail_runs:
                    self._forward(piece, keep=keep, observed=True)
                self.lifecycle.sequential_epoch_end(list(piece.modules))
                self.compressed = True
                if feeds_next and propagate:  # re-run with the compressed weights
                    with calibration_hooks_paused(self.lifecycle):
                        self._forward(piece, keep=True)
                self.offloader.retire(self.finished[position])
            piece.free(self.cache, self.num_batches)
            if self.reference is not None:
                piece.free(self.reference, self.num_batches)
            self._checkpoint(position)

    def _forward_beside_reference(self, piece: Piece, keep: bool, feeds_next: bool) -> None:
        """Each batch through the uncompressed model's stream first (only the modifiers' reference hooks
        on; its outputs feed the stream's next piece), then observed, as :meth:`_forward` runs it."""
        readers = [m for m in self.lifecycle.modifiers if getattr(m, "needs_reference_inputs", False)]
        names = list(piece.modules)
        with self._early_stop(piece, wanted=not keep) as stop, self.accounting.timed("forward"):
            for i in self._live():
                handles = [handle for m in readers for handle in m.reference_hooks(names)]
                try:
                    with calibration_hooks_paused(self.lifecycle):
                        original = self._run(piece, piece.run, i, self.reference)
                finally:
                    for handle in handles:
                        handle.remove()
                if feeds_next:
                    self.reference.update(i, original)
                del original
                self.reference.free(piece.subgraph(i).consumed_names, batch=i)
                outputs = self._observed_run(piece, i, stop)
                if keep:
                    self._keep(piece, i, outputs)

    def _forward(self, piece: Piece, keep: bool, observed: bool = False) -> None:
        """Run every live batch through ``piece``; cache the outputs when ``keep``.

        An observed forward whose outputs are not kept may end once every input the
        modifiers read was seen (:class:`_EarlyStop`). A forward that feeds the next piece
        and is not observed runs short samples joined along the token axis where the piece
        was found token-wise (:mod:`.token_batches`).
        """
        live = self._live()
        with self._early_stop(piece, wanted=observed and not keep) as stop, self.accounting.timed("forward"):
            if keep and not observed:
                self._forward_grouped(piece, live)
                return
            for i in live:
                outputs = self._observed_run(piece, i, stop)
                if keep:
                    self._keep(piece, i, outputs)

    @contextlib.contextmanager
    def _early_stop(self, piece: Piece, wanted: bool) -> Iterator[_EarlyStop | None]:
        """The piece's :class:`_EarlyStop` where ``wanted`` (an observed run whose outputs are not kept; ``None``
        where no modifier lets it stop), its hooks removed after the run."""
        stop = _EarlyStop.for_piece(self.offloader.model, piece, self.lifecycle) if wanted else None
        try:
            yield stop
        finally:
            if stop is not None:
                stop.close()

    def _observed_run(self, piece: Piece, batch: int, stop: _EarlyStop | None) -> dict[str, Any] | None:
        """One batch through ``piece``; ``None`` where ``stop`` ended it (its outputs are not wanted then)."""
        try:
            with stop.batch() if stop is not None else contextlib.nullcontext():
                return self._run(piece, piece.run, batch, self.cache)
        except _StopPiece:
            return None

    def _forward_grouped(self, piece: Piece, batches: list[int]) -> None:
        """Every batch through ``piece`` and into the cache, in the batcher's groups (most are of one)."""
        def fetch(i: int) -> dict[str, Any]:
            return self.cache.fetch(i, piece.subgraph(i).input_names)

        for group, values in self.batcher.groups(batches, piece.subgraph, fetch):
            sub = piece.subgraph(group[0])
            for i, outputs in zip(group, self._run(piece, self.batcher.run, sub, values)):
                self._keep(piece, i, outputs)

    def _live(self) -> list[int]:
        """The batches not dropped (their activations stayed finite), in order."""
        return [i for i in range(self.num_batches) if i not in self.dropped]

    def _run(self, piece: Piece, call: Any, *args: Any) -> Any:
        """``call(*args)``, a run of ``piece``; a failure before anything was compressed lets another pipeline
        take over."""
        try:
            return call(*args)
        except (_StopPiece, *FATAL_ERRORS):
            raise
        except Exception as exc:
            if self.compressed:
                raise
            # nothing compressed yet: another pipeline can still take over
            raise PipelineFailed(f"{_where(piece)} failed to run: {type(exc).__name__}: {exc}") from exc

    def _keep(self, piece: Piece, batch: int, outputs: dict[str, Any]) -> None:
        """Cache a batch's outputs (unless non-finite: the batch is dropped), then free its inputs that end
        here (its last run of this piece)."""
        if not drop_if_non_finite(batch, outputs, _where(piece), self.dropped, self.num_batches):
            self.cache.update(batch, outputs)
        self.cache.free(piece.subgraph(batch).consumed_names, batch=batch)

    def _observe_entries(self, piece: Piece) -> bool:
        """Show each entry layer its cached inputs: its pre-hooks (the modifiers') run, its forward does not.

        Returns whether the piece has entry layers.
        """
        model = self.offloader.model
        modules = {e.module: model.get_submodule(e.module) for sub in piece.subgraphs for e in sub.entries}
        if not modules:
            return False
        # registered after the modifiers' hooks, so it runs last and ends the call before the forward
        stops = [m.register_forward_pre_hook(_stop_before_forward) for m in modules.values()]
        try:
            with inputs_held_unchanged():  # cached values, left alone until this piece's modules are compressed
                self._show_entries(piece, modules)
        finally:
            for handle in stops:
                handle.remove()
        return True

    def _show_entries(self, piece: Piece, modules: dict[str, torch.nn.Module]) -> None:
        """Call each entry layer with each live batch's cached inputs (the stop hook ends every call)."""
        for i in self._live():
            sub = piece.subgraph(i)
            values = self.cache.fetch(i, [n for e in sub.entries for n in e.input_names])
            for entry in sub.entries:
                args, kwargs = entry.bind(values)
                try:
                    modules[entry.module](*args, **kwargs)
                except _StopPiece:
                    pass


def _working_set(model: torch.nn.Module, batches: Sequence[dict[str, Any]]) -> int:
    """A piece's temporaries, estimated (:data:`layerwise.runtime.placement.WORKING_SET_FACTOR` times the widest
    activation of the largest batch, float32)."""
    from layerwise.plugin.pipelines import working_set_bytes

    widths = [max(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    tokens = max((v.numel() for b in batches for v in b.values()
                  if isinstance(v, torch.Tensor) and not v.is_floating_point()), default=1)
    return working_set_bytes(tokens, max(widths, default=1))


def _token_wise(model: torch.nn.Module, traces: Any, assignment: list[int], batches: Sequence[dict[str, Any]],
                options: PipelineOptions, device: torch.device) -> set[int]:
    """The pieces that may run short samples joined: checked on the first two batches, before calibration,
    when both are served by the first trace and the weights already rest on the execution device."""
    if len(batches) < 2 or assignment[0] != 0 or assignment[1] != 0 or not resident(model, device, options):
        return set()
    try:
        return token_wise_pieces(traces.traces[0].subgraphs, batches[0], batches[1], device)
    except FATAL_ERRORS:
        raise
    except Exception:  # noqa: BLE001 - a piece that cannot run joined (or at all, here) is simply not joined
        return set()


def _finished_after(pieces: list[Piece]) -> list[list[str]]:
    """Per piece, its modules that no later piece runs (a module, or one inside or around it)."""
    def overlaps(a: str, b: str) -> bool:
        return a == b or a.startswith(b + ".") or b.startswith(a + ".") or not a or not b

    finished = []
    for position, piece in enumerate(pieces):
        later = [m for p in pieces[position + 1:] for m in p.modules]
        finished.append([m for m in piece.modules if not any(overlaps(m, other) for other in later)])
    return finished


def _stop_before_forward(module: torch.nn.Module, args: tuple) -> None:
    """Ends an entry layer's call once its pre-hooks saw the input (the forward itself is not needed)."""
    raise _StopPiece


def _where(sub: Piece) -> str:
    return f"subgraph {sub.index} ({', '.join(sub.target_names) or 'head'})"


class _StopPiece(BaseException):
    """Ends a forward whose outputs are not used (raised by :class:`_EarlyStop` and when observing entries).

    A BaseException, so that model code catching ``Exception`` cannot swallow it.
    """


class _EarlyStop:
    """Ends a piece's calibration forward once every input the modifiers read has been seen.

    When the outputs of the calibration forward are thrown away (the piece re-runs with
    compressed weights to feed the next one), computing past the last module whose input
    a modifier reads is wasted -- e.g. a decoder layer's ``down_proj`` and residual add.
    The first batch runs in full and records the order the needed modules run in; if
    each ran exactly once, later batches stop at the pre-hook of the last of them --
    after the modifiers' own hooks on it ran -- provided every needed module ran in
    that batch too. Otherwise (a module called twice, one not called) nothing stops.
    """

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        self.needed = set(modules)
        self.calls: dict[str, int] = {}
        self.last: str | None = None
        self.learning = True
        #: inside :meth:`batch` only: other runs of the piece meanwhile (the reference stream's) neither count nor stop
        self.active = False
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in modules.items()]

    @classmethod
    def for_piece(cls, model: torch.nn.Module, sub: Any, lifecycle: Lifecycle) -> _EarlyStop | None:
        names = lifecycle.calibration_inputs(list(sub.modules))
        if not names:  # None: a modifier needs the whole forward; empty: nobody reads anything
            return None
        try:
            return cls({n: model.get_submodule(n) for n in sorted(names)})
        except AttributeError:
            return None

    def _hook(self, name: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            if not self.active:
                return
            self.calls[name] = self.calls.get(name, 0) + 1
            if (name == self.last and len(self.calls) == len(self.needed)
                    and all(count == 1 for count in self.calls.values())):
                raise _StopPiece
        return hook

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        self.calls, self.active = {}, True
        try:
            yield
        finally:
            self.active = False
        if self.learning:  # the first complete forward decides where later ones may stop
            self.learning = False
            if set(self.calls) == self.needed and all(c == 1 for c in self.calls.values()):
                self.last = list(self.calls)[-1]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
