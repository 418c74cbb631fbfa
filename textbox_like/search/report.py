"""Statistics (scipy.stats) and the reports people read: tables, CSV files and
PNG figures (matplotlib, Agg backend)."""
from __future__ import annotations

import contextlib
import csv
import io
import math
from pathlib import Path

from textbox_like.storage.fileio import atomic_write, atomic_write_text
from textbox_like.search.trials import read_jsonl


# ====================================================================== statistics
def describe(values, confidence=0.95):
    """n, mean, std (ddof=1), min, max, median and the t-interval of the mean."""
    import numpy as np
    from scipy import stats
    values = np.asarray([float(v) for v in values], dtype=float)
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None, "median": None,
                "ci95": None, "ci95_half_width": None}
    mean = float(np.mean(values))
    std = half = ci = None
    if n > 1:
        std = float(np.std(values, ddof=1))
        sem = float(stats.sem(values))
        if sem > 0:
            low, high = stats.t.interval(confidence, n - 1, loc=mean, scale=sem)
            ci = [float(low), float(high)]
        else:
            ci = [mean, mean]
        half = (ci[1] - ci[0]) / 2
    return {"n": n, "mean": mean, "std": std, "min": float(values.min()), "max": float(values.max()),
            "median": float(np.median(values)), "ci95": ci, "ci95_half_width": half}


def summarize_runs(results):
    """{'final': {metric: describe}, 'best': {...}} over a list of results dicts."""
    out = {}
    for part in ("final", "best"):
        names = []
        for r in results:
            for name in (r.get(part) or {}):
                if name not in names:
                    names.append(name)
        out[part] = {name: describe([r[part][name] for r in results
                                     if isinstance((r.get(part) or {}).get(name), (int, float))
                                     and not isinstance(r[part][name], bool)])
                     for name in names}
    return out


# ====================================================================== formatting
def fmt(value, digits=4):
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}f}"
    return str(value)


def format_params(params):
    return " ".join(f"{k}={fmt(v, 4) if isinstance(v, float) else v}" for k, v in params.items())


def text_table(header, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(header)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


# ====================================================================== search reports
def search_rows(records, names, best_trial):
    rows = []
    for r in records:
        params = r.get("params") or {}
        rows.append([("*" if r["trial"] == best_trial else " ") + str(r["trial"]),
                     *(fmt(params.get(n)) if isinstance(params.get(n), float) else str(params.get(n, "-"))
                       for n in names),
                     fmt(r.get("value")), r.get("status", "-"),
                     f"{r['wall_time']:.1f}" if isinstance(r.get("wall_time"), (int, float)) else "-"])
    return rows


def search_table(records, names, metric, best_trial):
    header = ["trial", *names, metric, "status", "wall_s"]
    return text_table(header, search_rows(records, names, best_trial)) + \
        ("\n(* best)" if best_trial is not None else "")


@contextlib.contextmanager
def csv_file(path):
    """A CSV written in memory, then to ``path`` at once (atomic, synced)."""
    buffer = io.StringIO(newline="")
    yield buffer
    atomic_write_text(path, buffer.getvalue())


def write_search_csv(path, records, names, metric):
    with csv_file(path) as handle:
        w = csv.writer(handle)
        w.writerow(["trial", *names, metric, "status", "wall_time", "num_updates", "returncode", "error",
                    "save_dir"])
        for r in records:
            params = r.get("params") or {}
            w.writerow([r["trial"], *(params.get(n, "") for n in names), "" if r.get("value") is None
                        else r["value"], r.get("status", ""), r.get("wall_time", ""), r.get("num_updates", ""),
                        r.get("returncode", ""), r.get("error", ""), r.get("save_dir", "")])


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def search_png(path, records, space, metric, maximize):
    """Objective per trial with the best-so-far line; objective against each parameter."""
    plt = _plt()
    names = list(space)
    n = 1 + len(names)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
    axes = axes.ravel()
    ok = [r for r in records if r.get("value") is not None]
    direction = "higher is better" if maximize else "lower is better"
    ax = axes[0]
    if ok:
        xs = [r["trial"] for r in ok]
        ys = [r["value"] for r in ok]
        colors = ["tab:orange" if r.get("status") == "stopped" else "tab:blue" for r in ok]
        ax.scatter(xs, ys, c=colors, zorder=3,
                   label="trial" + (" (orange: stopped early)" if "tab:orange" in colors else ""))
        best, steps_x, steps_y = None, [], []
        for r in sorted(records, key=lambda r: r["trial"]):
            v = r.get("value")
            if v is not None and r.get("status") == "ok" and (best is None or (v > best if maximize else v < best)):
                best = v
            if best is not None:
                steps_x.append(r["trial"])
                steps_y.append(best)
        if steps_x:
            ax.step(steps_x, steps_y, where="post", color="tab:green", lw=2, label="best so far")
    failed = [r["trial"] for r in records if r.get("value") is None]
    for i, t in enumerate(failed):
        ax.axvline(t, color="tab:red", ls=":", lw=1, label="failed" if i == 0 else None)
    ax.set_xlabel("trial")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per trial ({direction})")
    ax.grid(alpha=0.3)
    if records:
        ax.legend(fontsize=8)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax, name in zip(axes[1:], names):
        p = space[name]
        pts = [(r["params"].get(name), r["value"]) for r in ok if name in (r.get("params") or {})]
        pc = ["tab:orange" if r.get("status") == "stopped" else "tab:blue" for r in ok
              if name in (r.get("params") or {})]
        label = p.label or name
        if p.kind in ("choice", "pchoice") or any(not isinstance(x, (int, float)) or isinstance(x, bool)
                                                   for x, _ in pts):
            cats = [str(v) for v in p.values()]
            for x, _ in pts:
                if str(x) not in cats:
                    cats.append(str(x))
            ax.scatter([cats.index(str(x)) for x, _ in pts], [y for _, y in pts], c=pc, zorder=3)
            ax.set_xticks(range(len(cats)))
            ax.set_xticklabels(cats, rotation=30 if max((len(c) for c in cats), default=0) > 6 else 0)
            ax.set_xlim(-0.5, len(cats) - 0.5)
        else:
            ax.scatter([x for x, _ in pts], [y for _, y in pts], c=pc, zorder=3)
            if p.kind in ("loguniform", "qloguniform", "lognormal", "qlognormal") and pts and \
                    all(x > 0 for x, _ in pts):
                ax.set_xscale("log")
        ax.set_xlabel(f"{label} ({p.kind})")
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} vs {label}")
        ax.grid(alpha=0.3)
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.tight_layout()
    atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=100))
    plt.close(fig)


# ====================================================================== seed reports
def seed_table(stats):
    header = ["part", "metric", "n", "mean", "std", "95% CI", "min", "median", "max"]
    rows = []
    for part in ("final", "best"):
        for name, s in stats[part].items():
            ci = f"[{fmt(s['ci95'][0])}, {fmt(s['ci95'][1])}]" if s["ci95"] else "-"
            rows.append([part, name, s["n"], fmt(s["mean"]), fmt(s["std"]), ci, fmt(s["min"]), fmt(s["median"]),
                         fmt(s["max"])])
    return text_table(header, rows)


def write_seed_csv(path, stats):
    with csv_file(path) as handle:
        w = csv.writer(handle)
        w.writerow(["part", "metric", "n", "mean", "std", "ci95_low", "ci95_high", "min", "median", "max"])
        for part in ("final", "best"):
            for name, s in stats[part].items():
                ci = s["ci95"] or ["", ""]
                w.writerow([part, name, s["n"], *("" if s[k] is None else s[k] for k in ("mean", "std")), *ci,
                            *("" if s[k] is None else s[k] for k in ("min", "median", "max"))])


def curves(save_dirs, kind_prefix, metric):
    """{update: [values across runs]} of one metric from each run's metrics.jsonl."""
    table = {}
    for d in save_dirs:
        seen = {}
        for rec in read_jsonl(Path(d) / "metrics.jsonl"):
            kind = rec.get("kind", "")
            if (kind == kind_prefix or (kind_prefix == "valid" and kind.startswith("valid_"))) and \
                    isinstance(rec.get(metric), (int, float)) and "update" in rec:
                seen[rec["update"]] = rec[metric]        # last one wins (a resumed run repeats none)
        for update, value in seen.items():
            table.setdefault(update, []).append(value)
    return table


def band(table, n_runs):
    """updates, mean, low, high over the updates every run logged."""
    from scipy import stats
    import numpy as np
    xs, mean, low, high = [], [], [], []
    for update in sorted(table):
        values = table[update]
        if len(values) < n_runs:
            continue
        m = float(np.mean(values))
        if len(values) > 1 and float(np.std(values)) > 0:
            lo, hi = stats.t.interval(0.95, len(values) - 1, loc=m, scale=stats.sem(values))
        else:
            lo = hi = m
        xs.append(update)
        mean.append(m)
        low.append(float(lo))
        high.append(float(hi))
    return xs, mean, low, high


def seed_png(path, save_dirs, metric, seeds):
    """Training loss and the validation metric over updates: mean and 95% band across seeds."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    n = len(save_dirs)
    for ax, (kind, name, title) in zip(axes, (("train", "loss", "training loss"),
                                               ("valid", metric, f"validation {metric}"))):
        table = curves(save_dirs, kind, name)
        xs, mean, low, high = band(table, n)
        for d in save_dirs:           # each seed, thin
            one = curves([d], kind, name)
            ux = sorted(one)
            ax.plot(ux, [one[u][0] for u in ux], color="gray", lw=0.7, alpha=0.5)
        if xs:
            ax.plot(xs, mean, color="tab:blue", lw=2, marker="o" if len(xs) < 30 else None, ms=3,
                    label=f"mean of {n} seeds")
            ax.fill_between(xs, low, high, color="tab:blue", alpha=0.25, label="95% t-interval")
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no values logged by every seed", ha="center", va="center", transform=ax.transAxes)
        from matplotlib.ticker import MaxNLocator
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("update")
        ax.set_ylabel(name)
        ax.set_title(f"{title} over updates (gray: each seed)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{n} seeds: {', '.join(map(str, seeds))}", fontsize=10)
    fig.tight_layout()
    atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=100))
    plt.close(fig)
