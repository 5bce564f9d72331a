"""``PrecisionMonitor.plot``: the exponent histograms of the hooked tensors as one picture.

Two heatmaps side by side, one row per hooked tensor: activations in forward order on the left,
gradients in backward order on the right; columns are base-2 exponents, colour the fraction of
the tensor's values in that exponent (log scale). Bands mark where float16, bfloat16 and float8
e4m3 hold values as normal numbers, so a row reaching past a band's right edge overflows that
format and a row left of it is subnormal or flushed. Needs matplotlib (imported only here)."""
import math

import torch

from . import stats as S

__all__ = ["plot_rows"]

# name -> (smallest normal exponent, largest exponent, colour)
_BANDS = {"float16": (-14, 15, "tab:orange"), "bfloat16": (-126, 127, "tab:green"),
          "float8_e4m3fn": (-6, 8, "tab:purple")}


def _matrix(rows, lo, hi):
    """Fractions per exponent in [lo, hi] for each row ([k, hi - lo + 1]; zeros and non-finite
    values left out of the picture but not of the fractions' denominator)."""
    out = torch.zeros(len(rows), hi - lo + 1, dtype=torch.float64)
    for r, row in enumerate(rows):
        hist = row[S.HIST:]
        n = max(float(row[S.NUMEL]), 1.0)
        for j in torch.nonzero(hist).flatten().tolist():
            e = S.bucket_exponent(j)
            if lo <= e <= hi:
                out[r, e - lo] = hist[j] / n
    return out


def _span(rows):
    """The exponent range the rows' values cover, widened to show float16's range."""
    lo, hi = -24, 16
    for row in rows:
        nz = torch.nonzero(row[S.HIST:]).flatten()
        if nz.numel():
            lo = min(lo, S.bucket_exponent(int(nz[0])))
            hi = max(hi, S.bucket_exponent(int(nz[-1])))
    return max(lo, S.EXP_MIN - 1), min(hi, S.EXP_MAX + 1)


def plot_rows(monitor, path):
    """Writes the picture of ``monitor``'s latest statistics to ``path``; returns path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("ampx.PrecisionMonitor.plot needs matplotlib: pip install matplotlib") from e
    table = monitor.rows()
    if not table:
        raise ValueError("ampx.PrecisionMonitor.plot: no statistics yet (they are taken every "
                         f"{monitor.every} steps; every=0 takes none)")
    raw = {k: v.detach().cpu() for k, v in monitor._rows.items()}
    sides = []
    for phase in ("forward", "backward"):
        keys = [(r["phase"], r["module"], r["tensor"]) for r in table if r["phase"] == phase]
        sides.append((phase, keys, [raw[k] for k in keys]))
    lo, hi = _span([row for _, _, rows in sides for row in rows])
    height = max(3.0, 0.28 * max(len(k) for _, k, _ in sides) + 1.5)
    fig, axes = plt.subplots(1, 2, figsize=(14, height), squeeze=False)
    for ax, (phase, keys, rows) in zip(axes[0], sides):
        title = "activations (forward order)" if phase == "forward" else "gradients (backward order, scaled)"
        ax.set_title(title)
        if not rows:
            ax.text(0.5, 0.5, "none seen", ha="center", va="center", transform=ax.transAxes)
            continue
        m = _matrix(rows, lo, hi).numpy()
        shown = [[math.log10(v) if v > 0 else float("nan") for v in line] for line in m]
        im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap="viridis",
                       extent=(lo - 0.5, hi + 0.5, len(rows) - 0.5, -0.5), vmin=-6, vmax=0)
        for name, (a, b, colour) in _BANDS.items():
            ax.axvline(a - 0.5, color=colour, lw=1.2, ls="--")
            ax.axvline(b + 0.5, color=colour, lw=1.2, label=f"{name} normal range [2^{a}, 2^{b + 1})")
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"{n}[{i}]" for _, n, i in keys], fontsize=7)
        ax.set_xlabel("base-2 exponent of |x|")
        ax.set_xlim(lo - 0.5, hi + 0.5)
        fig.colorbar(im, ax=ax, label="log10 fraction of the tensor's values")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"ampx.PrecisionMonitor: statistics of step {monitor._rows_step}")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
