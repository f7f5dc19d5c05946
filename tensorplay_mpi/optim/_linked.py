"""What the library's optimizers share: the link to the DataParallel whose gradients they step
with (``dp.grads``), wired once here for the local optimizers and ZeroRedundancyOptimizer."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from ..algorithms.join import Join, Joinable, JoinHook
from ..parallel._gradient_link import GradientViews, PlaceCheck, comm_of, used_of


class LinkedOptimizer(Joinable):
    """A Joinable optimizer stepping with gradients that a DataParallel may write.

    A subclass calls :meth:`_link_grads` first in its constructor and :meth:`_step_with_link`
    once it is built; :meth:`end_iteration` then checks its place in every Join.
    """

    _needs_writer = True
    """Whether it needs, in a Join, a joinable before it that writes its gradients even
    without a link (a local optimizer: yes; a ZeroRedundancyOptimizer alone in a Join, with
    gradients of its own: no)."""

    _link: GradientViews | None = None

    def _link_grads(self, grads: Sequence[Any], comm: MPI.Intracomm | None) -> MPI.Intracomm:
        """Note the DataParallel that `grads` (``dp.grads``) belongs to, if any; return the
        communicator to use: `comm`, else that DataParallel's, else the default one."""
        self._link = GradientViews.of(grads)
        self._place_check = PlaceCheck()
        return comm_of(self._link) if comm is None else comm

    def _step_with_link(self, must_join: bool) -> None:
        """Tell the linked DataParallel that this optimizer steps with its gradients (it then
        checks its Joins for this one: in them at all when `must_join`)."""
        if self._link is not None:
            self._link.step_with(self, must_join=must_join)

    def _used(self) -> np.ndarray | None:
        """``dp.used`` of the linked DataParallel (the parameters with a gradient), else None."""
        return used_of(self._link)

    def _shadow_step(self) -> None:
        """What a joined rank's hook runs for one round of the active ranks' steps."""
        raise NotImplementedError

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _ShadowStep(self)

    def end_iteration(self) -> None:
        """Check, on every rank, that the joinable writing the gradients comes first."""
        if self._link is not None or self._needs_writer:
            join: Join | None = self.join_context
            self._place_check(join, self, self._link, must_join=False)


class _ShadowStep(JoinHook):
    def __init__(self, optimizer: LinkedOptimizer) -> None:
        self.optimizer = optimizer

    def main_hook(self) -> None:
        self.optimizer._shadow_step()
