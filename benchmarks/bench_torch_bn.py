"""Models with BatchNorm: SyncBatchNorm with DataParallel in one Join, and what it costs.

    OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/bench_torch_bn.py \\
        --out torch-bn-2-ranks.json

An MLP of ``LAYERS`` linear layers with a ``BatchNorm1d`` after each hidden one (float32, one
thread per rank), the same batches, torch SGD through ``update=``; even inputs; every timing is
the slowest rank's time per step, the median over interleaved (ABBA) repeats:

1. ``sync_vs_ddp``: ours, SyncBatchNorm (through the Join's JoinableComm) + DataParallel in
   ``Join([dp, jc])``, against torch DDP over gloo with plain ``BatchNorm1d`` (its
   ``broadcast_buffers``), no Join.  torch's own SyncBatchNorm refuses CPU tensors ("expected
   input tensor to be on GPU"), so no torch form on the CPU synchronises the statistics: this
   is the cost of the synchronised statistics over what DDP can do here;
2. ``batchnorm_vs_ddp``: like against like, plain BatchNorm on both sides, ours in ``Join([dp])``;
3. ``stream``: ours with SyncBatchNorm in ``Join([dp, jc])`` against the same step outside any
   Join (``Join(..., enable=False)``): what the Join and its ordered stream cost on even inputs
   (with every rank active nothing is announced);
4. ``join``: the same with plain BatchNorm, ``Join([dp])`` against ``enable=False``: the Join's
   own cost, which the code before the stream had too (``stream / join`` is the stream's);
5. ``sync_cost``: ours with SyncBatchNorm against ours with plain BatchNorm, both in a Join.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import bench_torch
from bench_torch import interleaved, start, torch_parser, train
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel

from tensorplay_mpi import DataParallel, Join, JoinableComm, SyncBatchNorm

LR = 1e-3
BATCH = 64


def make_model(width: int) -> torch.nn.Module:
    return bench_torch.make_model(width, norm=True)


class Ours:
    """DataParallel with update=SGD; `sync`: SyncBatchNorm through a JoinableComm in the Join;
    `enable`: whether the Join runs its protocol."""

    def __init__(self, width: int, sync: bool, enable: bool = True) -> None:
        self.model = make_model(width)
        self.joinables: list = []
        if sync:
            self.joinables.append(JoinableComm())
            self.model = SyncBatchNorm.convert_sync_batchnorm(self.model, self.joinables[0])
        opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.dp = DataParallel(self.model.parameters(), buffers=self.model.buffers(),
                               update=opt.step)
        self.enable = enable

    def join(self) -> Join:
        return Join([self.dp, *self.joinables], enable=self.enable)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.model.zero_grad()
        with self.dp.step():
            torch.nn.functional.mse_loss(self.model(x), y).backward()


class Ddp:
    """torch DDP over gloo, plain BatchNorm (buffers broadcast from rank 0 at each forward)."""

    def __init__(self, width: int) -> None:
        self.model = make_model(width)
        self.ddp = DistributedDataParallel(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad()
        torch.nn.functional.mse_loss(self.ddp(x), y).backward()
        self.opt.step()


def bench_width(comm: MPI.Intracomm, width: int, steps: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(BATCH, width, generator=generator)
    y = torch.randn(BATCH, width, generator=generator)
    sync, plain, ddp = Ours(width, True), Ours(width, False), Ddp(width)
    sync_off, plain_off = Ours(width, True, enable=False), Ours(width, False, enable=False)
    row = {"params": sum(p.numel() for p in sync.model.parameters()), "steps": steps}
    pairs = {
        "sync_vs_ddp": (lambda: train(sync, x, y, steps, True),
                        lambda: train(ddp, x, y, steps, False)),
        "batchnorm_vs_ddp": (lambda: train(plain, x, y, steps, True),
                             lambda: train(ddp, x, y, steps, False)),
        "stream": (lambda: train(sync, x, y, steps, True),
                   lambda: train(sync_off, x, y, steps, True)),
        "join": (lambda: train(plain, x, y, steps, True),
                 lambda: train(plain_off, x, y, steps, True)),
        "sync_cost": (lambda: train(sync, x, y, steps, True),
                      lambda: train(plain, x, y, steps, True)),
    }
    for name, (a, b) in pairs.items():
        row[name] = interleaved(comm, a, b, repeats)["step"]
    return row


def main() -> None:
    parser = torch_parser(__doc__.split("\n")[0], steps=20, extra=0)
    parser.set_defaults(repeats=9)
    parser.add_argument("--widths", default="256,1024",
                        help="layer widths (256: 0.26M parameters, 1024: 4.2M)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    start(comm)
    report = {"ranks": comm.size, "cores": os.cpu_count(), "torch": torch.__version__,
              "mpi": MPI.Get_library_version().splitlines()[0].strip(),
              "ratio": "a / b per pair (module docstring)", "widths": {}}
    for width in (int(w) for w in args.widths.split(",")):
        row = report["widths"][str(width)] = bench_width(comm, width, args.steps, args.repeats)
        if comm.rank == 0:
            print(f"{comm.size} ranks, {row['params']:>9,} params: " + "  ".join(
                f"{k} {row[k]['a_ms']:.2f}/{row[k]['b_ms']:.2f} ms ({row[k]['ratio']:.3f})"
                for k in ("sync_vs_ddp", "batchnorm_vs_ddp", "stream", "join", "sync_cost")),
                flush=True)
    if comm.rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
