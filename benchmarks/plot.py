"""Plot the ratios of one or more bench_dp.py JSON files against their targets (one PNG)."""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label(report: dict) -> str:
    text = f"{report['ranks']} ranks"
    if report.get("async_progress"):
        text += ", async progress"
    if report.get("oversubscribed"):
        text += f" (oversubscribed on {report['cores']} cores)"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    reports = [json.load(open(path)) for path in args.reports]
    metrics = list(reports[0]["targets"])
    series = [(f"{label(r)}, {int(size):,} params", row)
              for r in reports for size, row in r["sizes"].items()]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, (name, row) in enumerate(series):
        xs = [m + (i - (len(series) - 1) / 2) * width for m in range(len(metrics))]
        ax.bar(xs, [row[m]["ratio"] for m in metrics], width, label=name)
    targets = reports[0]["targets"]
    for m, metric in enumerate(metrics):
        if targets[metric] is not None:
            ax.hlines(targets[metric], m - 0.45, m + 0.45, colors="black", linestyles="dashed")
    ax.set_xticks(range(len(metrics)), [f"{m}\n(target {targets[m] or 'none'})"
                                        for m in metrics])
    ax.set_ylabel("ratio (lower is better)")
    ax.set_title("DataParallel: ratios measured side by side (medians)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
