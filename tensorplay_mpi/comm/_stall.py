"""The stall report: a rank that has waited long in a library call says where every rank is.

After ``$TENSORPLAY_MPI_STALL`` seconds (60; 0 turns it off) in one library wait, a rank asks
every other rank of the communicator, over the guard's private ``notices`` communicator, where
it is.  A rank answers from its own library waits (they poll ``notices`` anyway): how many
collectives it has started on the communicator and what it waits for.  After at most
:data:`ANSWER_WINDOW_S` the stalled rank prints one line, and goes on waiting (the deadline,
``$TENSORPLAY_MPI_TIMEOUT``, still ends the job).  A rank that does not answer is not in a
library wait: busy in its own code, blocked in a collective of its own, or gone.
"""

from __future__ import annotations

import pickle
import sys
import time

import numpy as np
from mpi4py import MPI

from ._work import likely_causes

QUERY_TAG = 0x7E12
ANSWER_TAG = 0x7E13
ANSWER_WINDOW_S = 1.0
"""Seconds a stalled rank collects answers before it prints its report."""


def _send(comm: MPI.Intracomm, message: tuple, dest: int, tag: int,
          sent: list[np.ndarray]) -> None:
    """Send without a request to complete: a rank that never asks again never receives it.

    MPI lets a send request be freed while active; its payload stays in `sent` (the guard's,
    kept as long as the communicator) since MPI may still read it.
    """
    payload = np.frombuffer(pickle.dumps(message), np.uint8)
    sent.append(payload)
    comm.Isend(payload, dest, tag).Free()


def answer(comm: MPI.Intracomm, asker: int, where: tuple[int, int, str],
           sent: list[np.ndarray]) -> None:
    """Tell `asker` where this rank is: ``(rank, collectives started, what it waits for)``."""
    _send(comm, where, asker, ANSWER_TAG, sent)


class StallReport:
    """One report in progress: the question is out, the answers come in through the guard."""

    def __init__(self, comm: MPI.Intracomm, rank: int, started: int, what: str,
                 waited: float, sent: list[np.ndarray]) -> None:
        self.rank, self.size = rank, comm.Get_size()
        self.started, self.what, self.waited = started, what, waited
        self.answers: dict[int, tuple[int, str]] = {}
        self.deadline = time.monotonic() + ANSWER_WINDOW_S
        for other in range(self.size):
            if other != rank:
                _send(comm, (rank,), other, QUERY_TAG, sent)

    def add(self, rank: int, started: int, what: str) -> None:
        """Note one answer."""
        self.answers[rank] = (started, what)

    def due(self) -> bool:
        """Whether every rank answered or the answer window is over."""
        return len(self.answers) == self.size - 1 or time.monotonic() >= self.deadline

    def print(self) -> None:
        """Print the report: one line on stderr."""
        sys.stderr.write(self._text() + "\n")
        sys.stderr.flush()

    def _text(self) -> str:
        same = sorted(r for r, (n, _) in self.answers.items() if n == self.started)
        elsewhere = [f"rank {r} in {w} (collective {n})"
                     for r, (n, w) in sorted(self.answers.items()) if n != self.started]
        silent = sorted(set(range(self.size)) - set(self.answers) - {self.rank})
        parts = [f"tensorplay_mpi: rank {self.rank} has waited {self.waited:.0f} s for "
                 f"{self.what} (collective {self.started} on its communicator); still waiting "
                 f"(TENSORPLAY_MPI_STALL sets when this is said)."]
        if same:
            parts.append(f"Waiting for the same collective: ranks {same}.")
        if elsewhere:
            parts.append("Waiting elsewhere: " + "; ".join(elsewhere) + ".")
        if silent:
            parts.append(f"Not in a library wait: ranks {silent} (busy in their own code, "
                         "blocked in a collective of their own, or gone).")
        return " ".join(parts + [likely_causes()])
