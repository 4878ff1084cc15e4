"""What a figure draws, for tests that check a figure against the data it was drawn from
(not a test module): capture the matplotlib Figure a plotting function returns, read its
curves back by legend label, and check that a PNG on disk is that figure."""

import io

import numpy as np


def capture(monkeypatch, module, name: str) -> list:
    """Replace module.<name> (a function returning a Figure) by one that also keeps each
    figure it returns; the list of kept figures."""
    real, figs = getattr(module, name), []

    def keep(*args, **kw):
        fig = real(*args, **kw)
        figs.append(fig)
        return fig

    monkeypatch.setattr(module, name, keep)
    return figs


def curves(ax) -> dict[str, np.ndarray]:
    """The curves of an Axes by label: plotted lines (ax.plot) and error-bar series
    (ax.errorbar, its data line), each as an [n, 2] array of (x, y); unlabelled ones left out."""
    out = {c.get_label(): c.lines[0].get_xydata() for c in ax.containers if c.lines[0] is not None}
    for line in ax.get_lines():
        label = line.get_label()
        if not label.startswith("_") and label not in out:
            out[label] = line.get_xydata()
    return out


def png_shows(fig, path, dpi: int = 150) -> bool:
    """Whether the PNG at `path` has the pixels of `fig` saved at `dpi` (the figure is
    rendered again in memory; Agg renders the same figure to the same pixels)."""
    import matplotlib.image as mpimg

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    a, b = mpimg.imread(buf), mpimg.imread(path)
    return a.shape == b.shape and bool((a == b).all())
