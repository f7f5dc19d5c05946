"""Checkpoints: a training job's state in one directory, written atomically, loaded exactly.

:func:`save` and :func:`load` take a mapping of state providers (``{"model": dp,
"optimizer": opt, "sampler": sampler}``: :mod:`tensorplay_mpi.checkpoint._providers` turns it
into what is written, and back) or the arrays themselves (the array form).  A checkpoint in
directory ``DIR`` is one manifest, ``DIR/checkpoint.npz``, written by rank 0 (parameters,
buffers, the optimizer state when it is the same on every rank, the step and epoch counters,
every rank's data cursor, small extra arrays, the providers' states), plus, for a
:class:`~tensorplay_mpi.optim.ZeroRedundancyOptimizer` saved sharded, one file per rank
holding its shard's state, and, for extra arrays that are each rank's own
(:class:`~tensorplay_mpi.checkpoint.PerRank`), one file per rank holding them.  Every
file is written to a temporary name, flushed to disk (``fsync``) and renamed; the manifest is
renamed last and names the per-rank files of its own save, so a job killed at any point of a
save keeps the previous checkpoint, whole.

Both functions are collective over `comm` and run outside a Join, or (``save``) from a Join's
``on_save``, which every rank, joined or not, runs at one iteration boundary: every rank calls
them at the same point; inside a running Join anywhere else they raise ``RuntimeError``.
Their agreements are ``Iallgather`` s through :mod:`tensorplay_mpi.comm`; a
failure on one rank (a full disk, a missing file, another world size) raises on every rank.
The files use NumPy's ``.npz`` format, loaded without pickle.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
from mpi4py import MPI

from ..algorithms.join import Join
from ..comm import _torch_cuda as torch_cuda
from ..comm._agreement import agree
from ..comm._buffers import is_device_array
from ..comm._collectives import check_comm, default_comm, iallgather, resolve_timeout
from ..comm._guard import Guard
from ..comm._tensors import as_arrays, host_array
from ..optim._protocol import OptimizerState
from .._process import set_up
from ..comm._digests import array_digest
from ._meta import (check_config, check_extra, check_savable, encode_config, extra_digests,
                    groups, resumed_extra, split_extra, value_digests)
from ._providers import Contents, Plan, contents, plan

MANIFEST = "checkpoint.npz"
"""The name of the manifest in a checkpoint directory."""

FORMAT = 1  # of the manifest; a checkpoint of another format is refused


class Saved(NamedTuple):
    """What :func:`save` wrote."""

    path: str
    """The manifest."""
    nbytes: int
    """Bytes written by every rank together."""
    seconds: float
    """Wall time of the save, agreement included (the slowest rank's)."""


class Resumed(NamedTuple):
    """What :func:`load` read: the counters, this rank's cursor, every rank's."""

    step: int
    epoch: int
    cursor: int
    """What this rank had consumed of the current epoch (the unit is the caller's); 0 when
    the checkpoint was saved at another world size (``resize=True``: re-split with
    :meth:`tensorplay_mpi.data.Sampler.resume`)."""
    cursors: tuple[int, ...]
    """Every saved rank's cursor (as many as the saved world size)."""
    extra: dict[str, np.ndarray]
    path: str
    world_size: int = 0
    """The world size the checkpoint was saved at."""


def _refuse_inside_join(what: str) -> None:
    """Raise RuntimeError, before any collective, when called inside a running Join (outside
    its ``on_save``): a joined rank would match this call's collectives with its polls."""
    join = Join.current()
    if join is None:
        return
    rank = join.joinables[0].join_process_group.Get_rank()
    if what == "save":
        raise RuntimeError(
            f"rank {rank}: checkpoint.save was called inside a running Join, where a joined "
            "rank would match its collectives with the Join's polls: give the save to the Join "
            "as `Join(..., on_save=...)` and ask for it with request_save() (every rank then "
            "saves at one iteration), or save after the block")
    raise RuntimeError(
        f"rank {rank}: checkpoint.load was called inside a running Join: load before the "
        "Join's block (a resume starts with every rank outside any Join)")


def _begin(what: str, comm: MPI.Intracomm | None, timeout: float | None,
           params: Sequence[Any], buffers: Sequence[Any],
           refused: BaseException | None = None, mapping: bool = False) -> tuple:
    """What `save` and `load` (`what`) start with: refused inside a running Join, the
    communicator checked and set up, the deadline, the arrays (torch tensors: NumPy or CuPy
    views), which every rank learns it could take (a tensor one rank cannot view, or this
    rank's `refused` mapping entry, raises on every rank), and that every rank called the
    same form (the `mapping` form or the array form)."""
    _refuse_inside_join(what)
    comm = check_comm(default_comm() if comm is None else comm)
    timeout = resolve_timeout(timeout)
    set_up(comm)
    Guard.attach(comm)
    arrays: tuple[list[Any], list[Any]] = ([], [])
    error = refused
    try:
        if error is None:
            arrays = (as_arrays(list(params), "params", bits=True),  # bfloat16: its bits
                      as_arrays(list(buffers), "buffers", bits=True))
    except Exception as failed:  # a DLPack export's BufferError too, or a failing generator
        error = failed
    forms = agree_or_raise(comm, error, f"checkpoint {what} (the arrays)", timeout, int(mapping))
    if (forms != forms[0]).any():
        raise ValueError(f"checkpoint.{what} got a mapping of objects on rank(s) "
                         f"{np.flatnonzero(forms).tolist()} and arrays on the others: call it "
                         "in the same form on every rank")
    return comm, timeout, *arrays


# -- agreement -----------------------------------------------------------------------------------


def agree_or_raise(comm: MPI.Intracomm, error: BaseException | None, what: str,
                   timeout: float, *values: int) -> np.ndarray:
    """Every rank's `values` (a row per rank; the column itself for one value), once every
    rank has told whether its part of `what` failed (:func:`~tensorplay_mpi.comm._agreement.agree`:
    a rank whose part failed raises its own `error`; the others an exception of the same kind
    naming the failed ranks)."""
    every = agree(lambda row, every: iallgather(comm, row, every, what), comm.Get_rank(),
                  comm.Get_size(), what, timeout, error, list(values) or [0]).values
    return every[:, 0] if len(values) <= 1 else every


# -- files ---------------------------------------------------------------------------------------


def write_arrays(path: str, arrays: Mapping[str, np.ndarray]) -> int:
    """Write `arrays` to `path` atomically (temporary file, fsync, rename); return its size."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself reaches the disk
    finally:
        os.close(directory)
    return os.path.getsize(path)


def read_arrays(path: str) -> dict[str, np.ndarray]:
    """The arrays of the ``.npz`` file at `path`, read without pickle."""
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


_PER_RANK_FILES = ("optimizer-shard", "per-rank")  # a ZeRO shard's state; PerRank extras


def _shard_path(directory: str, rank: int, size: int, token: int,
                what: str = "optimizer-shard") -> str:
    return os.path.join(directory, f"{what}-{rank}-of-{size}.{token}.npz")


def _like(sample: Any, host: np.ndarray) -> Any:
    """`host` where `sample` lives: a CuPy copy for a device array, else `host` itself."""
    if not is_device_array(sample):
        return host
    import cupy  # loaded: `sample` is one of its arrays

    return cupy.asarray(host)


# -- optimizer state -----------------------------------------------------------------------------

def _encode(value: Any, where: str) -> Any:
    """A hyperparameter as JSON, its exact type kept (a NumPy scalar stays one)."""
    if callable(value):
        return {"callable": getattr(value, "__qualname__", type(value).__name__)}
    if isinstance(value, np.generic):
        return {"numpy": value.dtype.str, "value": value.item()}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, where) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot save hyperparameter {where} = {value!r} ({type(value).__name__}): "
                    "use numbers, tuples of numbers, or a callable of the step")


def _decode(value: Any, live: Any) -> Any:
    """The inverse of :func:`_encode`; a saved callable is replaced by the `live` value."""
    if not isinstance(value, dict):
        return value
    if "callable" in value:
        return live
    if "numpy" in value:
        return np.dtype(value["numpy"]).type(value["value"])
    return tuple(_decode(v, None) for v in value["tuple"])


def _optimizer_kind(optimizer: Any, zero: str) -> str:
    """The manifest's name for how `optimizer`'s state is saved: ``"none"``, ``"local"`` (the
    same on every rank) or, for a sharded one, ``"zero-sharded"`` / ``"zero-consolidated"``."""
    if optimizer is None:
        return "none"
    if not isinstance(optimizer, OptimizerState):
        raise TypeError(f"optimizer must be a tensorplay_mpi optimizer or None, got "
                        f"{type(optimizer).__name__}")
    if optimizer.sharded:
        if zero not in ("sharded", "consolidated"):
            raise ValueError(f"zero must be 'sharded' or 'consolidated', got {zero!r}")
        return f"zero-{zero}"
    return "local"


def _flatten(state_dict: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict]:
    """Arrays under ``prefix/i/name`` and the rest as JSON-ready metadata."""
    arrays = {f"{prefix}/{i}/{name}": host_array(a) for i, s in state_dict["state"].items()
              for name, a in s.items()}
    if "param_steps" in state_dict:  # per-parameter step counts (parameters skipped unused)
        arrays[f"{prefix}/param_steps"] = np.asarray(state_dict["param_steps"], dtype=np.int64)
    meta = {
        "optimizer": state_dict["optimizer"],
        "steps": int(state_dict["steps"]),
        "defaults": {k: _encode(v, k) for k, v in state_dict["defaults"].items()},
        "param_groups": [{k: _encode(v, k) for k, v in g.items()}
                         for g in state_dict.get("param_groups", [state_dict["defaults"]])],
        "state": {str(i): sorted(s) for i, s in state_dict["state"].items()},
    }
    return arrays, meta


def _unflatten(meta: dict, arrays: Mapping[str, np.ndarray], prefix: str,
               live: OptimizerState) -> dict[str, Any]:
    """A state dict for `live` (whose current hyperparameters replace saved callables), its
    arrays on the device of `live`'s parameters."""
    now = live.param_groups[0]
    sample = live.params[0] if live.params else None
    return {
        "optimizer": meta["optimizer"],
        "steps": meta["steps"],
        "defaults": {k: _decode(v, live.defaults.get(k)) for k, v in meta["defaults"].items()},
        "param_groups": [{k: _decode(v, now.get(k)) for k, v in g.items()}
                         for g in meta["param_groups"]],
        "state": {int(i): {name: _like(sample, arrays[f"{prefix}/{i}/{name}"])
                           for name in names}
                  for i, names in meta["state"].items()},
        **({"param_steps": arrays[f"{prefix}/param_steps"]}
           if f"{prefix}/param_steps" in arrays else {}),
    }


# -- save ----------------------------------------------------------------------------------------


def save(directory: str | os.PathLike, state: Mapping[str, Any] | Sequence[Any], *,
         buffers: Sequence[Any] = (), optimizer: OptimizerState | None = None, step: int = 0,
         epoch: int = 0, cursor: int = 0, extra: Mapping[str, Any] | None = None,
         zero: str = "sharded", comm: MPI.Intracomm | None = None,
         timeout: float | None = None, config: Mapping[str, Any] | None = None) -> Saved:
    """Write a checkpoint to `directory` (made if missing), replacing the one there atomically.

    Collective over `comm`: every rank calls it, outside a Join or from a Join's ``on_save``
    (a periodic save, see :func:`~tensorplay_mpi.request_save`), with the same arguments.

    Two forms.  The mapping form, ``save(directory, {"model": dp, "optimizer": opt,
    "sampler": sampler, ...})``, takes `state`: names to objects that give their own state
    (:mod:`tensorplay_mpi.checkpoint._providers`: a provider's ``state_dict()``, each rank's
    own values as :class:`~tensorplay_mpi.checkpoint.PerRank`; a
    :class:`~tensorplay_mpi.DataParallel`'s parameters, buffers and ``steps``; an optimizer
    of the library, a ZeroRedundancyOptimizer sharded or whole with
    :class:`~tensorplay_mpi.checkpoint.Consolidated`; a
    :class:`~tensorplay_mpi.data.Sampler`'s epoch, cursors and state; random generators;
    plain arrays and numbers), and none of the array form's keywords.  The array form,
    ``save(directory, params, buffers=..., optimizer=..., step=..., cursor=..., extra=...)``,
    takes the arrays and counters themselves; it is kept, as the form for bare arrays, and
    both write the same format.

    Parameters
    ----------
    directory : str or os.PathLike
        The checkpoint directory, on a file system every rank sees.
    state : mapping of str to objects, or sequence of arrays or torch tensors
        The mapping form's objects (keys: non-empty strings without ``/``), or the array
        form's `params`: NumPy or CuPy arrays, or torch tensors on the CPU or CUDA
        (``model.parameters()``, parameters that require grad included); rank 0's are saved,
        bitwise, and must be the same on every rank.
    buffers : sequence of arrays or torch tensors
        The array form: ``model.buffers()``, as `params`.
    optimizer : optional
        The array form: a local optimizer (rank 0's state is saved: it is the same on every
        rank) or a :class:`~tensorplay_mpi.optim.ZeroRedundancyOptimizer`.
    step, epoch, cursor : int
        The array form: the counters (the same on every rank) and this rank's data cursor
        (what it consumed of the current epoch).
    extra : mapping of str to array, optional
        The array form: small arrays saved as rank 0 has them (say, the epoch's running
        totals), the same on every rank; numeric or string arrays only.  An RNG's state goes
        here as an array (:func:`tensorplay_mpi.checkpoint.rng_state`); a value that is
        each rank's own goes in wrapped in :class:`~tensorplay_mpi.checkpoint.PerRank`:
        every rank's is saved and :func:`load` gives each rank back its own.
    zero : {"sharded", "consolidated"}
        The array form, for a ZeroRedundancyOptimizer: each rank writes its shard's state to
        its own file, or rank 0 gathers the full state (``consolidate_state_dict``) and
        writes it.
    comm : mpi4py.MPI.Intracomm, optional
        Defaults to ``MPI.COMM_WORLD``.
    timeout : float, optional
        Seconds any wait may take (default ``$TENSORPLAY_MPI_TIMEOUT``).
    config : mapping, optional
        The run's configuration as rank 0 has it (batch size, seed, model shape, optimizer
        hyperparameters: whatever the cursors and the state depend on), plain data only;
        :func:`load` given a `config` refuses a checkpoint recorded with another.

    Returns
    -------
    Saved
        The manifest's path, the bytes written and the time taken.

    Raises
    ------
    OSError
        On every rank, when writing failed on some rank (the previous checkpoint stays).
    ValueError, TypeError
        On every rank, before anything is written: for counters, parameters or replicated
        state that differ across ranks, `extra` keys or plain values (the mapping form:
        entries) that differ across ranks (``ValueError``: rank 0's would be saved; mark each
        rank's own with ``PerRank``), an unknown `zero`, an optimizer that is none of the
        library's, a hyperparameter that cannot be saved, an array that would not load back
        without pickle (object arrays, a dict in `extra`, structured dtypes), a `config` value
        that is not plain data; in the mapping form, an object that is no provider (no
        ``state_dict()`` and ``load_state_dict()``) nor an array (``TypeError``), a second
        DataParallel, optimizer of the library or Sampler (``ValueError``), an array form's
        keyword (``TypeError``), or an exception a ``state_dict()`` raised.
    RuntimeError
        Inside a running Join outside its ``on_save``, before any collective (the ranks still
        in the Join then raise :class:`~tensorplay_mpi.errors.PeerFailureError`).

    Examples
    --------
    ::

        state = {"model": dp, "optimizer": opt, "sampler": sampler, "rng": PerRank(rng)}
        checkpoint.save(directory, state, comm=comm)
        resumed = checkpoint.load(directory, state, comm=comm)  # None: a fresh start
    """
    if isinstance(state, Mapping):
        given = _array_form_keywords(buffers=buffers, optimizer=optimizer, step=step,
                                     epoch=epoch, cursor=cursor, extra=extra, zero=zero)
        what, refused = _from_mapping("save", contents, state, given, Contents(entries={}))
    else:
        what, refused = Contents(state, buffers, optimizer, zero, step, epoch, cursor,
                                 extra), None
    return _save(os.fspath(directory), what, refused, comm, timeout, config)


_ARRAY_FORM = {"buffers": (), "optimizer": None, "step": 0, "epoch": 0, "cursor": 0,
               "extra": None, "zero": "sharded"}  # the keywords of the array form alone


def _array_form_keywords(**given: Any) -> list[str]:
    """The array form's keywords among `given` that differ from their defaults."""
    return [name for name, value in given.items()
            if not (value is _ARRAY_FORM[name] or (type(value) is type(_ARRAY_FORM[name])
                                                    and value == _ARRAY_FORM[name]))]


def _from_mapping(what: str, build: Callable[[Mapping[str, Any]], Any],
                  state: Mapping[str, Any], given: list[str], empty: Any) -> tuple[Any, Any]:
    """``build(state)`` (the mapping form's contents or plan) and None, or `empty` and the
    error that refuses it (on every rank: the first agreement carries it)."""
    _refuse_inside_join(what)  # before any provider's state_dict()
    try:
        if given:
            raise TypeError(
                f"the provider form of checkpoint.{what} (a mapping of names to objects) "
                f"takes no {', '.join(f'{name}=' for name in given)}: the objects of the "
                "mapping give their state (a DataParallel its parameters, buffers and steps, "
                "an optimizer its state, checkpoint.Consolidated(zero) a whole ZeRO state, a "
                "Sampler its epoch and cursor, other values as they are)")
        return build(state), None
    except Exception as refused:  # a TypeError or ValueError, or a failing state_dict()
        return empty, refused


def _save(directory: str, what: Contents, refused: BaseException | None,
          comm: MPI.Intracomm | None, timeout: float | None,
          config: Mapping[str, Any] | None) -> Saved:
    """:func:`save` of `what` (either form); `refused`: this rank's mapping was refused."""
    comm, timeout, params, buffers = _begin("save", comm, timeout, what.params, what.buffers,
                                            refused, what.entries is not None)
    start = time.perf_counter()
    rank, size = comm.Get_rank(), comm.Get_size()
    optimizer = what.optimizer
    params = [host_array(p) for p in params]  # once: the replica digest, then rank 0's manifest
    buffers = [host_array(b) for b in buffers]
    replicated = optimizer.replicated_state() if isinstance(optimizer, OptimizerState) else []
    unsavable: Exception | None = None
    try:  # refused after the counters' gather, which every rank must reach
        shared, own = split_extra(what.extra)
    except Exception as failed:  # a TypeError, or a failing device copy
        unsavable, shared, own = failed, {}, {}
    counters = np.array([what.step, what.epoch, what.cursor, time.time_ns(),
                         array_digest(params + buffers + replicated), unsavable is None,
                         *extra_digests(shared, own)], dtype=np.int64)
    every = np.empty((size, counters.size), dtype=np.int64)
    iallgather(comm, counters, every, "checkpoint counters").wait_or_abort(timeout)
    token = int(every[0, 3])
    differing = _differing(comm, every, shared, timeout, what.entries)
    error: BaseException | None = None
    try:
        _check_counters(every, what.entries is not None)
        kind = _optimizer_kind(optimizer, what.zero)
        check_savable(params, buffers, None)
        if unsavable is not None:
            raise unsavable
        _check_replicated(every[:, 4])
        if every[:, 5].all():  # else the rank whose extra failed raises its own error
            check_extra(every[:, 6], every[:, 7], shared, own, differing,
                        entries=what.entries is not None)
        recorded = {name: value for name, value in (("config", encode_config(config)),
                                                    ("providers", what.entries))
                    if value is not None}
    except Exception as failed:
        error = failed
    agree_or_raise(comm, error, "checkpoint arguments", timeout)

    if kind == "zero-consolidated":
        assert optimizer is not None  # a sharded optimizer
        optimizer.consolidate_state_dict(to=0)
    mine = [_shard_path(directory, rank, size, token, name) for name in _PER_RANK_FILES]
    try:
        written = _write_files(comm, directory, mine, params, buffers, optimizer, kind, every,
                               (shared, own), timeout, recorded, start)
    except BaseException:
        if not _committed(directory, token):  # else the manifest on disk names these files
            for path in mine:  # this save's, if this rank wrote them: no manifest names them
                with contextlib.suppress(OSError):
                    os.unlink(path)
        raise
    _remove_stale(directory, rank, mine)  # local: the commit's agreement was the last one
    return Saved(os.path.join(directory, MANIFEST), int(written[:, 0].sum()),
                 float(written[:, 1].max() / 1e9))


def _check_counters(every: np.ndarray, entries: bool) -> None:
    """Raise ValueError unless every rank gave the same step and epoch counters (with
    `entries`, the mapping form: the DataParallel's steps and the Sampler's epoch)."""
    if (every[:, :2] != every[0, :2]).any():
        what = ("the DataParallel's steps or the Sampler's epoch differ across ranks"
                if entries else "ranks passed different step/epoch counters")
        raise ValueError(f"{what} (by rank: {every[:, :2].tolist()}); pass the same on every "
                         "rank")


def _differing(comm: MPI.Intracomm, every: np.ndarray, shared: Mapping[str, np.ndarray],
               timeout: float, entries: Mapping[str, str] | None) -> list[str]:
    """The plain values (extra keys, or the mapping form's entries) that differ across ranks,
    when the gathered counters (`every`, the same on every rank) say some do: a second gather
    of a digest per value, only then (every rank decides alike)."""
    if not (every[:, 5].all() and (every[:, 6] == every[0, 6]).all()
            and (every[:, 7] != every[0, 7]).any()):
        return []
    mine = value_digests(shared)
    each = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
    iallgather(comm, mine, each, "checkpoint extra digests").wait_or_abort(timeout)
    keys = [key for j, key in enumerate(sorted(shared)) if (each[:, j] != each[0, j]).any()]
    if entries is None:
        return keys
    return sorted({key.split("/", 1)[0] for key in keys})


def _check_replicated(digests: np.ndarray) -> None:
    """Raise ValueError unless every rank holds the same parameters, buffers and replicated
    optimizer state (rank 0's are saved)."""
    if (digests != digests[0]).any():
        raise ValueError(
            f"the ranks hold different parameters, buffers or optimizer state (the same within "
            f"each of {groups(digests)}), and a checkpoint saves rank 0's: inside a Join, "
            "a rank that has joined skips an update written in the loop after dp.step(); put "
            "the optimizer in the Join (Join([dp, opt])) or in update= so that joined ranks "
            "step too")


def _write_files(comm: MPI.Intracomm, directory: str, mine: Sequence[str],
                 params: Sequence[Any], buffers: Sequence[Any], optimizer: Any, kind: str,
                 every: np.ndarray, extra: tuple[dict[str, np.ndarray], dict[str, np.ndarray]],
                 timeout: float, recorded: Mapping[str, Any] | None = None,
                 start: float = 0.0) -> np.ndarray:
    """Write this rank's files (`mine`: its shard, its per-rank extras), agree, then rank 0
    writes the manifest (the commit point, its metadata with the `recorded` entries: the
    configuration, the mapping form's entries), agree, the save's last collective; every
    rank's bytes written and nanoseconds since `start` (a ``perf_counter`` reading), a row
    per rank."""
    error: BaseException | None = None
    nbytes, rank = 0, comm.Get_rank()
    shared, own = extra
    try:
        os.makedirs(directory, exist_ok=True)
        if kind == "zero-sharded":
            arrays, meta = _flatten(optimizer.shard_state_dict(), "optimizer")
            arrays["meta"] = np.array(json.dumps(meta))
            nbytes += write_arrays(mine[0], arrays)
        if own:
            nbytes += write_arrays(mine[1], {f"extra/{k}": v for k, v in own.items()})
        if rank == 0:
            manifest = _manifest(params, buffers, optimizer, kind, every, shared, sorted(own))
            if recorded:
                meta = json.loads(str(manifest["meta"]))
                manifest["meta"] = np.array(json.dumps({**meta, **recorded}))
    except Exception as failed:
        error = failed
    parts = [name for name, wrote in (("optimizer shards", kind == "zero-sharded"),
                                      ("per-rank extras", bool(own))) if wrote]
    agree_or_raise(comm, error, f"checkpoint write ({' and '.join(parts)}"
                   f"{' and ' if parts else ''}the manifest's contents)", timeout)
    try:
        if rank == 0:
            nbytes += write_arrays(os.path.join(directory, MANIFEST), manifest)
    except Exception as failed:
        error = failed
    elapsed = int((time.perf_counter() - start) * 1e9)
    return agree_or_raise(comm, error, "checkpoint write (manifest)", timeout, nbytes, elapsed)


def _committed(directory: str, token: int) -> bool:
    """Whether the manifest in `directory` is the one of the save with `token`: a failure
    after rank 0 renamed it (a directory fsync's error, an interrupt in the last agreement)
    must leave the files it names.  Every rank reads the same file, so every rank decides
    alike, without a collective on the failure path."""
    try:
        with np.load(os.path.join(directory, MANIFEST), allow_pickle=False) as data:
            return json.loads(str(data["meta"]))["token"] == token
    except (OSError, ValueError, KeyError):
        return False


def _remove_stale(directory: str, rank: int, current: Sequence[str]) -> None:
    """Remove this rank's files that the manifest no longer names: shards and per-rank extras
    of older saves and temporary files of saves that were killed."""
    stale = [path for what in _PER_RANK_FILES
             for path in glob.glob(os.path.join(directory, f"{what}-{rank}-of-*"))]
    if rank == 0:
        stale += glob.glob(os.path.join(directory, f"{MANIFEST}.tmp-*"))
    for path in stale:
        if path not in current:
            with contextlib.suppress(OSError):  # harmless: the next save tries again
                os.unlink(path)


def _manifest(params: Sequence[Any], buffers: Sequence[Any], optimizer: Any, kind: str,
              every: np.ndarray, extra: Mapping[str, np.ndarray],
              per_rank: list[str]) -> dict[str, np.ndarray]:
    """Rank 0's manifest: its arrays, the plain `extra` ones, and the names of the `per_rank`
    ones, which each rank's own file holds."""
    arrays = {f"params/{i}": host_array(p) for i, p in enumerate(params)}
    arrays.update({f"buffers/{i}": host_array(b) for i, b in enumerate(buffers)})
    arrays.update({f"extra/{k}": v for k, v in extra.items()})
    meta: dict[str, Any] = {
        "format": FORMAT, "world_size": len(every), "token": int(every[0, 3]), "optimizer": kind,
        "step": int(every[0, 0]), "epoch": int(every[0, 1]),
        "cursors": every[:, 2].tolist(),
        "params": [[list(p.shape), p.dtype.str] for p in params],
        "buffers": [[list(b.shape), b.dtype.str] for b in buffers],
    }
    if per_rank:
        meta["per_rank"] = per_rank
    if kind in ("local", "zero-consolidated"):
        state, meta["optimizer_state"] = _flatten(optimizer.state_dict(), "optimizer")
        arrays.update(state)
    arrays["meta"] = np.array(json.dumps(meta))
    return arrays


# -- load ----------------------------------------------------------------------------------------


def load(directory: str | os.PathLike, state: Mapping[str, Any] | Sequence[Any], *,
         buffers: Sequence[Any] = (), optimizer: OptimizerState | None = None,
         comm: MPI.Intracomm | None = None, timeout: float | None = None,
         config: Mapping[str, Any] | None = None, resize: bool = False) -> Resumed | None:
    """Load the checkpoint in `directory` into the objects of `state` (the mapping form), or
    into `params`, `buffers` and `optimizer` (the array form), in place.

    Collective over `comm`: every rank calls it, outside a running Join (or inside its
    ``on_save``, where every rank is at one point), with the same arguments as :func:`save`
    took (in the mapping form, the entries to load: others the checkpoint holds are left).
    Nothing is modified unless every rank could read and check everything; in the mapping
    form each provider's ``load_state_dict`` then runs, in the mapping's order, and an
    exception it raises on some rank raises on every rank (the entries before it loaded).
    With `config`, the configuration the checkpoint recorded (``save(..., config=)``) must be
    equal, key by key; leave out the keys a resume may change (say, the number of epochs).
    With ``resize=True`` a checkpoint saved at another world size loads: the replicated state
    as it is, a ZeRO state saved sharded re-sharded over this world size (every rank reads
    every saved shard), and the data cursors re-split by a Sampler of the mapping (in the
    array form, left to the caller: :meth:`tensorplay_mpi.data.Sampler.resume`).  Values
    saved per rank (:class:`~tensorplay_mpi.checkpoint.PerRank`) come back to their own
    ranks at the saved world size; at another one none does: their keys are absent from
    ``Resumed.extra`` and from the dicts a provider's ``load_state_dict`` gets, and reading
    one raises ``KeyError`` naming both world sizes.

    Returns
    -------
    Resumed or None
        The counters (in the mapping form, the DataParallel's steps and the Sampler's epoch
        and cursors), this rank's cursor, the plain values (``extra``); None on every rank
        when `directory` holds no checkpoint (a fresh start: nothing is loaded).

    Raises
    ------
    ValueError
        On every rank, when the checkpoint was saved at another world size, for other
        parameter or buffer shapes/dtypes, another optimizer (class, state shapes, or none),
        in another format, when only some ranks see it (the directory must be on a file
        system every rank shares), when `config` differs from the recorded one (naming
        every key that differs); in the mapping form, for an entry the checkpoint lacks or
        saved from another kind of object, or a Sampler it cannot resume.
    TypeError
        On every rank, in the mapping form, for an object that is no provider nor a plain
        value, or an array form's keyword.
    OSError
        On every rank, when reading failed on some rank.
    RuntimeError
        Inside a running Join outside its ``on_save``, before any collective.
    """
    if isinstance(state, Mapping):
        given = _array_form_keywords(buffers=buffers, optimizer=optimizer)
        into, refused = _from_mapping("load", plan, state, given, Plan(entries={}))
    else:
        into, refused = Plan(state, buffers, optimizer), None
    return _load(os.fspath(directory), into, refused, comm, timeout, config, resize)


def _load(directory: str, into: Plan, refused: BaseException | None,
          comm: MPI.Intracomm | None, timeout: float | None,
          config: Mapping[str, Any] | None, resize: bool) -> Resumed | None:
    """:func:`load` `into` (either form); `refused`: this rank's mapping was refused."""
    comm, timeout, params, buffers = _begin("load", comm, timeout, into.params, into.buffers,
                                            refused, into.partial)
    rank, size = comm.Get_rank(), comm.Get_size()
    path = os.path.join(directory, MANIFEST)
    found = agree_or_raise(comm, None, "checkpoint lookup", timeout, int(os.path.exists(path)))
    if not found.any():
        return None
    error: BaseException | None = None
    token = 0
    try:
        if not found.all():
            raise ValueError(f"the checkpoint {path} is visible on rank(s) "
                             f"{np.flatnonzero(found).tolist()} only: put it on a file "
                             "system every rank shares")
        arrays = read_arrays(path)
        meta = json.loads(str(arrays["meta"]))
        token = meta["token"]
        _check_manifest(meta, params, buffers, size, resize, into.partial and into.model is None)
        check_config(meta.get("config"), config)
        extra = resumed_extra(_extra_of(arrays), _own_extra(meta, directory, rank, size),
                              meta.get("per_rank", []), meta["world_size"], size)
        loads = into.prepare(meta, extra, size)  # the mapping form's entries, checked first
        state, shard = (None, False) if into.partial and into.optimizer is None else \
            _optimizer_state(meta, arrays, into.optimizer, directory, rank, size)
    except Exception as failed:
        error = failed
    tokens = agree_or_raise(comm, error, f"checkpoint load ({path})", timeout, token)
    if (tokens != tokens[0]).any():
        raise ValueError(f"rank {rank}: ranks read different checkpoints from {path} (it was "
                         "replaced while loading, or the ranks do not share that file system)")
    torch_cuda.take()  # torch CUDA tensors: written after torch's pending kernels
    for i, p in enumerate(params):
        _copy_into(p, arrays[f"params/{i}"])
    for i, b in enumerate(buffers):
        _copy_into(b, arrays[f"buffers/{i}"])
    torch_cuda.hand_back()
    if state is not None and into.optimizer is not None:
        if shard:
            into.optimizer.load_shard_state_dict(state)
        else:
            into.optimizer.load_state_dict(state)
    if into.partial:
        _load_entries(comm, loads, timeout)
    plain = into.plain(meta)
    extra = resumed_extra({k: v for k, v in extra.items() if plain(k)}, {},
                          [k for k in meta.get("per_rank", []) if plain(k)],
                          meta["world_size"], size)
    cursors = tuple(meta["cursors"])
    cursor = cursors[rank] if len(cursors) == size else 0
    return Resumed(meta["step"], meta["epoch"], cursor, cursors, extra, path, len(cursors))


def _load_entries(comm: MPI.Intracomm, loads: Sequence[Callable[[], None]],
                  timeout: float) -> None:
    """Run the mapping form's `loads` (each entry's ``load_state_dict``, in the mapping's
    order), then agree: one that raised on some rank raises on every rank."""
    error: BaseException | None = None
    try:
        for load_entry in loads:
            load_entry()
    except Exception as failed:
        error = failed
    agree_or_raise(comm, error, "checkpoint load (the state providers)", timeout)


def _check_manifest(meta: dict, params: Sequence[Any], buffers: Sequence[Any],
                    size: int, resize: bool = False, without_model: bool = False) -> None:
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {meta.get('format')!r}, this version reads "
                         f"format {FORMAT}")
    if meta["world_size"] != size and not resize:
        raise ValueError(f"the checkpoint was saved at {meta['world_size']} ranks, this job has "
                         f"{size}: its data cursors describe {meta['world_size']} shards; resume "
                         f"at {meta['world_size']} ranks, or pass resize=True and re-split the "
                         "data (tensorplay_mpi.data.Sampler)")
    for name, arrays in (() if without_model else (("params", params), ("buffers", buffers))):
        mine = [[list(a.shape), a.dtype.str] for a in arrays]
        if meta[name] != mine:
            raise ValueError(f"the checkpoint holds {name} {_layout(meta[name])}, this job has "
                             f"{_layout(mine)}")


def _extra_of(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k[len("extra/"):]: v for k, v in arrays.items() if k.startswith("extra/")}


def _own_extra(meta: dict, directory: str, rank: int, size: int) -> dict[str, np.ndarray]:
    """This rank's per-rank extras (its own file), at the saved world size; none at another."""
    keys = meta.get("per_rank", [])
    if not keys or meta["world_size"] != size:
        return {}
    own = _extra_of(read_arrays(_shard_path(directory, rank, size, meta["token"], "per-rank")))
    if sorted(own) != keys:
        raise ValueError(f"rank {rank}'s per-rank file holds extra {sorted(own)}, the manifest "
                         f"names {keys}: the checkpoint was altered")
    return own


def _layout(arrays: list) -> str:
    return "[" + ", ".join(f"{tuple(shape)} {dtype}" for shape, dtype in arrays) + "]"


def _optimizer_state(meta: dict, arrays: dict[str, np.ndarray], optimizer: Any,
                     directory: str, rank: int, size: int) -> tuple[dict[str, Any] | None, bool]:
    """The state dict to load into `optimizer`, checked against it, and whether it is this
    rank's shard (else the full state)."""
    saved, wanted = meta["optimizer"], _optimizer_kind(optimizer, "sharded")
    full = saved in ("local", "zero-consolidated")
    if saved == "none" and wanted == "none":
        return None, False
    if "none" in (saved, wanted) or (saved == "zero-sharded" and wanted == "local"):
        raise ValueError(f"the checkpoint holds optimizer state of kind {saved!r}, the optimizer "
                         f"given is {'none' if optimizer is None else type(optimizer).__name__}"
                         " (a full state loads into a local optimizer or a "
                         "ZeroRedundancyOptimizer; a sharded one only into the latter)")
    if not full and meta["world_size"] != size:  # re-shard: this rank reads every shard
        full, (state_meta, arrays) = True, _gathered_shards(
            meta, directory, optimizer.shard_owners(meta["world_size"]))
    else:
        state_meta = meta.get("optimizer_state", {})
    if not full:
        shard = read_arrays(_shard_path(directory, rank, size, meta["token"]))
        state_meta, arrays = json.loads(str(shard["meta"])), shard
    state = _unflatten(state_meta, arrays, "optimizer", optimizer)
    optimizer.check_state_dict(state, shard=not full, source="the checkpoint")
    return state, not full


def _gathered_shards(meta: dict, directory: str, owners: list[int]
                     ) -> tuple[dict, dict[str, np.ndarray]]:
    """A state saved sharded (at another world size) as one full state: every saved rank's
    shard file, its parameters numbered as in the whole model (`owners`: the saving rank of
    each parameter)."""
    world = meta["world_size"]
    full: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    steps = np.zeros(len(owners), dtype=np.int64)  # per parameter, as the shards counted them
    every_shard_counted = True
    for rank in range(world):
        shard = read_arrays(_shard_path(directory, rank, world, meta["token"]))
        shard_meta = json.loads(str(shard["meta"]))
        full = full or dict(shard_meta, state={})
        mine = [i for i, owner in enumerate(owners) if owner == rank]
        for k, names in shard_meta["state"].items():
            i = mine[int(k)]
            full["state"][str(i)] = names
            arrays.update({f"optimizer/{i}/{name}": shard[f"optimizer/{k}/{name}"]
                           for name in names})
        if "optimizer/param_steps" in shard:
            steps[mine] = shard["optimizer/param_steps"]
        else:  # a checkpoint older than per-parameter counts: the optimizer's own count
            every_shard_counted = False
    if every_shard_counted:
        arrays["optimizer/param_steps"] = steps
    return full, arrays


def _copy_into(target: Any, host: np.ndarray) -> None:
    if is_device_array(target):
        target.set(np.ascontiguousarray(host, dtype=target.dtype))
    else:
        target[...] = host
