"""torch.optim.AdamW under uneven inputs: DDP + Join against DataParallel(..., update=).

    OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/bench_torch_adamw.py \\
        --out torch-adamw-2-ranks.json

The same MLP (float32, one thread per rank, bench_torch.py's) and ``torch.optim.AdamW`` on
both sides; rank ``r`` has ``steps + r * extra`` batches:

- ``ddp``: DistributedDataParallel over gloo in torch's ``Join([ddp])``, ``opt.step()`` in the
  loop (a joined rank skips it: torch's Join runs no user code);
- ``ours``: ``DataParallel(model.parameters(), update=opt.step)`` in ``Join([dp])`` (a joined
  rank runs the update in its shadow of every step).

Reported: the time per step of the loop (the slowest rank's, median over ABBA-interleaved
repeats) and the ratio ours / DDP; after the Join, the largest difference across ranks of the
parameters, of AdamW's moments (``exp_avg``, ``exp_avg_sq``) and of its step counts, each side.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from bench_torch import BATCH, Ddp, interleaved, make_model, start, torch_parser, train
from mpi4py import MPI

from tensorplay_mpi import DataParallel, Join

LR = 1e-3


class Ours:
    """DataParallel with ``update=opt.step``, torch.optim.AdamW, Join([dp])."""

    def __init__(self, width: int) -> None:
        self.model = make_model(width)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.dp = DataParallel(self.model.parameters(), update=self.opt.step)

    def join(self) -> Join:
        return Join([self.dp])

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.model.zero_grad()
        with self.dp.step():
            torch.nn.functional.mse_loss(self.model(x), y).backward()


def spread(comm: MPI.Intracomm, tensors: list[torch.Tensor]) -> float:
    """The largest difference of `tensors` across ranks (max over ranks minus min)."""
    flat = np.concatenate([t.detach().reshape(-1).double().numpy() for t in tensors]) \
        if tensors else np.zeros(0)
    high, low = np.empty_like(flat), np.empty_like(flat)
    comm.Allreduce(flat, high, op=MPI.MAX)
    comm.Allreduce(flat, low, op=MPI.MIN)
    return float(np.max(high - low, initial=0.0))


def divergence(comm: MPI.Intracomm, trainer) -> dict[str, float]:
    params = list(trainer.model.parameters())
    moments = [trainer.opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
    steps = [trainer.opt.state[p]["step"].reshape(-1) for p in params]
    return {"params": spread(comm, params), "optimizer_moments": spread(comm, moments),
            "optimizer_steps": spread(comm, steps),
            "steps_taken": int(trainer.opt.state[params[0]]["step"])}


def ddp_adamw(width: int) -> Ddp:
    """DDP over gloo, torch.optim.AdamW stepped in the loop, torch's Join([ddp])."""
    return Ddp(width, torch.optim.AdamW)


def main() -> None:
    parser = torch_parser(__doc__.split("\n")[0], steps=6, extra=3)
    parser.add_argument("--width", type=int, default=500, help="500: 1M parameters")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    start(comm)
    generator = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(BATCH, args.width, generator=generator)
    y = torch.randn(BATCH, args.width, generator=generator)
    uneven = args.steps + comm.rank * args.extra
    timing = interleaved(comm, lambda: train(Ours(args.width), x, y, uneven, True),
                         lambda: train(ddp_adamw(args.width), x, y, uneven, True), args.repeats)
    sides = {}
    for name, make in (("ours", Ours), ("ddp", ddp_adamw)):
        trainer = make(args.width)
        train(trainer, x, y, uneven, True)
        sides[name] = divergence(comm, trainer)
    report = {
        "ranks": comm.size, "cores": os.cpu_count(), "torch": torch.__version__,
        "params": sum(p.numel() for p in make_model(args.width).parameters()),
        "steps_by_rank": [args.steps + r * args.extra for r in range(comm.size)],
        "step": timing["step"], "ratio": "ours / DDP", "divergence_across_ranks": sides,
    }
    if comm.rank == 0:
        step = timing["step"]
        print(f"{comm.size} ranks, {report['params']:,} params, AdamW, steps by rank "
              f"{report['steps_by_rank']}: step {step['a_ms']:.1f} ms (update=) / "
              f"{step['b_ms']:.1f} ms (DDP) = {step['ratio']:.2f}")
        for name, d in sides.items():
            print(f"  {name}: across ranks, parameters differ by {d['params']:.3g}, AdamW's "
                  f"moments by {d['optimizer_moments']:.3g}, its step counts by "
                  f"{d['optimizer_steps']:.0f}; rank 0's optimizer took {d['steps_taken']} "
                  "steps", flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
