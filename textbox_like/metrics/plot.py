"""Training curves: ``python -m textbox_like.metrics.plot RUN_DIR [RUN_DIR...] [-o FILE.png]``.

Reads each run's ``metrics.jsonl`` (what ``--save-dir`` holds) and draws the
training metrics (loss, and accuracy where the task reports it) and every
validation metric against updates, one panel per metric, several runs
overlaid in one colour each and named by their directory. Training is a thin
solid line, validation a dashed line with markers. A metric spanning more than
an order and a half (perplexity) gets a log scale; otherwise the y-axis fits
the validation values and the training values after the run's first tenth, so
the steep start of the loss does not flatten the rest.

One run: written to ``RUN_DIR/curves.png`` unless ``-o`` says otherwise;
several: ``-o`` or ``./curves.png``. The trainer calls :func:`plot_runs` at the
end of every run, which never raises.

matplotlib is used through its Agg canvas directly (no pyplot, no global
backend switch), so calling this inside another program changes nothing there.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from textbox_like.core.errors import UserError, first_line
from textbox_like.storage.fileio import atomic_write

# keys of a log record that are not metrics to plot against updates
NOT_METRICS = {"kind", "epoch", "update", "updates", "wall", "samples", "num_updates", "lr", "gnorm"}
NOT_METRIC_SUFFIXES = ("_per_s", "_s", "_time", "_seconds", "eta", "_mb", "_bytes", "_per_update", "_per_rank")

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
          "#7f7f7f", "#bcbd22"]
SUBSET_MARKERS = ["o", "s", "^", "D", "v", "P", "X"]
SUBSET_STYLES = ["--", ":", "-.", (0, (5, 1, 1, 1))]


def _is_metric(key, value):
    if key in NOT_METRICS or key.endswith(NOT_METRIC_SUFFIXES):
        return False
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_metrics(run_dir):
    """The records of RUN_DIR/metrics.jsonl, last one kept per (kind, update).

    UserError naming the problem when the directory, the file or a line is bad."""
    run = Path(run_dir)
    if not run.exists():
        raise UserError(f"run directory {str(run)!r} does not exist; give a run's --save-dir")
    if not run.is_dir():
        raise UserError(f"{str(run)!r} is not a directory; give a run's --save-dir")
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{str(run)!r} holds no metrics.jsonl; give the --save-dir of a run that logged")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {str(path)!r}: {getattr(exc, 'strerror', None) or exc}") from None
    records = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{str(path)!r} line {number} is not valid JSON ({exc.msg}); "
                            f"the file is damaged: remove that line") from None
        if not isinstance(record, dict) or not isinstance(record.get("kind"), str) \
                or not isinstance(record.get("update"), (int, float)):
            raise UserError(f"{str(path)!r} line {number} is not a log record "
                            f"(an object with 'kind' and 'update'); the file is damaged: remove that line")
        records[(record["kind"], record["update"])] = record   # a repeat (end-of-run validation) replaces
    if not records:
        raise UserError(f"{str(path)!r} is empty: the run has logged nothing yet")
    return sorted(records.values(), key=lambda r: r["update"])


def series(records):
    """{(panel metric, source): ([updates], [values])} where source is 'train'
    or a validation subset ('' when the run validates one subset)."""
    out = {}

    def add(metric, source, update, value):
        xs, ys = out.setdefault((metric, source), ([], []))
        xs.append(update)
        ys.append(float(value))

    train = [r for r in records if r["kind"] == "train"] or [r for r in records if r["kind"] == "train_epoch"]
    for record in train:   # the loss, and whatever else the task reports in training (MNIST: accuracy)
        for key, value in record.items():
            if _is_metric(key, value):
                add(key, "train", record["update"], value)
    for record in records:
        kind = record["kind"]
        if kind != "valid" and not kind.startswith("valid_"):
            continue
        subset = kind[len("valid_"):] if kind.startswith("valid_") else ""
        for key, value in record.items():
            if _is_metric(key, value):
                add(key, subset, record["update"], value)
    return out


def run_names(run_dirs):
    """Directory names, with parents added until they are unique."""
    paths = [Path(os.path.abspath(d)) for d in run_dirs]
    depth = 1
    while True:
        names = ["/".join(p.parts[-depth:]) or str(p) for p in paths]
        if len(set(names)) == len(names) or depth >= max(len(p.parts) for p in paths):
            return names
        depth += 1


def _panel_order(metrics):
    """loss first, then the others in the order they first appear."""
    return sorted(metrics, key=lambda m: (m != "loss", metrics.index(m)))


def _label_ends(ax, ends):
    """Write each validation curve's last value beside its end, moved apart
    vertically where labels would overlap."""
    ax.get_ylim()                      # settle the autoscaled limits before converting to pixels
    dpi = ax.figure.dpi
    spacing = 11 * dpi / 72            # pixels between label centres (8 pt text)
    placed = []
    for x, y, color in sorted(ends, key=lambda e: ax.transData.transform((e[0], e[1]))[1]):
        pixel_y = ax.transData.transform((x, y))[1]
        target = max(pixel_y, placed[-1] + spacing) if placed else pixel_y
        placed.append(target)
        ax.annotate(f"{y:.4g}", (x, y), xytext=(6, (target - pixel_y) * 72 / dpi), textcoords="offset points",
                    fontsize=8, color=color, va="center")


def _fitted_ylim(ax, fit):
    """Limits around ``fit`` (the values the axis must show) with a margin."""
    low, high = min(fit), max(fit)
    pad = 0.08 * (high - low) or 0.05 * abs(high) or 0.1
    ax.set_ylim(low - pad, high + pad)


def _settling_cutoff(xs, x_low, x_span):
    """Training values before this update are left out of the y-range: the
    first tenth of the run, where the loss falls steeply from its start
    (the curve still runs there, off the top of the axis)."""
    cutoff = x_low + 0.1 * x_span
    return cutoff if sum(x >= cutoff for x in xs) >= 3 else -math.inf


def plot(run_dirs, output):
    """Draw the runs' curves into OUTPUT (a .png); UserError on bad input."""
    fig = draw(run_dirs)
    output = Path(output)
    if output.parent and not output.parent.is_dir():
        raise UserError(f"cannot write {str(output)!r}: directory {str(output.parent)!r} does not exist")
    try:
        atomic_write(output, lambda handle: fig.savefig(handle, format="png"))
    except OSError as exc:
        raise UserError(f"cannot write {str(output)!r} ({exc.strerror or exc})") from None
    return output


def draw(run_dirs):
    """The matplotlib Figure of the runs' curves; UserError on bad input."""
    if not run_dirs:
        raise UserError("give at least one run directory")
    runs = [(name, series(read_metrics(d))) for name, d in zip(run_names(run_dirs), run_dirs)]
    metrics = []
    for _, data in runs:
        for metric, _ in data:
            if metric not in metrics:
                metrics.append(metric)
    if not metrics:
        raise UserError(f"no loss or validation metric to plot in {', '.join(map(str, run_dirs))}")
    metrics = _panel_order(metrics)
    subsets = []
    for _, data in runs:
        for _, source in data:
            if source != "train" and source not in subsets:
                subsets.append(source)
    many_subsets = len(subsets) > 1
    updates = [x for _, data in runs for xs, _ in data.values() for x in xs]
    x_low, x_high = min(updates), max(updates)
    x_span = (x_high - x_low) or 1

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    ncols = min(len(metrics), 3)
    nrows = math.ceil(len(metrics) / ncols)
    fig = Figure(figsize=(4.6 * ncols, 3.4 * nrows + 0.6), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    for ax, metric in zip(axes, metrics):
        ends, fit = [], []   # fit: the values the y-axis must show
        for index, (name, data) in enumerate(runs):
            color = COLORS[index % len(COLORS)]
            for (m, source), (xs, ys) in data.items():
                if m != metric:
                    continue
                finite = [y for y in ys if math.isfinite(y)]
                if source == "train":
                    ax.plot(xs, ys, color=color, linewidth=1.3, alpha=0.85)
                    cutoff = _settling_cutoff(xs, x_low, x_span)
                    fit += [y for x, y in zip(xs, ys) if x >= cutoff and math.isfinite(y)]
                else:
                    k = subsets.index(source)
                    ax.plot(xs, ys, color=color, linewidth=1.6, linestyle=SUBSET_STYLES[k % len(SUBSET_STYLES)],
                            marker=SUBSET_MARKERS[k % len(SUBSET_MARKERS)], markersize=4.5)
                    fit += finite
                    if finite and math.isfinite(ys[-1]):
                        ends.append((xs[-1], ys[-1], color))
        if fit and min(fit) > 0 and max(fit) / min(fit) > 30:
            ax.set_yscale("log")
            ax.margins(y=0.08)
        elif fit:
            _fitted_ylim(ax, fit)
        sources = {source for _, data in runs for (m, source) in data if m == metric}
        ax.set_title(metric if "train" in sources else f"valid {metric}", fontsize=11)
        ax.set_xlabel("updates", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=8)
        ax.set_xlim(x_low - 0.04 * x_span, x_high + 0.12 * x_span)   # the same updates axis in every panel
        if len(ends) <= 4:
            _label_ends(ax, ends)
    handles = [Line2D([], [], color=COLORS[i % len(COLORS)], linewidth=2.5, label=name)
               for i, (name, _) in enumerate(runs)]
    if any(source == "train" for _, data in runs for _, source in data):
        handles.append(Line2D([], [], color="0.35", linewidth=1.3, label="train"))
    handles += [Line2D([], [], color="0.35", linewidth=1.6, linestyle=SUBSET_STYLES[k % len(SUBSET_STYLES)],
                       marker=SUBSET_MARKERS[k % len(SUBSET_MARKERS)], markersize=4.5,
                       label=f"valid {s}" if many_subsets else "valid")
                for k, s in enumerate(subsets)]
    ncol = min(len(handles), 6)
    fig.legend(handles=handles, loc="upper center", ncol=ncol, fontsize=9, frameon=False)
    height = 3.4 * nrows + 0.6
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.15 + 0.25 * math.ceil(len(handles) / ncol)) / height))
    return fig


def plot_runs(run_dirs, output):
    """For the trainer: plot(run_dirs, output); True if written, False (and one
    line on stderr) on any failure. Never raises."""
    try:
        plot([run_dirs] if isinstance(run_dirs, (str, os.PathLike)) else list(run_dirs), output)
        return True
    except Exception as exc:  # noqa: BLE001 - a failed plot must never end a training run
        message = first_line(exc)
        print(f"warning: curves not written to {output}: {message}", file=sys.stderr)
        return False


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m textbox_like.metrics.plot", allow_abbrev=False,
        description="Plot training loss and every validation metric against updates for one or more runs.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's --save-dir (holds metrics.jsonl)")
    parser.add_argument("-o", "--output", default=None,
                        help="PNG to write (default: RUN_DIR/curves.png for one run, ./curves.png for several)")
    args = parser.parse_args(argv)
    output = args.output or (Path(args.run_dirs[0]) / "curves.png" if len(args.run_dirs) == 1 else "curves.png")
    try:
        written = plot(args.run_dirs, output)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
