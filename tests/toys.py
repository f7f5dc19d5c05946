"""Toy joinables for the tests (PyTorch's test_join.py AllReducer, over MPI)."""

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import Join, Joinable, JoinHook
from tensorplay_mpi.comm import iallreduce, ibcast

BEFORE_CONSTANT = 41
AFTER_CONSTANT = 42


def reduce(comm, value, op=MPI.SUM, dtype=np.int64):
    """One library allreduce of a scalar (start, then wait), returned as a Python number."""
    buf = np.array([value], dtype=dtype)
    iallreduce(comm, MPI.IN_PLACE, buf, op).wait()
    return buf[0].item()


class AllReducerHook(JoinHook):
    def __init__(self, allreducer, num_allreduces, run_post_hooks):
        self.allreducer = allreducer
        self.num_allreduces = num_allreduces
        self.run_post_hooks = run_post_hooks

    def main_hook(self):
        self.allreducer.main_rounds += 1
        self.allreducer.notify_in_hook = Join.notify_join_context(self.allreducer)
        for _ in range(self.num_allreduces):
            reduce(self.allreducer.comm, 0)

    def post_hook(self, is_last_joiner):
        self.allreducer.post_hooks.append(is_last_joiner)
        if not self.run_post_hooks:
            return
        comm = self.allreducer.comm
        common_rank = reduce(comm, comm.rank if is_last_joiner else -1, MPI.MAX)
        assert common_rank >= 0, "no last joiner"
        if comm.rank == common_rank:
            self.allreducer.post_hook_value = AFTER_CONSTANT
        buf = np.array([self.allreducer.post_hook_value], dtype=np.int64)
        ibcast(comm, buf, common_rank).wait()
        self.allreducer.post_hook_value = int(buf[0])


class AllReducer(Joinable):
    """Each call: heartbeat, then `num_allreduces` allreduces of 1; returns their sum."""

    def __init__(self, comm, num_allreduces=1):
        super().__init__()
        self.comm = comm
        self.num_allreduces = num_allreduces
        self.main_rounds = 0
        self.post_hooks = []
        self.hook_kwargs = None
        self.notify_in_hook = "never called"
        self.post_hook_value = BEFORE_CONSTANT
        self.heartbeats = []

    def __call__(self, keep_heartbeat=True):
        work = Join.notify_join_context(self)
        if keep_heartbeat:
            self.heartbeats.append(work)
        return sum(reduce(self.comm, 1) for _ in range(self.num_allreduces))

    def join_hook(self, **kwargs):
        self.hook_kwargs = kwargs
        return AllReducerHook(self, kwargs.get("num_allreduces", self.num_allreduces),
                              kwargs.get("run_post_hooks", False))

    @property
    def join_device(self):
        return "cpu"

    @property
    def join_process_group(self):
        return self.comm


class NoInit(Joinable):
    """A joinable whose constructor forgets Joinable.__init__."""

    def __init__(self, comm):  # noqa: D107 - deliberately no super().__init__()
        self.comm = comm

    def join_hook(self, **kwargs):
        return JoinHook()

    @property
    def join_device(self):
        return "cpu"

    @property
    def join_process_group(self):
        return self.comm


def run(joinables, num_inputs, **join_kwargs):
    """Each rank's loop: every input calls every joinable once; returns the sum of results."""
    total = 0
    with Join(joinables, **join_kwargs):
        for _ in range(num_inputs):
            total += sum(joinable() for joinable in joinables)
    return total


class Stepper:
    """``update=`` in an elastic Join: a bound method of the owner of the state it advances
    (the library's optimizer is made after the DataParallel, from its ``dp.grads``: set
    ``opt`` then)."""

    opt = None

    def step(self):
        self.opt.update()

    def state_dict(self):
        return self.opt.state_dict()

    def load_state_dict(self, state_dict):
        self.opt.load_state_dict(state_dict)
