"""Data-parallel calibration on ``torch.distributed``: shard the data, reduce the statistics, spread the solves.

The rules every rank keeps (``torchrun --nproc-per-node N -m layerwise compress ...``, or
``compress()`` inside a process group the caller initialised):

* **Data.** Each rank calibrates on its share of the batches, ``batches[rank::world]``
  (:func:`shard`); there must be at least one batch per rank.
* **Statistics.** Before a piece is compressed (right before ``sequential_epoch_end``, and before
  ``calibration_end``) the :class:`~layerwise.host.lifecycle.Lifecycle` fires
  :meth:`Modifier.on_reduce <layerwise.host.modifier.Modifier.on_reduce>` with a :class:`Reducer`:
  each modifier sums, maxes or mins its statistics over the ranks in place, so that every rank
  then holds what one process calibrating on all the batches would.
* **Solves.** :func:`spread` gives layer ``i`` of a piece to rank ``i % world``; the results are
  broadcast and applied on every rank, so every rank ends with identical compressed modules.
* **Output.** Only rank 0 claims and writes the output folder; every rank returns once it exists.
* **Failure.** A rank that raises tells the others at their next meeting point (:func:`check`:
  each reduce, each spread, the end of the run); they stop with a :class:`RankFailedError` naming
  it, and nothing is saved. A rank that dies outright closes its connections, and the others'
  next collective raises. The process group's timeout is the last resort.

With one process (no process group, or a group of one) every function here is a no-op, and
:meth:`~layerwise.host.modifier.Modifier.on_reduce` is never fired.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from layerwise.errors import DatasetError, LayerwiseError

T = TypeVar("T")

#: set on an exception once the other ranks were told about it (it is not announced twice)
_ANNOUNCED = "_layerwise_announced"


class RankFailedError(LayerwiseError):
    """Another rank of a distributed run failed; this rank stopped with it (the message says which and why)."""

    def __init__(self, failed: int, world: int, message: str) -> None:
        self.failed_rank, self.world_size = failed, world
        super().__init__(f"rank {failed} of {world} failed: {message}; rank {rank()} stopped with it, "
                         f"nothing was saved")


# -- the process group ---------------------------------------------------------------------------
def _dist() -> Any:
    return torch.distributed if torch.distributed.is_available() else None


def world_size() -> int:
    """Ranks in the default process group; 1 without one."""
    dist = _dist()
    return dist.get_world_size() if dist is not None and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default process group; 0 without one."""
    dist = _dist()
    return dist.get_rank() if dist is not None and dist.is_initialized() else 0


def is_main() -> bool:
    """Is this the rank that writes (rank 0, or the only process)?"""
    return rank() == 0


def collective_device() -> torch.device:
    """Where the backend's collectives want their tensors: the current GPU for NCCL, else the CPU."""
    dist = _dist()
    if dist is not None and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_from_env(timeout_minutes: float | None = None) -> bool:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1); whether this call created it.

    Backend ``nccl`` when CUDA is available (each rank on ``cuda:LOCAL_RANK``), else ``gloo``.
    Nothing happens with one process, or when a process group exists already.
    ``LAYERWISE_DIST_TIMEOUT`` (minutes) bounds how long a rank waits for the others.
    """
    dist = _dist()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist is None or dist.is_initialized():
        return False
    if timeout_minutes is None:
        timeout_minutes = float(os.environ.get("LAYERWISE_DIST_TIMEOUT", "30"))
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return True


def shutdown() -> None:
    """Leave the process group (what :func:`init_from_env` created)."""
    dist = _dist()
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()


# -- data ------------------------------------------------------------------------------------------
def shard(batches: Sequence[T]) -> list[T]:
    """This rank's share of the calibration batches: ``batches[rank::world]`` (all of them alone)."""
    world = world_size()
    if world == 1:
        return list(batches)
    if len(batches) < world:
        raise DatasetError(f"{len(batches)} calibration sample(s) for {world} ranks: every rank needs at least "
                           f"one; pass more samples (--num-samples) or start fewer processes")
    return list(batches[rank()::world])


# -- statistics ------------------------------------------------------------------------------------
class Reducer:
    """Merges a modifier's statistics over the ranks; handed to ``Modifier.on_reduce``.

    :meth:`sum`, :meth:`max` and :meth:`min` reduce a tensor in place (any device: it travels
    to the backend's and back) and return it; :meth:`count` sums a number; :meth:`gather` gives
    every rank's (picklable) object, in rank order. ``samples`` is this rank's calibration
    batches, ``total_samples`` every rank's. Every rank must make the same calls in the same
    order, with tensors of the same shape: a rank that saw no data contributes zeros (sum),
    ``-inf`` (max) or ``inf`` (min). With one process every method returns its input.
    """

    def __init__(self, samples: int = 0) -> None:
        self.rank = rank()
        self.world_size = world_size()
        #: this rank's calibration batches, and all ranks' (known from the first reduce on)
        self.samples = samples
        self.total_samples = samples

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(tensor, "SUM")

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(tensor, "MAX")

    def min(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(tensor, "MIN")

    def count(self, value: float) -> float:
        """``value`` summed over the ranks (an int stays an int)."""
        if self.world_size == 1:
            return value
        integral = isinstance(value, int)
        box = torch.tensor([value], dtype=torch.int64 if integral else torch.float64)
        self.sum(box)
        return int(box.item()) if integral else float(box.item())

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (tensors are sent as CPU copies), in rank order."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        _dist().all_gather_object(out, to_cpu(obj))
        return out

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        dist = _dist()
        device = collective_device()
        if tensor.device == device and tensor.is_contiguous():
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
            return tensor
        work = tensor.to(device).contiguous()
        dist.all_reduce(work, op=getattr(dist.ReduceOp, op))
        tensor.copy_(work)
        return tensor


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor inside (lists, tuples, dicts, dataclasses) copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if type(obj) in (list, tuple):
        return type(obj)(to_cpu(v) for v in obj)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: to_cpu(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


# -- failures --------------------------------------------------------------------------------------
def check(error: BaseException | None = None) -> None:
    """Meet the other ranks and learn whether one failed: every rank calls it at the same points.

    A rank that failed calls it with its exception (and re-raises it afterwards); the others
    raise :class:`RankFailedError` naming the failed rank and its error (the highest rank's,
    when several failed at once). No-op with one process.
    """
    world = world_size()
    if world == 1:
        return
    dist = _dist()
    me = rank()
    flag = torch.tensor([me + 1 if error is not None else 0], dtype=torch.int64, device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    failed = int(flag.item()) - 1
    if failed < 0:
        return
    box = [f"{type(error).__name__}: {error}" if me == failed else None]
    dist.broadcast_object_list(box, src=failed)
    if error is not None:
        _mark_announced(error)
        return
    raise RankFailedError(failed, world, str(box[0]))


def _mark_announced(error: BaseException) -> None:
    try:
        setattr(error, _ANNOUNCED, True)
    except AttributeError:  # an exception type without a __dict__: announced twice at worst
        pass


def guarded(fn: Callable[..., T]) -> Callable[..., T]:
    """Wrap a whole run (``compress``): an exception is announced to the other ranks (:func:`check`) before
    it propagates, and a successful return waits for every rank (rank 0 has saved by then)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        if world_size() == 1:
            return fn(*args, **kwargs)
        try:
            result = fn(*args, **kwargs)
        except KeyboardInterrupt:  # torchrun stops every rank; meeting them could block the exit
            raise
        except BaseException as exc:
            if not isinstance(exc, RankFailedError) and not getattr(exc, _ANNOUNCED, False):
                with contextlib.suppress(Exception):  # the peers are gone (connection closed): keep our error
                    check(exc)
            raise
        check()  # every rank returns once rank 0 has written the output
        return result
    return run


# -- solves ----------------------------------------------------------------------------------------
def spread(names: Sequence[str], solve: Callable[[str], T],
           skip: Callable[[str], Any] | None = None) -> Iterator[tuple[str, T]]:
    """``(name, solve(name))`` for each name in order, each solved on one rank only.

    With one process this is ``solve`` called lazily in order. With ``world`` ranks, layer ``i``
    is solved by rank ``i % world`` (the others call ``skip(name)``, e.g. to drop the layer's
    statistics), every rank meets the others (:func:`check`: a solve that raised on one rank
    raises there and a :class:`RankFailedError` on the others), and each result is broadcast from
    its rank: every rank gets every result, as CPU tensors, in order, to apply to its own model.
    ``names`` must be the same list on every rank and results picklable (tensors, dataclasses...).
    """
    world = world_size()
    if world == 1 or not names:
        for name in names:
            yield name, solve(name)
        return
    me = rank()
    mine: dict[str, Any] = {}
    error: BaseException | None = None
    for index, name in enumerate(names):
        try:
            if index % world == me:
                mine[name] = to_cpu(solve(name))
            elif skip is not None:
                skip(name)
        except Exception as exc:  # noqa: BLE001 - told to every rank below, then raised
            error = exc
            break
    check(error)
    if error is not None:
        raise error
    dist = _dist()
    device = collective_device() if dist.get_backend() == "nccl" else None
    for index, name in enumerate(names):
        box = [mine.pop(name, None)]
        dist.broadcast_object_list(box, src=index % world, device=device)
        yield name, box[0]
