"""The loss plot (train/report/plot.py): a PNG of the asked size with both curves, and a notice
naming the extra when matplotlib is not installed."""

import math
import sys

import pytest

from fullshard.train.report.plot import NOT_INSTALLED, matplotlib_figure, plot_losses


def _rgb_pixels(path):
    image = pytest.importorskip("PIL.Image").open(path)
    assert image.format == "PNG"
    return image.size, set(image.convert("RGB").getdata())


@pytest.mark.slow
def test_loss_plot_is_a_png_of_the_asked_size_with_both_curves(tmp_path):
    pytest.importorskip("matplotlib")
    train = [(s, 4.0 * math.exp(-s / 50) + 1.5) for s in range(1, 201)]
    val = [(s, 4.0 * math.exp(-s / 50) + 1.6) for s in (0, 50, 100, 150, 200)]
    path = str(tmp_path / "loss.png")
    assert plot_losses(path, train, val, width=500, height=300)
    size, colors = _rgb_pixels(path)
    assert size == (500, 300)
    assert (31, 119, 180) in colors and (255, 127, 14) in colors  # tab:blue, tab:orange
    assert plot_losses(path, [], [])  # before any step: axes only, still a PNG
    size, colors = _rgb_pixels(path)
    assert size == (640, 400) and (31, 119, 180) not in colors


def test_without_matplotlib_no_plot_is_drawn_and_the_notice_names_the_extra(tmp_path,
                                                                            monkeypatch):
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # what import sees when not installed
    path = tmp_path / "loss.png"
    assert matplotlib_figure() is None
    assert plot_losses(str(path), [(1, 2.0)], [(1, 2.1)]) is False
    assert not path.exists()
    assert "pip install 'fullshard[plot]'" in NOT_INSTALLED and "\n" not in NOT_INSTALLED
