"""The end of a failure program: every rank prints its outcome in rank order, then re-raises."""

import time


def report(world, error):
    """Print ``RESULT rank=R ok`` or ``RESULT rank=R Type: message`` in rank order (blocking
    barriers on COMM_WORLD, outside the library), then raise `error` again if there is one."""
    world.Barrier()  # every rank is alive here
    for rank in range(world.size):
        if rank == world.rank:
            outcome = "ok" if error is None else f"{type(error).__name__}: {error}"
            print(f"RESULT rank={rank} {outcome}", flush=True)
        world.Barrier()
    if error is not None:
        time.sleep(0.5)  # let mpiexec forward every rank's RESULT before the abort ends the job
        raise error
