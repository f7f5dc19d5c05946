"""A torch model under tensorplay_mpi DataParallel + Join and under torch DDP + Join (gloo).

    OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/bench_torch.py \\
        --out torch-2-ranks.json

The same 4-layer MLP (float32, one thread per rank), the same batches and the same SGD, in the
same processes, timed interleaved (ABBA); every timing is the slowest rank's, the median over
the repeats; each ``ratio`` is ours / DDP's (below 1: ours is faster):

1. ``no_join``: time per training step without a Join;
2. ``join``: time per step inside a Join, even inputs; ``exit``: leaving that Join;
3. ``tail``: uneven inputs (rank ``r`` has ``steps + r * extra`` batches): the time the rank
   that runs out first spends leaving the Join, shadowing the other ranks' last steps;
4. ``overlap``: ours only, step time inside a Join with post-accumulate-grad hooks calling
   ``mark_ready`` (buckets start during ``backward()``) / without (every bucket starts after);
5. ``same_parameters``: fresh models trained both ways (steps without a Join, then an uneven
   Join) end with the same parameters within float tolerance (the run fails otherwise).

``--device cuda`` puts the models and batches on the GPU (rank ``r`` on GPU ``r % GPUs``):
torch CUDA tensors through DataParallel against DDP over gloo with the same tensors; each
timing ends with ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.nn.parallel import DistributedDataParallel

from tensorplay_mpi import SGD, DataParallel, Join

LR = 1e-3
BATCH = 32
LAYERS = 4
DEVICE = torch.device("cpu")  # --device cuda: this rank's GPU


def make_model(width: int, norm: bool = False) -> torch.nn.Module:
    """``LAYERS`` square linear layers with tanh between (after a ``BatchNorm1d`` with
    `norm`): about ``LAYERS * width**2`` params."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(LAYERS):
        layers.append(torch.nn.Linear(width, width))
        if i < LAYERS - 1:
            layers += ([torch.nn.BatchNorm1d(width)] if norm else []) + [torch.nn.Tanh()]
    return torch.nn.Sequential(*layers).to(DEVICE)


class Ours:
    """tensorplay_mpi: DataParallel over the parameters, its SGD, Join([dp, opt])."""

    def __init__(self, width: int, overlap: bool = True) -> None:
        self.model = make_model(width)
        self.dp = DataParallel(self.model.parameters(), overlap=overlap)
        self.opt = SGD(self.model.parameters(), self.dp.grads, lr=LR)

    def join(self) -> Join:
        return Join([self.dp, self.opt])

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.model.zero_grad()
        with self.dp.step():
            torch.nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()


class Ddp:
    """torch: DistributedDataParallel over gloo, a torch.optim optimizer (SGD unless told)
    stepped in the loop, torch's Join([ddp])."""

    def __init__(self, width: int, optimizer: type = torch.optim.SGD) -> None:
        self.model = make_model(width)
        self.ddp = DistributedDataParallel(self.model)
        self.opt = optimizer(self.model.parameters(), lr=LR)

    def join(self) -> TorchJoin:
        return TorchJoin([self.ddp])

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad()
        torch.nn.functional.mse_loss(self.ddp(x), y).backward()
        self.opt.step()


def train(trainer, x, y, steps: int, join: bool, barrier: MPI.Intracomm | None = None
          ) -> dict[str, float]:
    """`steps` steps, inside a Join when `join`: seconds per step and seconds to leave it.

    With even inputs, the ranks meet on `barrier` (a communicator of its own) before leaving,
    so that the exit time does not count one rank's wait for another's last step."""
    context = trainer.join() if join else contextlib.nullcontext()
    start = time.perf_counter()
    context.__enter__()
    for _ in range(steps):
        trainer.step(x, y)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    stepped = time.perf_counter()
    if barrier is not None:
        barrier.Barrier()
        stepped = time.perf_counter()
    context.__exit__(None, None, None)
    return {"step": (stepped - start) / max(steps, 1), "exit": time.perf_counter() - stepped}


def interleaved(comm: MPI.Intracomm, a, b, repeats: int) -> dict[str, dict[str, float]]:
    """Run `a` and `b` (each returns named timings) in ABBA order; per timing, the medians
    of the slowest rank's values in ms and their ratio a / b."""
    runs: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for i in range(repeats):
        for name in ("ab" if i % 2 == 0 else "ba"):
            comm.Barrier()
            timings = (a if name == "a" else b)()
            runs[name].append({k: comm.allreduce(v, op=MPI.MAX) for k, v in timings.items()})
    result = {}
    for key in runs["a"][0]:
        ta = statistics.median(r[key] for r in runs["a"])
        tb = statistics.median(r[key] for r in runs["b"])
        result[key] = {"a_ms": ta * 1e3, "b_ms": tb * 1e3, "ratio": ta / tb}
    return result


def same_parameters(comm: MPI.Intracomm, width: int, x, y, steps: int, extra: int) -> dict:
    """Fresh models trained both ways: the largest difference of their parameters."""
    ours, ddp = Ours(width), Ddp(width)
    for trainer in (ours, ddp):
        train(trainer, x, y, steps, join=False)
        train(trainer, x, y, steps + comm.rank * extra, join=True)
    with torch.no_grad():
        differences = [float((a - b).abs().max() / b.abs().max())
                       for a, b in zip(ours.model.parameters(), ddp.model.parameters())]
        moved = [float((a - b).abs().max() / b.abs().max())
                 for a, b in zip(ours.model.parameters(), make_model(width).parameters())]
    worst = comm.allreduce(max(differences), op=MPI.MAX)
    return {"max_relative_difference": worst, "tolerance": 1e-4, "ok": worst <= 1e-4,
            "max_relative_change_from_the_start": min(moved)}


def bench_width(comm: MPI.Intracomm, width: int, steps: int, extra: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(BATCH, width, generator=generator).to(DEVICE)
    y = torch.randn(BATCH, width, generator=generator).to(DEVICE)
    ours, plain, ddp = Ours(width), Ours(width, overlap=False), Ddp(width)
    uneven = steps + comm.rank * extra
    barrier = comm.Dup()
    row = {"params": sum(p.numel() for p in ours.model.parameters()), "steps": steps,
           "extra": extra}
    row["no_join"] = interleaved(comm, lambda: train(ours, x, y, steps, False),
                                 lambda: train(ddp, x, y, steps, False), repeats)["step"]
    even = interleaved(comm, lambda: train(ours, x, y, steps, True, barrier),
                       lambda: train(ddp, x, y, steps, True, barrier), repeats)
    row["join"], row["exit"] = even["step"], even["exit"]
    row["tail"] = interleaved(comm, lambda: train(ours, x, y, uneven, True),
                              lambda: train(ddp, x, y, uneven, True), repeats)["exit"]
    row["overlap"] = interleaved(comm, lambda: train(ours, x, y, steps, True),
                                 lambda: train(plain, x, y, steps, True), repeats)["step"]
    row["same_parameters"] = same_parameters(comm, width, x, y, steps, extra)
    barrier.Free()
    return row


def init_gloo(comm: MPI.Intracomm) -> None:
    """torch.distributed over gloo on the MPI ranks (rank 0 picks a free local port)."""
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                            world_size=comm.size)


def torch_parser(description: str, steps: int, extra: int) -> argparse.ArgumentParser:
    """The flags the torch benchmarks share: --steps, --extra, --repeats, --out."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--extra", type=int, default=extra,
                        help="uneven inputs: rank r runs steps + r * extra batches")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    return parser


def use_device(comm: MPI.Intracomm, device: str) -> None:
    """Put the models on `device`: for ``cuda``, GPU ``rank % GPUs`` for torch and CuPy."""
    global DEVICE
    if device == "cuda":
        import cupy

        index = comm.rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        cupy.cuda.Device(index).use()
        DEVICE = torch.device("cuda", index)


def start(comm: MPI.Intracomm) -> None:
    """At least 2 ranks, one torch thread a rank, gloo set up over `comm`."""
    if comm.size < 2:
        raise SystemExit("run under mpiexec with at least 2 ranks")
    torch.set_num_threads(1)
    init_gloo(comm)


def main() -> None:
    parser = torch_parser(__doc__.split("\n")[0], steps=4, extra=2)
    parser.add_argument("--widths", default="500,2500",
                        help="layer widths (500: 1M parameters, 2500: 25M)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    start(comm)
    use_device(comm, args.device)
    report = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "ranks": comm.size,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "ratio": "ours / DDP (overlap: with hooks / without)",
        "widths": {},
    }
    ok = True
    for width in (int(w) for w in args.widths.split(",")):
        row = report["widths"][str(width)] = bench_width(comm, width, args.steps, args.extra,
                                                         args.repeats)
        ok &= row["same_parameters"]["ok"]
        if comm.rank == 0:
            print(f"{comm.size} ranks, {row['params']:>10,} params: " + "  ".join(
                f"{k} {row[k]['a_ms']:.1f}/{row[k]['b_ms']:.1f} ms ({row[k]['ratio']:.2f})"
                for k in ("no_join", "join", "exit", "tail", "overlap"))
                + f"  parameters differ by {row['same_parameters']['max_relative_difference']:.1e}",
                flush=True)
    if comm.rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    dist.destroy_process_group()
    if not ok:
        raise SystemExit("the two trainings ended with different parameters")


if __name__ == "__main__":
    main()
