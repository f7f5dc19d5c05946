"""Every rank raises at a protocol point of its own: a wrong number is never the outcome.

tests/programs/failure_points.py makes rank 0 raise before library collective FIRST and the
other ranks before collective OTHERS, then tries a follow-up Join on the same communicator.
Whatever the points, each rank ends with its own exception (or a PeerFailureError), and the
follow-up is exact on every rank exactly when every rank raised its own exception at the same
point; otherwise it refuses, on every rank, because the communicator is unusable.  Within 30 s.
"""

import re

import pytest
from helpers import PROGRAMS, results

from tensorplay_mpi.testing import run_mpi

PROGRAM = str(PROGRAMS / "failure_points.py")
_OWN = re.compile(r"KeyError: 'injected on rank \d+ before collective (\d+) ")


def collectives(nprocs):
    result = run_mpi(nprocs, [PROGRAM, "count"], timeout=60)
    assert result.returncode == 0, result.stderr
    return int(re.search(r"COLLECTIVES (\d+)", result.stdout).group(1))


def check(nprocs, first, others):
    result = run_mpi(nprocs, [PROGRAM, str(first), str(others)], timeout=30)
    caught, followups = results(result.stdout), results(result.stdout, "FOLLOWUP")
    context = (first, others, result.stdout, result.stderr[-3000:])
    assert sorted(caught) == sorted(followups) == list(range(nprocs)), context
    points = {m.group(1) if (m := _OWN.match(text)) else None for text in caught.values()}
    for text in caught.values():
        assert _OWN.match(text) or text.startswith("PeerFailureError: "), context
    if len(points) == 1 and None not in points:  # every rank failed on its own, at one point
        for text in followups.values():
            total, expected = re.fullmatch(r"total=(\d+) expected=(\d+)", text).groups()
            assert total == expected, context
    else:
        for text in followups.values():
            assert text.startswith("RuntimeError: ") and "unusable" in text, context


@pytest.mark.slow  # every neighbouring pair of failure points (~100 s with the next)
@pytest.mark.parametrize("nprocs", [2])
def test_every_pair_of_neighbouring_points_at_two_ranks(nprocs):
    for point in range(collectives(nprocs)):
        check(nprocs, point, point)
        check(nprocs, point, point + 1)


@pytest.mark.slow
@pytest.mark.parametrize("nprocs", [3, 4])
def test_sampled_points_at_more_ranks(nprocs):
    total = collectives(nprocs)
    for point in range(1, total, max(1, total // 6)):
        check(nprocs, point, point)
        check(nprocs, point + 1, point)
