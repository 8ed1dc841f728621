"""``OUT/loss.png``: train and validation loss against step, drawn with matplotlib.

matplotlib is optional (``pip install 'fullshard[plot]'``; ``make run`` installs it): the
trainer is part of a library that other programs import, and a plotting stack (~70 MB
with Pillow and fontTools) is not something every user of ``fully_shard`` should carry.
Without it a run trains as usual and says once that it draws no plot. It is imported on
rank 0 only, at the first drawing, and through ``matplotlib.figure.Figure`` rather than
pyplot: no global figure state, no GUI backend picked from the environment.
"""

from __future__ import annotations

import os

NOT_INSTALLED = ("loss.png: not drawn, matplotlib is not installed (pip install "
                 "'fullshard[plot]' to draw it)")


def matplotlib_figure():
    """matplotlib's ``Figure`` class, or None where matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure


def plot_losses(path: str, train: list[tuple[int, float]], val: list[tuple[int, float]],
                width: int = 640, height: int = 400) -> bool:
    """Write a PNG (``width`` x ``height`` pixels) of ``train`` and ``val`` (lists of
    (step, loss)) to ``path``; False, writing nothing, where matplotlib is missing."""
    Figure = matplotlib_figure()
    if Figure is None:
        return False
    dpi = 100
    figure = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, layout="tight")
    axes = figure.add_subplot()
    if train:
        axes.plot(*zip(*train), label="train", color="tab:blue", linewidth=1.5)
    if val:  # evaluations are few: mark each one
        axes.plot(*zip(*val), label="val", color="tab:orange", marker="o", linewidth=1.5)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.grid(True, color="0.9")
    if train or val:
        axes.legend()
    figure.savefig(path + ".partial", format="png")
    os.replace(path + ".partial", path)  # a viewer never sees half a file
    return True
