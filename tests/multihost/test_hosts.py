"""What depends on the host, across simulated hosts (``make test-multihost``, which sets
``TP_TEST_HOSTS`` and ``TP_TEST_PPN`` and launches ``PPN`` ranks on each
host in block order): every rank must see its own host's value. Elsewhere (one host) these
tests skip: there is nothing to tell apart."""

import os

import pytest
from mpi4py import MPI

from tensorplay_mpi import info, _threads as threads
from tensorplay_mpi.examples.train import node_local_rank
from tensorplay_mpi._process import launch_problem
from tensorplay_mpi.testing import assert_all

HOSTS = os.environ.get("TP_TEST_HOSTS", "").split(",")
PPN = int(os.environ.get("TP_TEST_PPN", "0"))
pytestmark = pytest.mark.skipif(
    len(HOSTS) < 2 or not PPN, reason="across simulated hosts only: make test-multihost")


def expected_host(rank):
    return HOSTS[rank // PPN]  # hydra's -ppn places ranks in blocks, host by host


@pytest.mark.mpi(min_size=2)
def test_every_rank_runs_on_its_host():
    world = MPI.COMM_WORLD
    names = world.allgather(MPI.Get_processor_name())
    assert_all(world.size == len(HOSTS) * PPN
               and names == [expected_host(r) for r in range(world.size)], f"hosts {names}")


@pytest.mark.mpi(min_size=2)
def test_the_hosts_share_no_network_stack_ipc_or_shared_memory():
    world = MPI.COMM_WORLD
    mine = tuple(os.stat(path).st_ino for path in ("/proc/self/ns/net", "/proc/self/ns/ipc"))
    every = world.allgather((*mine, os.stat("/dev/shm").st_dev))
    per_host = {host: {every[r] for r in range(world.size) if expected_host(r) == host}
                for host in HOSTS}
    ok = all(len(ids) == 1 for ids in per_host.values())  # one host: one of each
    ok = ok and all(len({next(iter(ids))[k] for ids in per_host.values()}) == len(HOSTS)
                    for k in range(3))  # two hosts: two of each
    assert_all(ok, f"(net, ipc, /dev/shm) by host: {per_host}")


@pytest.mark.mpi(min_size=2)
def test_the_node_local_rank_for_the_device_is_the_rank_on_its_host():
    world = MPI.COMM_WORLD
    every = world.allgather(node_local_rank(world))
    assert_all(every == [(r % PPN, PPN) for r in range(world.size)], f"node-local {every}")


@pytest.mark.mpi(min_size=2)
def test_the_thread_limit_counts_the_ranks_of_its_own_host():
    world = MPI.COMM_WORLD
    threads.limit_threads(world, notice=False)
    cores = threads.usable_cores()
    why = threads.decision()
    expected = f"{max(1, cores // PPN)} per rank ({cores} usable cores // {PPN} ranks on this node"
    assert_all(why.startswith(expected), f"rank {world.rank}: {why!r}, expected {expected!r}...")


@pytest.mark.mpi(min_size=2)
def test_the_info_report_has_every_rank_on_its_host():
    world = MPI.COMM_WORLD
    rows = world.allgather(info.rank_facts())
    text = info.report()
    hosts = [(row["rank"], row["host"]) for row in rows]
    ok = hosts == [(r, expected_host(r)) for r in range(world.size)]
    if world.rank == 0:
        ok = ok and all(any(line.split()[:2] == [str(r), expected_host(r)]
                            for line in text.splitlines()) for r in range(world.size))
    assert_all(ok, f"rows {hosts}; report:\n{text}")


@pytest.mark.mpi(min_size=2)
def test_a_launch_across_hosts_passes_the_launch_check():
    assert_all(launch_problem() is None, f"rank {MPI.COMM_WORLD.rank}: {launch_problem()}")
