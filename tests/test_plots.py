"""The study's plots: trial labels placed without overlap, the Pareto front drawn on top of the
points, the Mods in the choice map's title."""

from __future__ import annotations

import itertools
import random

import pytest

from loka_tune.config import ModsConfig, PrecisionConfig
from loka_tune.tuner.plots import choice_map_figure, mods_words, place_labels, speed_vs_loss_figure


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return w * h if w > 0 and h > 0 else 0.0


def test_place_labels_keeps_a_tight_cluster_apart_and_off_the_markers() -> None:
    rng = random.Random(0)
    anchors = [(100 + rng.random() * 20, 100 + rng.random() * 20) for _ in range(20)]  # 20 points in 20x20 px
    sizes = [(14.0, 8.0)] * len(anchors)
    marks = [(x - 3, y - 3, x + 3, y + 3) for x, y in anchors]
    boxes = place_labels(anchors, sizes, obstacles=marks, bounds=(0, 0, 400, 300), gap=3.0)
    assert len(boxes) == len(anchors)
    for a, b in itertools.combinations(boxes, 2):
        assert _overlap(a, b) == 0.0
    for box in boxes:
        assert all(_overlap(box, m) == 0.0 for m in marks)
        assert box[0] >= 0 and box[1] >= 0 and box[2] <= 400 and box[3] <= 300
    # an isolated point keeps its label right beside it
    (box,) = place_labels([(50.0, 50.0)], [(10.0, 6.0)], gap=3.0)
    assert box == (53.0, 47.0, 63.0, 53.0)


def _rows() -> list[dict]:
    rng = random.Random(3)
    rows = []
    for n in range(30):  # clusters of near-identical trials, as a study's repeated configs give
        x = rng.choice([0.1, 0.12, 0.5]) + rng.random() * 0.03
        y = rng.choice([1.06, 1.062, 1.083]) + rng.random() * 0.002
        rows.append({"trial": n, "state": "COMPLETE", "rel_logloss_pct": x, "speedup": y, "feasible": x < 0.4,
                     "exported": n == 7})
    rows.append({"trial": 30, "state": "COMPLETE", "rel_logloss_pct": 0.0, "speedup": 1.0, "feasible": True})
    rows.append(dict(rows[5], trial=31))  # a cache copy: the same spot as trial 5
    return rows


def test_speed_vs_loss_labels_do_not_overlap_and_the_front_is_on_top() -> None:
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    fig = speed_vs_loss_figure(_rows(), 0.4, noise_floor_pct=0.2)
    try:
        ax = fig.axes[0]
        fig.canvas.draw()  # the annotations' final positions
        renderer = fig.canvas.get_renderer()
        labels = [t for t in ax.texts if t.get_gid() == "trial_label"]
        texts = sorted(t.get_text() for t in labels)
        assert any("5" in t.split(",") and "31" in t.split(",") for t in texts)  # one label for one spot
        assert sorted(int(n) for t in texts for n in t.split(",")) == list(range(32))  # each trial once
        # the text's own box (an Annotation's extent includes its leader line)
        boxes = [tuple(Text.get_window_extent(t, renderer).extents) for t in labels]
        overlaps = [(a, b) for a, b in itertools.combinations(range(len(boxes)), 2)
                    if _overlap(boxes[a], boxes[b]) > 1.0]  # > 1 px^2: rounding of the text extents aside
        assert not overlaps, [(labels[a].get_text(), labels[b].get_text()) for a, b in overlaps]
        front = next(line for line in ax.lines if line.get_gid() == "pareto_front")
        assert all(front.get_zorder() > c.get_zorder() for c in ax.collections if c.get_label() in
                   ("feasible", "over budget"))
    finally:
        plt.close(fig)


@pytest.mark.parametrize("mods,words", [
    (ModsConfig(), "none"),
    (ModsConfig(no_bias=True, blocknorm=128), "No Bias + BlockNorm 128"),
])
def test_choice_map_title_names_the_mods(mods: ModsConfig, words: str) -> None:
    import matplotlib.pyplot as plt

    assert mods_words(mods) == words
    fig = choice_map_figure(PrecisionConfig(mods=mods), ["top.0", "head"], title="trial 3: 1.08x")
    try:
        title = fig.axes[0].get_title()
        assert title.startswith("trial 3: 1.08x") and f"Mods: {words}" in title
    finally:
        plt.close(fig)
