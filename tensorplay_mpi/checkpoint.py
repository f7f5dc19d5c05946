"""Checkpoints: a training job's state in one directory, written atomically, loaded exactly.

A checkpoint in directory ``DIR`` is one manifest, ``DIR/checkpoint.npz``, written by rank 0
(parameters, buffers, the optimizer state when it is the same on every rank, the step and epoch
counters, every rank's data cursor, small extra arrays), plus, for a
:class:`~tensorplay_mpi.optim.ZeroRedundancyOptimizer` saved sharded, one file per rank
holding its shard's state.  Every file is written to a temporary name, flushed to disk
(``fsync``) and renamed; the manifest is renamed last and names the shard files of its own
save, so a job killed at any point of a save keeps the previous checkpoint, whole.

Both functions are collective over `comm` and run outside a Join: every rank calls them at the
same point.  Their agreements are ``Iallgather`` s through :mod:`tensorplay_mpi.comm`; a
failure on one rank (a full disk, a missing file, another world size) raises on every rank.
The files use NumPy's ``.npz`` format, loaded without pickle.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import time
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
from mpi4py import MPI

from .agreement import agree
from .buffers import is_device_array
from .comm import check_comm, default_comm, iallgather, resolve_timeout
from .guard import Guard
from .process import set_up
from .optim import Optimizer, ZeroRedundancyOptimizer

__all__ = ["save", "load", "Saved", "Resumed", "MANIFEST"]

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
    """What this rank had consumed of the current epoch (the unit is the caller's)."""
    cursors: tuple[int, ...]
    extra: dict[str, np.ndarray]
    path: str


# -- agreement -----------------------------------------------------------------------------------


def _agree(comm: MPI.Intracomm, error: BaseException | None, what: str, timeout: float,
           value: int = 0) -> np.ndarray:
    """Every rank's `value`, once every rank has told whether its part of `what` failed
    (:func:`~tensorplay_mpi.agreement.agree`: a rank whose part failed raises its own `error`;
    the others an exception of the same kind naming the failed ranks)."""
    return agree(lambda row, every: iallgather(comm, row, every, what), comm.Get_rank(),
                 comm.Get_size(), what, timeout, error, [value]).values[:, 0]


# -- files ---------------------------------------------------------------------------------------


def _write(path: str, arrays: Mapping[str, np.ndarray]) -> int:
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


def _read(path: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def _shard_path(directory: str, rank: int, size: int, token: int) -> str:
    return os.path.join(directory, f"optimizer-shard-{rank}-of-{size}.{token}.npz")


def _host(array: Any) -> np.ndarray:
    return array.get() if is_device_array(array) else np.asarray(array)


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
    if optimizer is None:
        return "none"
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        if zero not in ("sharded", "consolidated"):
            raise ValueError(f"zero must be 'sharded' or 'consolidated', got {zero!r}")
        return f"zero-{zero}"
    if isinstance(optimizer, Optimizer):
        return "local"
    raise TypeError(f"optimizer must be a tensorplay_mpi optimizer or None, got "
                    f"{type(optimizer).__name__}")


def _flatten(state_dict: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict]:
    """Arrays under ``prefix/i/name`` and the rest as JSON-ready metadata."""
    arrays = {f"{prefix}/{i}/{name}": _host(a) for i, s in state_dict["state"].items()
              for name, a in s.items()}
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
               live: Optimizer) -> dict[str, Any]:
    """A state dict for `live` (whose current hyperparameters replace saved callables)."""
    now = live.param_groups[0]
    sample = live.params[0] if live.params else None  # a shard may hold no parameter
    return {
        "optimizer": meta["optimizer"],
        "steps": meta["steps"],
        "defaults": {k: _decode(v, live.defaults.get(k)) for k, v in meta["defaults"].items()},
        "param_groups": [{k: _decode(v, now.get(k)) for k, v in g.items()}
                         for g in meta["param_groups"]],
        "state": {int(i): {name: _like(sample, arrays[f"{prefix}/{i}/{name}"])
                           for name in names}
                  for i, names in meta["state"].items()},
    }


def _check_state(saved: dict[str, Any], optimizer: Optimizer, shapes: list[tuple]) -> None:
    """Raise ValueError unless `saved` fits `optimizer` whose parameters have `shapes`."""
    if saved["optimizer"] != type(optimizer).__name__:
        raise ValueError(f"the checkpoint holds {saved['optimizer']} state, the optimizer is "
                         f"{type(optimizer).__name__}")
    state = saved["state"]
    if sorted(state) != list(range(len(shapes))):
        raise ValueError(f"the checkpoint holds optimizer state for {len(state)} parameters, "
                         f"the optimizer has {len(shapes)}")
    for i, shape in enumerate(shapes):
        for name in optimizer.state_names:
            found = getattr(state[i].get(name), "shape", None)
            if found != shape:
                raise ValueError(f"optimizer state [{i}][{name!r}] has shape {found} in the "
                                 f"checkpoint, expected {shape}")


# -- save ----------------------------------------------------------------------------------------


def save(directory: str | os.PathLike, params: Sequence[Any], *, buffers: Sequence[Any] = (),
         optimizer: Optimizer | ZeroRedundancyOptimizer | None = None, step: int = 0,
         epoch: int = 0, cursor: int = 0, extra: Mapping[str, Any] | None = None,
         zero: str = "sharded", comm: MPI.Intracomm | None = None,
         timeout: float | None = None) -> Saved:
    """Write a checkpoint to `directory` (made if missing), replacing the one there atomically.

    Collective over `comm`: every rank calls it, outside a Join, with the same `params` and
    `buffers` (identical on every rank, as DataParallel keeps them), optimizer, `step` and
    `epoch`; `cursor` is this rank's own (what it consumed of the current epoch).

    Parameters
    ----------
    directory : str or os.PathLike
        The checkpoint directory, on a file system every rank sees.
    params, buffers : sequences of arrays
        NumPy or CuPy arrays; rank 0's are saved.
    optimizer : optional
        A local optimizer (rank 0's state is saved: it is the same on every rank) or a
        :class:`~tensorplay_mpi.optim.ZeroRedundancyOptimizer`.
    step, epoch, cursor : int
        The counters (the same on every rank) and this rank's data cursor.
    extra : mapping of str to array, optional
        Small arrays saved as rank 0 has them (say, the epoch's running totals).
    zero : {"sharded", "consolidated"}
        For a ZeroRedundancyOptimizer: each rank writes its shard's state to its own file, or
        rank 0 gathers the full state (``consolidate_state_dict``) and writes it.
    comm : mpi4py.MPI.Intracomm, optional
        Defaults to ``MPI.COMM_WORLD``.
    timeout : float, optional
        Seconds any wait may take (default ``$TENSORPLAY_MPI_TIMEOUT``).

    Returns
    -------
    Saved
        The manifest's path, the bytes written and the time taken.

    Raises
    ------
    OSError
        On every rank, when writing failed on some rank (the previous checkpoint stays).
    ValueError, TypeError
        On every rank, for different counters on different ranks, an unknown `zero`, an
        optimizer that is none of the library's, or a hyperparameter that cannot be saved.
    """
    comm = check_comm(default_comm() if comm is None else comm)
    timeout = resolve_timeout(timeout)
    set_up(comm)
    Guard.attach(comm)
    start = time.perf_counter()
    rank, size = comm.Get_rank(), comm.Get_size()
    directory = os.fspath(directory)
    counters = np.array([step, epoch, cursor, time.time_ns()], dtype=np.int64)
    every = np.empty((size, counters.size), dtype=np.int64)
    iallgather(comm, counters, every, "checkpoint counters").wait_or_abort(timeout)
    token = int(every[0, 3])
    error: BaseException | None = None
    try:
        if (every[:, :2] != every[0, :2]).any():
            raise ValueError(f"ranks passed different step/epoch counters (by rank: "
                             f"{every[:, :2].tolist()}); pass the same on every rank")
        kind = _optimizer_kind(optimizer, zero)
    except (ValueError, TypeError) as refused:
        error = refused
    _agree(comm, error, "checkpoint arguments", timeout)

    if kind == "zero-consolidated":
        assert isinstance(optimizer, ZeroRedundancyOptimizer)
        optimizer.consolidate_state_dict(to=0)
    shard = _shard_path(directory, rank, size, token)
    try:
        written = _write_files(comm, directory, shard, params, buffers, optimizer, kind, every,
                               extra, timeout)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(shard)  # this save's, if this rank wrote it: no manifest names it
        raise
    _remove_stale(directory, rank, shard)
    elapsed = _agree(comm, None, "checkpoint timing", timeout,
                     int((time.perf_counter() - start) * 1e9)).max() / 1e9
    return Saved(os.path.join(directory, MANIFEST), int(written.sum()), float(elapsed))


def _write_files(comm: MPI.Intracomm, directory: str, shard: str, params: Sequence[Any],
                 buffers: Sequence[Any], optimizer: Any, kind: str, every: np.ndarray,
                 extra: Mapping[str, Any] | None, timeout: float) -> np.ndarray:
    """Write this rank's shard, agree, then rank 0 writes the manifest (the commit point),
    agree; every rank's bytes written."""
    error: BaseException | None = None
    nbytes, rank = 0, comm.Get_rank()
    try:
        os.makedirs(directory, exist_ok=True)
        if kind == "zero-sharded":
            arrays, meta = _flatten(optimizer.local.state_dict(), "optimizer")
            arrays["meta"] = np.array(json.dumps(meta))
            nbytes += _write(shard, arrays)
        if rank == 0:
            manifest = _manifest(params, buffers, optimizer, kind, every, extra, int(every[0, 3]))
    except Exception as failed:
        error = failed
    _agree(comm, error, "checkpoint write (optimizer shards)", timeout)
    try:
        if rank == 0:
            nbytes += _write(os.path.join(directory, MANIFEST), manifest)
    except Exception as failed:
        error = failed
    return _agree(comm, error, "checkpoint write (manifest)", timeout, nbytes)


def _remove_stale(directory: str, rank: int, current: str) -> None:
    """Remove this rank's files that the manifest no longer names: shards of older saves and
    temporary files of saves that were killed."""
    stale = glob.glob(os.path.join(directory, f"optimizer-shard-{rank}-of-*"))
    if rank == 0:
        stale += glob.glob(os.path.join(directory, f"{MANIFEST}.tmp-*"))
    for path in stale:
        if path != current:
            with contextlib.suppress(OSError):  # harmless: the next save tries again
                os.unlink(path)


def _manifest(params: Sequence[Any], buffers: Sequence[Any], optimizer: Any, kind: str,
              every: np.ndarray, extra: Mapping[str, Any] | None,
              token: int) -> dict[str, np.ndarray]:
    arrays = {f"params/{i}": _host(p) for i, p in enumerate(params)}
    arrays.update({f"buffers/{i}": _host(b) for i, b in enumerate(buffers)})
    arrays.update({f"extra/{k}": _host(v) for k, v in (extra or {}).items()})
    meta: dict[str, Any] = {
        "format": FORMAT, "world_size": len(every), "token": token, "optimizer": kind,
        "step": int(every[0, 0]), "epoch": int(every[0, 1]),
        "cursors": every[:, 2].tolist(),
        "params": [[list(p.shape), p.dtype.str] for p in params],
        "buffers": [[list(b.shape), b.dtype.str] for b in buffers],
    }
    if kind in ("local", "zero-consolidated"):
        state, meta["optimizer_state"] = _flatten(optimizer.state_dict(), "optimizer")
        arrays.update(state)
    arrays["meta"] = np.array(json.dumps(meta))
    return arrays


# -- load ----------------------------------------------------------------------------------------


def load(directory: str | os.PathLike, params: Sequence[Any], *, buffers: Sequence[Any] = (),
         optimizer: Optimizer | ZeroRedundancyOptimizer | None = None,
         comm: MPI.Intracomm | None = None, timeout: float | None = None) -> Resumed | None:
    """Load the checkpoint in `directory` into `params`, `buffers` and `optimizer`, in place.

    Collective over `comm`: every rank calls it, outside a Join, with the same arguments as
    :func:`save` took.  Nothing is modified unless every rank could read and check everything.

    Returns
    -------
    Resumed or None
        The counters and this rank's cursor; None on every rank when `directory` holds no
        checkpoint (a fresh start).

    Raises
    ------
    ValueError
        On every rank, when the checkpoint was saved at another world size, for other
        parameter or buffer shapes/dtypes, another optimizer (class, state shapes, or none),
        in another format, or when only some ranks see it (the directory must be on a file
        system every rank shares).
    OSError
        On every rank, when reading failed on some rank.
    """
    comm = check_comm(default_comm() if comm is None else comm)
    timeout = resolve_timeout(timeout)
    set_up(comm)
    Guard.attach(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    path = os.path.join(os.fspath(directory), MANIFEST)
    found = _agree(comm, None, "checkpoint lookup", timeout, int(os.path.exists(path)))
    if not found.any():
        return None
    error: BaseException | None = None
    token = 0
    try:
        if not found.all():
            raise ValueError(f"the checkpoint {path} is visible on rank(s) "
                             f"{np.flatnonzero(found).tolist()} only: put it on a file "
                             "system every rank shares")
        arrays = _read(path)
        meta = json.loads(str(arrays["meta"]))
        token = meta["token"]
        _check_manifest(meta, params, buffers, size)
        state = _optimizer_state(meta, arrays, optimizer, os.fspath(directory), rank, size)
    except Exception as failed:
        error = failed
    tokens = _agree(comm, error, f"checkpoint load ({path})", timeout, token)
    if (tokens != tokens[0]).any():
        raise ValueError(f"rank {rank}: ranks read different checkpoints from {path} (it was "
                         "replaced while loading, or the ranks do not share that file system)")
    for i, p in enumerate(params):
        _copy_into(p, arrays[f"params/{i}"])
    for i, b in enumerate(buffers):
        _copy_into(b, arrays[f"buffers/{i}"])
    if state is not None and optimizer is not None:
        if isinstance(optimizer, ZeroRedundancyOptimizer) and meta["optimizer"] == "zero-sharded":
            optimizer.local.load_state_dict(state)
        else:
            optimizer.load_state_dict(state)
    extra = {k[len("extra/"):]: v for k, v in arrays.items() if k.startswith("extra/")}
    cursors = tuple(meta["cursors"])
    return Resumed(meta["step"], meta["epoch"], cursors[rank], cursors, extra, path)


def _check_manifest(meta: dict, params: Sequence[Any], buffers: Sequence[Any],
                    size: int) -> None:
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {meta.get('format')!r}, this version reads "
                         f"format {FORMAT}")
    if meta["world_size"] != size:
        raise ValueError(f"the checkpoint was saved at {meta['world_size']} ranks, this job has "
                         f"{size}: its data cursors describe {meta['world_size']} shards; resume "
                         f"at {meta['world_size']} ranks")
    for name, arrays in (("params", params), ("buffers", buffers)):
        mine = [[list(a.shape), a.dtype.str] for a in arrays]
        if meta[name] != mine:
            raise ValueError(f"the checkpoint holds {name} {_layout(meta[name])}, this job has "
                             f"{_layout(mine)}")


def _layout(arrays: list) -> str:
    return "[" + ", ".join(f"{tuple(shape)} {dtype}" for shape, dtype in arrays) + "]"


def _optimizer_state(meta: dict, arrays: dict[str, np.ndarray], optimizer: Any,
                     directory: str, rank: int, size: int) -> dict[str, Any] | None:
    """The state dict to load into `optimizer` (or its shard), checked against it."""
    saved, wanted = meta["optimizer"], _optimizer_kind(optimizer, "sharded")
    full = saved in ("local", "zero-consolidated")
    if saved == "none" and wanted == "none":
        return None
    if "none" in (saved, wanted) or (saved == "zero-sharded" and wanted == "local"):
        raise ValueError(f"the checkpoint holds optimizer state of kind {saved!r}, the optimizer "
                         f"given is {'none' if optimizer is None else type(optimizer).__name__}"
                         " (a full state loads into a local optimizer or a "
                         "ZeroRedundancyOptimizer; a sharded one only into the latter)")
    if full:
        live = optimizer.local if wanted.startswith("zero") else optimizer
        state = _unflatten(meta["optimizer_state"], arrays, "optimizer", live)
        _check_state(state, live, [tuple(p.shape) for p in optimizer.params])
        return state
    shard = _read(_shard_path(directory, rank, size, meta["token"]))
    state = _unflatten(json.loads(str(shard["meta"])), shard, "optimizer", optimizer.local)
    _check_state(state, optimizer.local, [tuple(p.shape) for p in optimizer.local.params])
    return state


def _copy_into(target: Any, host: np.ndarray) -> None:
    if is_device_array(target):
        target.set(np.ascontiguousarray(host, dtype=target.dtype))
    else:
        target[...] = host
