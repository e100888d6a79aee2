"""The plots of a study (matplotlib, Agg, imported lazily): speed vs loss and the choice map.

``speed_vs_loss.png``: each completed trial's speed-up against its relative log loss (filled:
vs bf16, hollow: vs bf16 with its own Mods), labelled with its number (labels placed without
overlap, :func:`place_labels`), the budget line, the noise-floor band (inside it: "within
noise"), the Pareto front on top and the exported trial as a star. ``best_choice_map.png``:
the exported trial's choice per layer and GEMM, its Mods in the title. ``loka-tune report``
and MLflow tracking write them (:func:`write_plots`); they read results, never the loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from loka_tune.config import ROLES, PrecisionConfig
from loka_tune.errors import StudyError
from loka_tune.tuner.results import ATTR_BASELINE, TrialRecord, best_trial, exported_trial, leaderboard, noise_note

__all__ = ["write_plots", "plot_speed_vs_loss", "speed_vs_loss_figure", "speed_vs_loss_layout", "plot_choice_map",
           "choice_map_figure", "pareto_front", "place_labels", "mods_words"]


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)



def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (loss, speed-up) points no other point beats on both (lower loss, higher speed-up), by loss."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def speed_vs_loss_layout(rows: Sequence[Mapping[str, Any]], budget_pct: float, *,
                         noise_floor_pct: float = 0.0) -> dict[str, Any]:
    """What :func:`plot_speed_vs_loss` draws, as data: the points (trial, loss, speed-up,
    feasible), the exported trial, the Pareto front, the noise-floor band and axis limits that
    fit the points, the budget line and the band (with a 8% margin)."""
    pts = [(int(r.get("trial", i)), float(r["rel_logloss_pct"]), float(r["speedup"]), bool(r["feasible"]))
           for i, r in enumerate(rows)
           if r.get("state") == "COMPLETE" and _finite(r.get("rel_logloss_pct")) and _finite(r.get("speedup"))]
    exp_n = next((r.get("trial") for r in rows if r.get("exported")), None)
    exported = next(((p[0], p[1], p[2]) for p in pts if p[0] == exp_n), None)
    front = pareto_front([(p[1], p[2]) for p in pts])
    floor = abs(noise_floor_pct) if _finite(noise_floor_pct) else 0.0
    xs = [p[1] for p in pts] + [budget_pct, -floor, floor]
    ys = [p[2] for p in pts] + [1.0]

    def fit(v: list[float], pad_min: float) -> tuple[float, float]:
        lo, hi = min(v), max(v)
        pad = max((hi - lo) * 0.08, pad_min)
        return lo - pad, hi + pad

    # the same trials' speed-up vs bf16 with their own Mods (FP8's share of the gain), where known
    vs_mods = [(int(r.get("trial", i)), float(r["rel_logloss_pct"]), float(r["speedup_vs_mods"]))
               for i, r in enumerate(rows) if r.get("state") == "COMPLETE" and _finite(r.get("rel_logloss_pct"))
               and _finite(r.get("speedup")) and _finite(r.get("speedup_vs_mods"))]
    ys += [p[2] for p in vs_mods]
    return {"points": pts, "vs_mods": vs_mods, "exported": exported, "front": front, "band": (-floor, floor),
            "xlim": fit(xs, 0.01), "ylim": fit(ys, 0.005)}


Box = tuple[float, float, float, float]  # (x0, y0, x1, y1), display units


def _overlap(a: Box, b: Box) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return w * h if w > 0 and h > 0 else 0.0


#: the label positions tried around an anchor, in order: right, up-right, up, left, ... (unit steps)
_DIRECTIONS = ((1, 0), (1, 1), (0, 1), (-1, 1), (-1, 0), (-1, -1), (0, -1), (1, -1))


def place_labels(anchors: Sequence[tuple[float, float]], sizes: Sequence[tuple[float, float]], *,
                 obstacles: Sequence[Box] = (), bounds: Box | None = None, gap: float = 3.0,
                 steps: Sequence[float] = (1, 2, 3, 4, 6, 8, 11, 15)) -> list[Box]:
    """Greedy label placement without overlap (display units, e.g. pixels): each label of size
    ``sizes[i]`` (w, h) goes, in order, to the first spot around ``anchors[i]`` (8 directions at
    ``gap * step`` for each of ``steps``) whose box overlaps no label placed so far and no
    ``obstacles`` (the markers) and lies inside ``bounds``; where none does, to the spot of least
    overlap. Returns each label's box. A simple repel: no dependency, deterministic."""
    placed: list[Box] = []
    for (ax_, ay), (w, h) in zip(anchors, sizes):
        best: tuple[float, Box] | None = None
        for step in steps:
            d = gap * step
            for dx, dy in _DIRECTIONS:
                # the box touches the anchor's spot from direction (dx, dy): to the right of it, above it, ...
                x0 = ax_ + dx * d - (w if dx < 0 else 0 if dx > 0 else w / 2)
                y0 = ay + dy * d - (h if dy < 0 else 0 if dy > 0 else h / 2)
                box = (x0, y0, x0 + w, y0 + h)
                cost = sum(_overlap(box, b) for b in placed) + sum(_overlap(box, b) for b in obstacles)
                if bounds is not None and not (box[0] >= bounds[0] and box[1] >= bounds[1]
                                               and box[2] <= bounds[2] and box[3] <= bounds[3]):
                    cost += w * h  # outside the axes: as bad as covering another label
                if best is None or cost < best[0]:
                    best = (cost, box)
                if cost == 0:
                    break
            if best is not None and best[0] == 0:
                break
        assert best is not None
        placed.append(best[1])
    return placed


def _label_groups(pts: Sequence[tuple[int, float, float, bool]], to_px: Callable[[float, float], tuple[float, float]],
                  tol_px: float = 2.0) -> list[tuple[str, float, float]]:
    """Trials drawn at the same spot (a cache copy, an identical config) share one label "1,7":
    (label, x, y) per spot, in data coordinates."""
    groups: list[tuple[list[int], float, float, tuple[float, float]]] = []
    for n, x, y, _ in sorted(pts, key=lambda p: p[0]):
        px = to_px(x, y)
        for g in groups:
            if abs(g[3][0] - px[0]) <= tol_px and abs(g[3][1] - px[1]) <= tol_px:
                g[0].append(n)
                break
        else:
            groups.append(([n], x, y, px))
    return [(",".join(map(str, ns)), x, y) for ns, x, y, _ in groups]


def plot_speed_vs_loss(rows: Sequence[Mapping[str, Any]], budget_pct: float, path: str | Path, *,
                       speed_source: str = "modeled", title: str = "", noise_floor_pct: float = 0.0) -> Path:
    """:func:`speed_vs_loss_figure` written to ``path`` (PNG)."""
    plt = _plt()
    fig = speed_vs_loss_figure(rows, budget_pct, speed_source=speed_source, title=title,
                               noise_floor_pct=noise_floor_pct)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def speed_vs_loss_figure(rows: Sequence[Mapping[str, Any]], budget_pct: float, *, speed_source: str = "modeled",
                         title: str = "", noise_floor_pct: float = 0.0) -> Any:
    """Speed-up vs relative log loss of the completed trials (filled: vs bf16, hollow: vs bf16 with
    the trial's own Mods), each spot labelled with its trial numbers (placed without overlap by
    :func:`place_labels`, a thin line back to the point when pushed away), the budget line, the
    noise-floor band (the baseline's noise floor: a trial inside it is within noise), the Pareto
    front (a line through its points, drawn on top of them) and the exported trial (a star); axes
    fitted to them, the legend outside the axes."""
    plt = _plt()
    lay = speed_vs_loss_layout(rows, budget_pct, noise_floor_pct=noise_floor_pct)
    pts = lay["points"]
    fig, ax = plt.subplots(figsize=(8.6, 4.6))
    lo, hi = lay["band"]
    if hi > 0:
        ax.axvspan(lo, hi, color="grey", alpha=0.18, lw=0, label=f"within noise (+-{hi:.3g}%)", zorder=0)
    for feas, color, label in ((True, "tab:green", "feasible"), (False, "tab:red", "over budget")):
        sel = [p for p in pts if p[3] == feas]
        if sel:
            ax.scatter([p[1] for p in sel], [p[2] for p in sel], c=color, s=22, label=label, alpha=0.8, zorder=3)
    if lay["vs_mods"]:
        ax.scatter([p[1] for p in lay["vs_mods"]], [p[2] for p in lay["vs_mods"]], s=22, facecolors="none",
                   edgecolors="tab:blue", lw=0.8, label="same trial vs bf16 + its Mods", zorder=2)
    front = lay["front"]
    if front:  # on top of the points it joins
        ax.plot([p[0] for p in front], [p[1] for p in front], color="k", marker="o", mfc="none", ms=8, lw=1.2,
                drawstyle="steps-post", label="Pareto front", zorder=5, gid="pareto_front")
    if lay["exported"] is not None:
        n, x, y = lay["exported"]
        ax.scatter([x], [y], marker="*", s=220, c="gold", edgecolors="k", zorder=6, label=f"exported (trial {n})")
    ax.axvline(budget_pct, color="tab:orange", ls="--", label=f"budget {budget_pct:g}%", zorder=1)
    ax.axhline(1.0, color="grey", lw=0.6, zorder=1)
    ax.set_xlim(*lay["xlim"])
    ax.set_ylim(*lay["ylim"])
    ax.set_xlabel("relative log loss vs bf16 baseline (%)   (+ = worse)")
    ax.set_ylabel(f"speed-up vs bf16 ({speed_source})")
    ax.set_title(title or "trials: speed vs loss")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, borderaxespad=0.0)
    fig.tight_layout()
    # what a label must not cover: (x, y, radius in points) of every marker
    marks = [(p[1], p[2], 3.0) for p in pts] + [(p[1], p[2], 3.0) for p in lay["vs_mods"]]
    marks += [(x, y, 4.5) for x, y in front]
    if lay["exported"] is not None:
        marks.append((lay["exported"][1], lay["exported"][2], 7.5))
    _draw_labels(fig, ax, pts, marks, lines=[_steps_post(front)] if len(front) > 1 else [])
    return fig


def _steps_post(front: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The corners of the Pareto front's line as drawn (``drawstyle="steps-post"``)."""
    out = [front[0]]
    for (_x0, y0), (x1, y1) in zip(front, front[1:]):
        out += [(x1, y0), (x1, y1)]
    return out


def _draw_labels(fig: Any, ax: Any, pts: Sequence[tuple[int, float, float, bool]],
                 marks: Sequence[tuple[float, float, float]], fontsize: float = 6.5,
                 lines: Sequence[Sequence[tuple[float, float]]] = ()) -> None:
    """The trial-number labels, placed in display pixels once the axes' layout is final, clear
    of each other, of ``marks`` ((x, y, radius in points) of every marker) and of ``lines``
    (polylines in data coordinates, e.g. the Pareto front)."""
    renderer = fig.canvas.get_renderer()

    def to_px(x: float, y: float) -> tuple[float, float]:
        px_x, px_y = ax.transData.transform((x, y))
        return px_x, px_y

    groups = _label_groups(pts, to_px)
    sizes = []
    for label, _, _ in groups:
        t = ax.text(0, 0, label, fontsize=fontsize)
        bb = t.get_window_extent(renderer)
        t.remove()
        sizes.append((bb.width, bb.height))
    px = fig.dpi / 72.0  # points -> pixels
    obstacles = []
    for x, y, r in marks:
        mx, my = to_px(x, y)
        obstacles.append((mx - r * px, my - r * px, mx + r * px, my + r * px))
    for line in lines:  # a polyline: small boxes every few pixels along each segment
        for (x0, y0), (x1, y1) in zip(line, line[1:]):
            (a0, b0), (a1, b1) = to_px(x0, y0), to_px(x1, y1)
            n = max(1, int(math.hypot(a1 - a0, b1 - b0) / (2 * px)))
            for i in range(n + 1):
                cx, cy = a0 + (a1 - a0) * i / n, b0 + (b1 - b0) * i / n
                obstacles.append((cx - px, cy - px, cx + px, cy + px))
    box = ax.get_window_extent(renderer)
    anchors = [to_px(x, y) for _, x, y in groups]
    boxes = place_labels(anchors, sizes, obstacles=obstacles, bounds=(box.x0, box.y0, box.x1, box.y1),
                         gap=2.5 * px)
    for (label, x, y), (ax_, ay), b in zip(groups, anchors, boxes):
        cx, cy = (b[0] + b[2]) / 2, (b[1] + b[3]) / 2
        far = math.hypot(cx - ax_, cy - ay) > 14 * px
        ax.annotate(label, (x, y), xytext=((cx - ax_) / px, (cy - ay) / px), textcoords="offset points",
                    ha="center", va="center", fontsize=fontsize, color="dimgrey", zorder=7, gid="trial_label",
                    arrowprops={"arrowstyle": "-", "color": "silver", "lw": 0.5, "shrinkA": 0, "shrinkB": 3}
                    if far else None)


def mods_words(mods: Any) -> str:
    """The Mods of a config in words ("No Bias + BlockNorm 128"), or "none"."""
    parts = []
    if mods.no_bias:
        parts.append("No Bias")
    if mods.blocknorm is not None:
        parts.append(f"BlockNorm {mods.blocknorm}")
    if mods.hardswish:
        parts.append("Hard Swish")
    if mods.pad is not None:
        parts.append(f"pad to {mods.pad}")
    if mods.fuse_epilogue:
        parts.append("fused epilogue")
    return " + ".join(parts) or "none"


def plot_choice_map(config: PrecisionConfig, site_names: Sequence[str], path: str | Path, *, title: str = "") -> Path:
    """:func:`choice_map_figure` written to ``path`` (PNG)."""
    plt = _plt()
    fig = choice_map_figure(config, site_names, title=title)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def choice_map_figure(config: PrecisionConfig, site_names: Sequence[str], *, title: str = "") -> Any:
    """A table of a config's choice per layer (rows) and GEMM (columns), colored by format; the
    title names the config's Mods (under ``title`` when one is given)."""
    plt = _plt()
    colors = {"bf16": "#dddddd", "e4m3": "#8fd18f", "e5m2": "#f2c46d", "mxfp8": "#8fb8e8"}
    n = max(1, len(site_names))
    fig, ax = plt.subplots(figsize=(7.5, 1.1 + 0.32 * n))
    for i, name in enumerate(site_names):
        prec = config.resolve(name)
        for j, r in enumerate(ROLES):
            c = prec[r]
            label = c.short_str()
            fmt = c.a_format.value
            ax.add_patch(plt.Rectangle((j, n - 1 - i), 1, 1, color=colors.get(fmt, "#cccccc"), ec="white"))
            ax.text(j + 0.5, n - 0.5 - i, label, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, 3)
    ax.set_ylim(0, n)
    ax.set_xticks([0.5, 1.5, 2.5], [r.value for r in ROLES])
    ax.set_yticks([n - 0.5 - i for i in range(len(site_names))], list(site_names), fontsize=7)
    mods = f"Mods: {mods_words(config.mods)}"
    ax.set_title(f"{title}\n{mods}" if title else f"per-layer choices; {mods}", fontsize=9)
    fig.tight_layout()
    return fig


def write_plots(study: Any, space: Any, out_dir: str | Path, *, budget_pct: float, speed_source: str,
                noise_floor_pct: float | None = None) -> list[Path]:
    """Both plots of a study into ``out_dir``: speed vs loss, and the choice map of the trial
    ``export`` writes (only when a feasible trial exists); the noise floor defaults to the
    stored baseline's."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = leaderboard(study)
    if noise_floor_pct is None:
        noise_floor_pct = float((study.user_attrs.get(ATTR_BASELINE) or {}).get("noise_floor_pct") or 0.0)
    paths = [plot_speed_vs_loss(rows, budget_pct, out / "speed_vs_loss.png", speed_source=speed_source,
                                title=f"{study.study_name}: {len(rows)} trials", noise_floor_pct=noise_floor_pct)]
    try:  # the trial `loka-tune export` writes (the confirmed best), else the search's best
        best = exported_trial(study)
    except StudyError:
        best = best_trial(study, raise_if_none=False)
    if best is not None:
        r = TrialRecord.of(best)
        paths.append(plot_choice_map(PrecisionConfig.from_dict(r.config), space.site_names,
                                     out / "best_choice_map.png",
                                     title=f"trial {best.number}: {r.speedup or 0:.3f}x,"
                                           f" rel. LL {r.rel_logloss_pct or 0:+.4f}%"
                                           f"{noise_note(r.rel_logloss_pct, noise_floor_pct)}"))
    return paths
