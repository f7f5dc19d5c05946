"""The demos' validation: the held-out set split unevenly, every sample counted exactly once.

Each rank evaluates its shard of the held-out set (:func:`tensorplay_mpi.data.shard`, nothing
padded, nothing dropped) batch by batch and keeps running states; they are summed over the
ranks once, after the loop.  The accuracy and mean loss printed are therefore those of one
process evaluating the whole held-out set: the NumPy demo sums a confusion matrix and the loss
with :func:`tensorplay_mpi.evaluation.metrics.reduce_states`, the torch demo syncs torchmetrics
through :func:`tensorplay_mpi.evaluation.metrics.gather_all_tensors`.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from tensorplay_mpi.data import batches, shard
from tensorplay_mpi.evaluation.metrics import confusion_matrix, reduce_states, sync_options

__all__ = ["validate"]

CLASSES = 10


def _host(x: Any) -> np.ndarray:
    """A NumPy copy of a NumPy or CuPy array."""
    return x.get() if hasattr(x, "get") else np.asarray(x)


def validate(comm: MPI.Intracomm, predict: Callable[[np.ndarray], Any], x: np.ndarray,
             y: np.ndarray, batch_size: int, skew: float, torch_metrics: bool = False) -> str:
    """Accuracy and mean cross-entropy over the held-out set `x`, `y`, as one line of text.

    Collective over `comm`.  `predict` maps a NumPy batch to class probabilities (NumPy or
    CuPy), or, with `torch_metrics`, to a torch tensor of logits, evaluated with torchmetrics
    (with the NumPy states where torchmetrics is not installed).
    """
    mine = batches(shard(len(y), comm.rank, comm.size, skew), batch_size)
    if torch_metrics and importlib.util.find_spec("torchmetrics") is None:
        torch_metrics, logits_of = False, predict  # the NumPy states, from the probabilities
        predict = lambda batch: logits_of(batch).double().softmax(1).numpy()  # noqa: E731
    if torch_metrics:
        accuracy, loss, counted = _torchmetrics(comm, predict, x, y, mine)
    else:
        cm, loss_sum = np.zeros((CLASSES, CLASSES), np.int64), 0.0
        for idx in mine:
            probs = _host(predict(x[idx]))
            cm += confusion_matrix(y[idx], probs.argmax(axis=1), CLASSES)
            loss_sum -= float(np.log(probs[np.arange(len(idx)), y[idx]]).sum())
        totals = reduce_states({"cm": cm, "loss": loss_sum}, comm)
        counted = int(totals["cm"].sum())
        accuracy, loss = np.trace(totals["cm"]) / counted, totals["loss"] / counted
    return f"validation accuracy {accuracy:.4f} loss {loss:.4f} ({counted}/{len(y)} samples)"


def _torchmetrics(comm: MPI.Intracomm, predict: Callable[[np.ndarray], Any], x: np.ndarray,
                  y: np.ndarray, mine: list[np.ndarray]) -> tuple[float, float, int]:
    import torch
    from torchmetrics import MeanMetric
    from torchmetrics.classification import MulticlassAccuracy

    accuracy = MulticlassAccuracy(num_classes=CLASSES, average="micro", **sync_options(comm))
    loss = MeanMetric(**sync_options(comm))
    counted = 0
    for idx in mine:
        logits, target = predict(x[idx]), torch.from_numpy(y[idx])
        accuracy.update(logits, target)
        loss.update(torch.nn.functional.cross_entropy(logits.double(), target,
                                                      reduction="none"))
        counted += len(idx)
    counted = int(reduce_states({"counted": counted}, comm)["counted"])
    return float(accuracy.compute()), float(loss.compute()), counted
