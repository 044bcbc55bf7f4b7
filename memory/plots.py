"""Plots of memory timelines: stacked categories, phase bands, the reserved line and the limit.

python -m memory.plots timeline.png [--steps 3 --batch 2048]  # memory_timeline's demo, drawn
"""

import sys

import numpy as np

from memory import memory_timeline
from memory.memory_timeline import CATEGORIES, COLORS, PHASE_COLORS, MiB

EVENTS_XLABEL = "allocation events (one per allocation or free, evenly spaced)"
TIME_XLABEL = "seconds while recording (includes the recorder's own overhead)"


def plot_timeline(tl, ax=None, title=None, show_reserved=True, legend=True, ymax=None, x="events"):
    """Stacked area by category, phase bands, step boundaries, the reserved line(s), the limit.

    x="events" (default) spaces allocations and frees evenly, as PyTorch's memory viz does, so a
    spike that lasts a microsecond is as visible as a plateau; x="time" uses seconds while recording
    (which include the recorder's own overhead). A run that ran out of its simulated budget gets the
    failed allocation marked with an X above the last event."""
    import matplotlib.pyplot as plt

    tl._check_done()
    if x not in ("events", "time"):
        raise ValueError(f"x must be 'events' or 'time', got {x!r}")
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 4.2))
    xs = np.arange(tl.num_events) if x == "events" else tl.times

    def at(i):  # x position of event index i (phase boundaries are event indices)
        return xs[min(i, tl.num_events - 1)] if x == "time" else i

    ax.stackplot(
        xs,
        *[tl.bytes[c] / MiB for c in CATEGORIES],
        labels=CATEGORIES,
        colors=[COLORS[c] for c in CATEGORIES],
        step="post",
        linewidth=0,
    )
    total = tl.series() / MiB
    ax.plot(xs, total, color="k", lw=0.6, label="allocated (recorded)", drawstyle="steps-post")
    seen_steps = set()
    for name, step, a, b, _, _ in tl.phases:
        ax.axvspan(at(a), at(b), color=PHASE_COLORS.get(name, "#f2f2f2"), zorder=-1, lw=0)
        if step not in seen_steps:
            seen_steps.add(step)
            ax.axvline(at(a), color="0.35", lw=0.9, ls=":")
            ax.text(
                at(a),
                1.0,
                f" step {step}",
                transform=ax.get_xaxis_transform(),
                va="bottom",
                fontsize=10,
                color="0.2",
            )
    top = max(total.max(), tl.reserved_model.max() / MiB if show_reserved else 0)
    if show_reserved:
        ax.plot(
            xs,
            tl.reserved_model / MiB,
            color="k",
            lw=1.2,
            ls="--",
            label="reserved (modelled CUDA allocator)",
            drawstyle="steps-post",
        )
        if tl.cuda_reserved is not None:
            where = tl.device.type
            ax.plot(
                xs,
                tl.cuda_allocated / MiB,
                color="0.25",
                lw=1.2,
                drawstyle="steps-post",
                label=f"allocated ({where}, measured)",
            )
            ax.plot(
                xs,
                tl.cuda_reserved / MiB,
                color="0.55",
                lw=1.5,
                drawstyle="steps-post",
                label=f"reserved ({where}, measured)",
            )
            top = max(top, tl.cuda_reserved.max() / MiB)
    if tl.limit_bytes is not None:
        limit = tl.limit_bytes / MiB
        ax.axhline(limit, color="red", lw=1.3, ls="-.", label=f"memory limit ({limit:.0f} MiB)")
        top = max(top, limit)
    x_end = xs[-1]
    oom = tl.out_of_memory
    if oom is not None:
        x_end = oom.event if x == "events" else xs[-1]
        # where modelled reserved memory would have gone: the new segment crosses the limit
        y0, y = oom.reserved / MiB, oom.reserved_needed / MiB
        ax.plot([x_end, x_end], [y0, y], color="red", lw=1.2, ls=":")
        ax.plot([x_end], [y], "X", color="red", ms=12, mec="k", label="simulated out of memory")
        ax.annotate(
            f"step {oom.step} {oom.phase}: a new {(y - y0):.0f} MiB segment would\n"
            f"reserve {y:.0f} MiB, over the {tl.limit_bytes / MiB:.0f} MiB limit",
            (x_end, y),
            xytext=(-14, 0),
            textcoords="offset points",
            ha="right",
            va="center",
            fontsize=10,
            color="darkred",
        )
        top = max(top, y)
    ax.set_xlabel(EVENTS_XLABEL if x == "events" else TIME_XLABEL, fontsize=10)
    ax.set_ylabel("memory (MiB)", fontsize=10)
    ax.set_xlim(xs[0], x_end + (0.02 * x_end if oom is not None else 0))
    ax.set_ylim(0, ymax if ymax is not None else top * 1.1)
    ax.tick_params(labelsize=10)
    ax.set_title(
        title if title is not None else (tl.name or "memory timeline"), pad=18, fontsize=11
    )
    if legend:
        ax.legend(
            handles=_legend_handles([ax], [tl]),
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize=10,
            framealpha=0.9,
        )
    return ax


def _legend_handles(axes, timelines):
    """One legend entry per label over several axes, then one patch per phase band's colour."""
    from matplotlib.patches import Patch

    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    for name in dict.fromkeys(p[0] for tl in timelines for p in tl.phases):
        handles[f"{name} phase"] = Patch(
            color=PHASE_COLORS.get(name, "#f2f2f2"), label=f"{name} phase"
        )
    return list(handles.values())


def plot_timelines(
    timelines, titles=None, sharey=True, width=5.5, height=3.8, x="events", ncols=2,
    show_reserved=True,
):  # fmt: skip
    """Several timelines in a grid (`ncols` per row), on one y scale so their heights compare;
    show_reserved=False leaves out the modelled allocator's reserved line (a plot about what is
    allocated, not about the allocator)."""
    import matplotlib.pyplot as plt

    if not timelines:
        raise ValueError("plot_timelines needs at least one recorded timeline")
    for tl in timelines:
        tl._check_done()
    titles = titles or [tl.name for tl in timelines]
    ncols = max(1, min(ncols, len(timelines)))
    nrows = -(-len(timelines) // ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(width * ncols + 0.5, height * nrows + 1.0), squeeze=False
    )
    ymax = None
    if sharey:
        highest = [
            [tl.series().max(), tl.reserved_model.max() * show_reserved, tl.limit_bytes or 0]
            + ([tl.out_of_memory.reserved_needed] if tl.out_of_memory else [])
            for tl in timelines
        ]
        ymax = 1.1 * max(max(h) for h in highest) / MiB
    used = axes.flat[: len(timelines)]
    for tl, title, ax in zip(timelines, titles, used):
        plot_timeline(
            tl, ax=ax, title=title, show_reserved=show_reserved, legend=False, ymax=ymax, x=x
        )
    for ax in axes.flat[len(timelines) :]:
        ax.set_visible(False)
    handles = _legend_handles(used, timelines)
    fig.legend(
        handles=handles, loc="lower center", ncol=min(6, len(handles)), fontsize=10, frameon=False
    )
    legend_rows = -(-len(handles) // 6)
    fig.tight_layout(rect=(0, 0.055 * legend_rows * 4 / (height * nrows + 1.0), 1, 1))
    return fig


def save_png(tl, path, dpi=120):
    """Draws `tl` with plot_timeline into the PNG file `path`, without a display."""
    import matplotlib

    matplotlib.use("Agg")
    ax = plot_timeline(tl)
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=dpi)


def main(argv=None):
    """Runs memory_timeline's demo with the options after FILE.png, then saves its plot there."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or not argv[0].endswith(".png"):
        sys.exit("usage: python -m memory.plots FILE.png [--steps N --batch N --device D]")
    tl = memory_timeline.main(argv[1:])
    save_png(tl, argv[0])
    print(f"\nplot saved to {argv[0]}")


if __name__ == "__main__":
    main()
