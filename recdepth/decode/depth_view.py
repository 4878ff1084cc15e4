"""A generation's per-token depth as files (what `recdepth.generate` writes beside
generation.json): tokens.csv, one row per generated token with its applications and exit
reasons per group; depth.html, the text with each generated token on a background
coloured by its applications (hover: the record); depth.png, the same as a figure with a
colour bar.
"""

from __future__ import annotations

import csv
import html
from pathlib import Path

import numpy as np

from recdepth.decode.generation import Generation

CMAP = "viridis"


NEWLINE = "\u21b5"  # ↵: a newline token shows as this glyph on its colour, then breaks the line


def shown(text: str) -> str:
    """A token's text as depth.html and depth.png show it: newlines visible."""
    return text.replace("\n", NEWLINE + "\n")


def write_tokens(path: Path, gen: Generation, texts: list[str], gpt2_ids: list[int] | None, n_groups: int) -> None:
    """tokens.csv: one row per generated token."""
    head = ["index", "position", "token", *(["token_gpt2"] if gpt2_ids is not None else []), "text", "source",
            "applications", *(f"apps_{g}" for g in range(n_groups)), *(f"exit_{g}" for g in range(n_groups))]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(head)
        for i, r in enumerate(gen.records):
            w.writerow([r.index, r.position, r.token, *([gpt2_ids[i]] if gpt2_ids is not None else []), texts[i],
                        r.source, r.total, *r.apps, *r.reasons])


def _colours(totals: list[int]) -> tuple[list[tuple[float, float, float]], float, float]:
    """The colour of each total (viridis over [min, max]) and the range."""
    import matplotlib

    lo, hi = (float(min(totals)), float(max(totals))) if totals else (0.0, 1.0)
    if hi == lo:
        hi = lo + 1
    cmap = matplotlib.colormaps[CMAP]
    return [tuple(cmap((t - lo) / (hi - lo))[:3]) for t in totals], lo, hi


def _ink(rgb) -> str:
    """Black or white text, whichever reads on the background."""
    r, g, b = rgb
    return "#000" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "#fff"


def write_html(path: Path, gen: Generation, prompt_texts: list[str], texts: list[str], title: str,
               groups: list[list[int]], source: str) -> None:
    """depth.html: the prompt in grey, each generated token on a background coloured by its
    applications summed over groups; hovering shows its record. Each token's span carries
    data-index and data-apps (per group) for tools."""
    import matplotlib

    totals = [r.total for r in gen.records]
    cols, lo, hi = _colours(totals)
    cmap = matplotlib.colormaps[CMAP]
    stops = ", ".join(f"rgb({', '.join(str(round(255 * c)) for c in cmap(x)[:3])}) {round(100 * x)}%"
                      for x in np.linspace(0, 1, 11))
    names = ["+".join(map(str, g)) for g in groups]
    spans = []
    for r, text, c in zip(gen.records, texts, cols):
        rgb = ", ".join(str(round(255 * x)) for x in c)
        per = ", ".join(f"{n}: {a}" for n, a in zip(names, r.apps))
        tip = (f"token {r.index} at position {r.position}, id {r.token} {text!r}; applications {r.total} "
               f"({per}); exit {', '.join(r.reasons)}; {r.source}")
        spans.append(f'<span class="t" style="background: rgb({rgb}); color: {_ink(c)}" data-index="{r.index}" '
                     f'data-apps="{" ".join(map(str, r.apps))}" title="{html.escape(tip)}">{html.escape(shown(text))}</span>')
    prompt = html.escape(shown("".join(prompt_texts)))
    doc = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; max-width: 60em; margin: 2em auto; }}
.text {{ font-family: monospace; white-space: pre-wrap; line-height: 1.7; font-size: 15px; }}
.prompt {{ color: #888; }}
.t {{ border-radius: 2px; }}
.bar {{ height: 14px; width: 24em; background: linear-gradient(to right, {stops}); display: inline-block;
        vertical-align: middle; margin: 0 0.5em; }}
.legend, .meta {{ font-size: 13px; color: #333; }}
</style></head><body>
<h3>{html.escape(title)}</h3>
<p class="meta">{html.escape(source)}</p>
<p class="legend">applications per token, summed over the groups {html.escape(", ".join(names))}:
{lo:g}<span class="bar"></span>{hi:g} &nbsp; (grey: the prompt; hover a token for its record)</p>
<div class="text"><span class="prompt">{prompt}</span>{"".join(spans)}</div>
</body></html>
"""
    path.write_text(doc, encoding="utf-8")


def draw_png(path: Path, gen: Generation, prompt_texts: list[str], texts: list[str], title: str,
             width: int = 90) -> None:
    """depth.png: the text laid out in a monospaced grid of `width` characters per line, the
    prompt in grey and each generated token on its colour (applications summed over
    groups), with a colour bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    totals = [r.total for r in gen.records]
    cols, lo, hi = _colours(totals)
    cells = []  # (line, column, text, colour or None)
    line = col = 0
    for text, c in [(t, None) for t in prompt_texts] + list(zip(texts, cols)):
        parts = shown(text).replace("\t", "    ").split("\n")
        for k, part in enumerate(parts):
            if k:
                line, col = line + 1, 0
            while part:
                if col >= width:
                    line, col = line + 1, 0
                take = part[: width - col]
                cells.append((line, col, take, c))
                col += len(take)
                part = part[len(take) :]
    n_lines = line + 1
    fig_w, fig_h, ax_w = 11.0, 1.2 + 0.22 * n_lines, 0.78
    fig = plt.figure(figsize=(fig_w, fig_h))
    ax = fig.add_axes([0.02, 0.04, ax_w, 0.88 - 0.1 / fig_h])
    ax.set_xlim(0, width)
    ax.set_ylim(n_lines, 0)
    ax.axis("off")
    font = fig_w * ax_w / width * 72 / 0.602  # one cell per character: DejaVu Sans Mono is 0.602 em wide
    for ln, cl, t, c in cells:
        if c is not None:
            ax.add_patch(plt.Rectangle((cl, ln + 0.08), len(t), 0.84, color=c, lw=0))
        for k, ch in enumerate(t):  # one glyph per cell, centred: no drift from glyph bearings
            if not ch.isspace():
                ax.text(cl + k + 0.5, ln + 0.5, ch, family="monospace", fontsize=font, va="center", ha="center",
                        color="#888" if c is None else _ink(c))
    ax.set_title(title, fontsize=10, loc="left")
    cax = fig.add_axes([0.84, 0.1, 0.02, 0.8])
    fig.colorbar(ScalarMappable(Normalize(lo, hi), CMAP), cax=cax, label="applications per token (all groups)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
