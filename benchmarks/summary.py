"""The round's figures as ratios against their targets, from the JSON of one `make bench` run.

    python benchmarks/summary.py benchmarks/results

Reads ``dp-2-ranks.json`` (DataParallel: a Join's cost, the reduction against raw MPI),
``optim.json`` (the optimizer steps on the NumPy rules too: the fused path forced off),
``optim-fresh.json`` when ``make bench-fresh`` wrote it (a fresh default install),
``jc-2-ranks.json`` (JoinableComm against blocking mpi4py), ``elastic-2-ranks.json`` (an
elastic Join against a plain one) and ``registry-2-ranks.json`` (the registry against raw
mpi4py); prints one line per figure, ``ok`` or ``MISSED`` against its
target.  Every ratio was measured side by side (interleaved) within its benchmark's run.
"""

import json
import sys
from pathlib import Path

OPTIMIZERS = {"adam": 1.3, "adamw": 1.3, "sgd_momentum": 1.2}
DP_FIGURES = {"join": "a step in a Join / without, even inputs",
              "reduce": "the reduction / a raw in-place Allreduce",
              "reduce_vs_manual": "the reduction / a raw Allreduce and the division",
              "overlap": "a step with mark_ready / without",
              "shadow": "a joined rank's round / the active ranks' step",
              "debug": "debug mode / without",
              "compress_bf16": "the reduction with compress='bf16' / without",
              "compress_fp16": "the reduction with compress='fp16' / without",
              "float16": "a float16 model's reduction / a float32 model's"}


def rows(results: Path) -> list[tuple[str, float, float | None]]:
    """(figure, ratio, target or None) for every result file present."""
    out: list[tuple[str, float, float | None]] = []
    for name, label in (("optim-fresh.json", "fresh default install"),
                        ("optim.json", "developer venv")):
        path = results / name
        if not path.exists():
            continue
        optim = json.loads(path.read_text())
        for step, target in OPTIMIZERS.items():
            for name, kind, goal in ((step, "", target), (f"{step}_numpy", ", fused off", None)):
                if name in optim:  # the fastest repeats' ratio: the better one under load
                    fastest = optim[name]["ratio_of_fastest"]
                    out.append((f"{step} / memory floor{kind} ({label}; fastest {fastest:.2f})",
                                optim[name]["ratio"], goal))
    path = results / "dp-2-ranks.json"
    if path.exists():
        dp = json.loads(path.read_text())
        for size, row in dp["sizes"].items():
            for figure, result in row.items():
                if "ratio" not in result:  # the bucket layout, not a figure
                    continue
                out.append((f"DataParallel {int(size) / 1e6:g}M float32, 2 ranks: "
                            f"{DP_FIGURES.get(figure, figure)}", result["ratio"],
                            dp["targets"].get(figure)))
    path = results / "jc-2-ranks.json"
    if path.exists():
        jc = json.loads(path.read_text())
        for schedule, result in jc["schedules"].items():
            for variant, target in jc["targets"].items():
                out.append((f"{variant} / blocking mpi4py, 2 ranks, {schedule}",
                            result["ratio_to_blocking"][variant], target))
    path = results / "elastic-2-ranks.json"
    if path.exists():
        elastic = json.loads(path.read_text())
        out.append((f"elastic Join / plain Join, a step, {elastic['params']:,} parameters, "
                    "2 ranks, no failure", elastic["ratio"], elastic["target"]))
    path = results / "registry-2-ranks.json"
    if path.exists():
        registry = json.loads(path.read_text())
        out.append((f"registry / raw mpi4py, {registry['ops']} operations, 2 ranks",
                    registry["ratio"], registry["target"]))
    return out


def main() -> None:
    results = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
    for figure, ratio, target in rows(results):
        verdict = "" if target is None else (" ok" if ratio <= target else " MISSED")
        goal = "" if target is None else f" (target <= {target})"
        print(f"{figure:84s} {ratio:6.3f}{goal}{verdict}")


if __name__ == "__main__":
    main()
