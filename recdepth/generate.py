"""`python -m recdepth.generate ckpt=<path> prompt="..." exit=accel`: greedy generation from a
prompt under an exit rule, showing how many loop applications each token took
(docs/spec.md §4d; the engine is `recdepth.generation`).

    python -m recdepth.generate ckpt=<run>/train/checkpoints/last.ckpt prompt="ROMEO:" max_new_tokens=64
    python -m recdepth.generate ckpt=<same> prompt="ROMEO:" cache=per_step \\
        speculative.draft_steps=4 speculative.lookahead=8
    python -m recdepth.generate ckpt=<same> 'prompt_ids=[464,3290]'

The text goes to stdout as the tokens come (the log to stderr). The run directory gets:
    tokens.csv       one row per generated token: index, position, token (model id),
                     token_gpt2 (-1 for the compact vocabulary's "other" entry), text, source,
                     applications (summed over groups), apps_<g> and exit_<g> per group
    generation.json  prompt, text, ids, settings, applications, timings, the stop reason
                     and, with speculative decoding, its statistics and the comparison with
                     ordinary greedy decoding in the same run
    depth.html       the text, each generated token coloured by its applications (hover: the record)
    depth.png        the same as a figure, with a colour bar
    config.yaml      the resolved config

Text <-> ids: a recdepth checkpoint carries its vocabulary (the compact map the data module
built, `vocab_to_gpt2`), so text is GPT-2 BPE mapped into it (`recdepth.vocab.Vocab`), with
no corpus read; a prompt token outside the compact vocabulary becomes its "other" entry
(logged). `prompt_ids` are model ids and need no tokenizer.
"""

from __future__ import annotations

import csv
import html
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from recdepth.checkpoints import open_model, resolve_device
from recdepth.cli import hydra_main, job_dir, refuse, start_job, task
from recdepth.config import exit_policy
from recdepth.decoding import has_coda
from recdepth.exits import ExitPolicy
from recdepth.generation import Generation, TokenRecord, greedy, speculative
from recdepth.hf import HFTokenizer
from recdepth.model import LoopedGPT
from recdepth.runs import write_json
from recdepth.schema import GenerateConfig, validated
from recdepth.tokenizer import gpt2
from recdepth.vocab import Vocab

log = logging.getLogger("recdepth.generate")
CMAP = "viridis"
RESULTS = ("generation.json", "tokens.csv", "depth.html", "depth.png")


# ------------------------------------------------------------------ loading
class TextCodec:
    """Text <-> model ids: GPT-2 BPE and the model's vocabulary over GPT-2's (`Vocab`)."""

    def __init__(self, vocab: Vocab):
        self.vocab = vocab

    def encode(self, text: str) -> tuple[list[int], int]:
        """Model ids of `text`, and how many of them are the "other" entry (GPT-2 tokens
        outside a compact vocabulary)."""
        ids = self.vocab.from_gpt2(np.asarray(gpt2().encode(text, allowed_special="all"), dtype=np.int64))
        other = self.vocab.other_id
        return ids.tolist(), 0 if other is None else int((ids == other).sum())

    def decode(self, ids: list[int]) -> str:
        return self.vocab.decode(ids)

    def to_gpt2(self, ids: list[int]) -> list[int]:
        return self.vocab.to_gpt2(np.asarray(ids, dtype=np.int64)).tolist()


@dataclass
class Loaded:
    """A model ready to generate: `codec` None when no tokenizer is at hand (ids only)."""

    model: LoopedGPT
    codec: TextCodec | HFCodec | None
    info: dict


class HFCodec:
    """Text <-> ids through a checkpoint directory's tokenizer.json (`recdepth.hf.HFTokenizer`);
    its ids are the model's, so there are no GPT-2 ids to report."""

    def __init__(self, tok: HFTokenizer):
        self.tok = tok

    def encode(self, text: str) -> tuple[list[int], int]:
        return self.tok.encode(text), 0

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def to_gpt2(self, ids: list[int]) -> None:
        return None


def load_model(run: GenerateConfig, device: torch.device) -> Loaded:
    """The model (in run.dtype, `checkpoints.open_model`) and its text codec: GPT-2 BPE through
    a training checkpoint's vocabulary map (no corpus is read), or an hf directory's
    tokenizer.json (none: no codec, prompt_ids only)."""
    opened = open_model(run, device)
    model = opened.model
    info = {"source": opened.kind, "path": opened.source, "params": model.num_params(), "groups": model.cfg.groups,
            "block_size": model.cfg.block_size, "vocab_size": model.cfg.vocab_size,
            "compact_vocab": opened.vocab_to_gpt2 is not None}
    if opened.kind == "hf":
        info["tokenizer"] = opened.tokenizer is not None
        return Loaded(model, None if opened.tokenizer is None else HFCodec(opened.tokenizer), info)
    m = opened.vocab_to_gpt2
    vocab = Vocab(None if m is None else m.cpu().numpy().astype(np.int64), model.cfg.n_other)
    if vocab.size != model.cfg.vocab_size:
        raise ValueError(f"ckpt: {run.ckpt}: its vocabulary map has {vocab.size} ids, its model {model.cfg.vocab_size}")
    return Loaded(model, TextCodec(vocab), info)


def prompt_of(run: GenerateConfig, loaded: Loaded) -> tuple[list[int], str | None]:
    """The prompt's model ids and its text (None for prompt_ids without a tokenizer)."""
    V = loaded.model.cfg.vocab_size
    if run.prompt_ids is not None:
        ids = list(run.prompt_ids)
        bad = [i for i in ids if i >= V]
        if bad:
            raise ValueError(f"prompt_ids: id {bad[0]} is outside the model's vocabulary 0..{V - 1}")
        return ids, None if loaded.codec is None else loaded.codec.decode(ids)
    if loaded.codec is None:
        raise ValueError("prompt: this checkpoint comes without a tokenizer; pass prompt_ids=[...] instead")
    ids, n_other = loaded.codec.encode(run.prompt)
    if not ids:
        raise ValueError(f"prompt: {run.prompt!r} encodes to no tokens")
    if n_other:
        log.info("prompt: %d of its %d tokens are outside the checkpoint's compact vocabulary and map to its "
                 "\"other\" entry (the model sees them as one unknown token)", n_other, len(ids))
    return ids, run.prompt


# ------------------------------------------------------------------ output
class Stream:
    """Prints the generated text to stdout as it comes (whole characters only: a token
    that ends inside a UTF-8 character waits for the next), and on stderr a token counter
    when stdout does not show the text on the same terminal."""

    def __init__(self, codec: TextCodec | None, total: int, enabled: bool):
        self.codec, self.total, self.enabled = codec, total, enabled
        self.ids: list[int] = []
        self.shown = 0
        self.t0 = time.perf_counter()
        self.counter = sys.stderr.isatty() and not (enabled and sys.stdout.isatty())

    def __call__(self, row: int, rec: TokenRecord) -> None:
        self.ids.append(rec.token)
        if self.enabled:
            text = self.codec.decode(self.ids) if self.codec is not None else " ".join(map(str, self.ids)) + " "
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[self.shown :])
                sys.stdout.flush()
                self.shown = len(text)
        if self.counter:
            rate = len(self.ids) / max(time.perf_counter() - self.t0, 1e-9)
            sys.stderr.write(f"\r{len(self.ids)}/{self.total} tokens, {rate:.1f} tokens/s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            text = self.codec.decode(self.ids) if self.codec is not None else ""
            sys.stdout.write(text[self.shown :] + "\n")
            sys.stdout.flush()
        if self.counter:
            sys.stderr.write("\n")


NEWLINE = "\u21b5"  # ↵: a newline token shows as this glyph on its colour, then breaks the line


def shown(text: str) -> str:
    """A token's text as depth.html and depth.png show it: newlines visible."""
    return text.replace("\n", NEWLINE + "\n")


def pieces(loaded: Loaded, ids: list[int]) -> list[str]:
    """The text of each token alone (its id in angle brackets without a tokenizer)."""
    if loaded.codec is None:
        return [f"<{i}>" for i in ids]
    return [loaded.codec.decode([i]) for i in ids]


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


# ------------------------------------------------------------------ the job
def _exit_settings(p: ExitPolicy) -> dict:
    plain = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731
    return {"name": p.name, "tau": plain(p.tau), "min_steps": plain(p.min_steps), "max_steps": plain(p.max_steps),
            "patience": p.patience, "decode": p.decode, "kl_direction": p.kl_direction}


def _apps(gen: Generation, n_groups: int) -> dict:
    a = np.array([r.apps for r in gen.records], dtype=np.int64).reshape(-1, n_groups)
    return {"total": int(a.sum()), "per_token": float(a.sum(1).mean()) if len(a) else 0.0,
            "per_group": a.mean(0).tolist() if len(a) else [0.0] * n_groups}


def _compare(spec: Generation, ref: Generation) -> dict:
    """Speculative against ordinary greedy decoding of the same prompt: equal tokens and
    applications, or where they first differ."""
    first = next((i for i, (a, b) in enumerate(zip(spec.ids, ref.ids)) if a != b), None)
    if first is None and len(spec.ids) != len(ref.ids):
        first = min(len(spec.ids), len(ref.ids))
    upto = len(spec.ids) if first is None else first
    apps_mismatch = sum(a.apps != b.apps for a, b in zip(spec.records[:upto], ref.records[:upto]))
    return {"matches_greedy": first is None and apps_mismatch == 0, "first_token_mismatch": first,
            "apps_mismatch": apps_mismatch}


def _warm_up(model: LoopedGPT, prompt: list[int], policy: ExitPolicy, run: GenerateConfig) -> None:
    """Untimed: the first calls allocate and pick kernels."""
    s = run.speculative
    greedy(model, prompt[:1], policy, 2, cache=run.cache, seed=run.seed, warm_start=run.warm_start)
    if s.draft_steps is not None:
        speculative(model, prompt[:1], policy, 3, s.draft_steps, 1, cache=run.cache, seed=run.seed)


def generate(cfg: DictConfig) -> dict:
    """Generate from cfg.prompt (or prompt_ids) with cfg.ckpt under cfg.exit; write the run
    directory's files and return generation.json's dict."""
    run_dir = job_dir(cfg, "generate")
    run = validated(cfg)
    policy = exit_policy(cfg)
    refuse(run_dir, *RESULTS)
    device = resolve_device(run.device)
    loaded = load_model(run, device)
    model = loaded.model
    policy.check_model(model.n_groups, model.cfg.n_embd)
    policy = policy.resolve(has_coda(model), hf=loaded.info["source"] == "hf")  # exit.decode, kl_direction: auto
    ids, prompt_text = prompt_of(run, loaded)
    T = model.cfg.block_size
    if len(ids) > T:
        raise ValueError(f"prompt: {len(ids)} tokens, more than the model's block_size={T} (its learned positions "
                         "end there)")
    start_job(run_dir, cfg)
    _warm_up(model, ids, policy, run)

    s = run.speculative
    n_expected = min(run.max_new_tokens, T + 1 - len(ids))
    stream = Stream(loaded.codec, n_expected, run.stream)
    if s.draft_steps is None:
        gen = greedy(model, ids, policy, run.max_new_tokens, cache=run.cache, seed=run.seed, on_token=stream,
                     warm_start=run.warm_start)
    else:
        gen = speculative(model, ids, policy, run.max_new_tokens, s.draft_steps, s.lookahead, cache=run.cache,
                          seed=run.seed, on_token=stream)
    stream.close()
    if gen.stopped == "block_size":
        log.info("stopped after %d tokens at the model's block_size=%d (prompt %d + generated %d tokens; the last "
                 "one is predicted at position %d)", len(gen.ids), T, len(ids), len(gen.ids), T - 1)

    texts = pieces(loaded, gen.ids)
    prompt_texts = pieces(loaded, ids)
    gpt2_ids = loaded.codec.to_gpt2(gen.ids) if loaded.codec is not None else None
    G = model.n_groups
    out = {
        "prompt": prompt_text, "prompt_ids": ids,
        "prompt_ids_gpt2": loaded.codec.to_gpt2(ids) if loaded.codec is not None else None,
        "text": loaded.codec.decode(gen.ids) if loaded.codec is not None else None, "ids": gen.ids,
        "ids_gpt2": gpt2_ids, "tokens": len(gen.ids), "stopped": gen.stopped,
        "model": loaded.info, "device": str(device), "dtype": str(next(model.parameters()).dtype),
        "settings": {"exit": _exit_settings(policy), "cache": run.cache, "seed": run.seed,
                     "max_new_tokens": run.max_new_tokens,
                     "speculative": None if s.draft_steps is None else
                     {"draft_steps": s.draft_steps, "lookahead": s.lookahead}},
        "applications": _apps(gen, G),
        "prompt_applications": gen.prompt_apps,
        "exit_reasons": {r: sum(rec.reasons.count(r) for rec in gen.records) for r in ("rule", "max_steps", "fixed")},
        "seconds": gen.seconds, "tokens_per_s": len(gen.ids) / gen.seconds if gen.seconds > 0 else None,
        "speculative": None,
    }
    if s.draft_steps is not None:
        spec = dict(gen.stats)
        if s.compare:
            ref = greedy(model, ids, policy, run.max_new_tokens, cache=run.cache, seed=run.seed)
            spec.update(_compare(gen, ref))
            spec.update(greedy_seconds=ref.seconds, greedy_applications=ref.applications,
                        speedup=ref.seconds / gen.seconds if gen.seconds > 0 else None)
            if not spec["matches_greedy"]:
                log.warning("speculative decoding differs from greedy decoding at token %s (%d tokens with other "
                            "applications): floating-point rounding in the chunk pass flipped a threshold or an "
                            "argmax tie (docs/spec.md §4d)", spec["first_token_mismatch"], spec["apps_mismatch"])
        out["speculative"] = spec
        log.info("speculative: %d drafted, %d accepted (rate %s), %.2f tokens per verify pass over %d passes; "
                 "applications %d draft + %d verify (%d one after another)%s", spec["drafted"], spec["accepted"],
                 "—" if spec["acceptance_rate"] is None else f"{spec['acceptance_rate']:.3f}",
                 spec["tokens_per_pass"] or 0.0, spec["rounds"], spec["draft_applications"],
                 spec["verify_applications"], spec["verify_steps"],
                 "" if not s.compare else f"; {gen.seconds:.2f} s against {spec['greedy_seconds']:.2f} s greedy "
                 f"({spec['speedup']:.2f}x), same tokens: {spec['matches_greedy']}")

    ex = _exit_settings(policy)
    title = (f"exit={policy.name} tau={ex['tau']} max_steps={ex['max_steps']}, {len(gen.ids)} tokens, "
             f"{out['applications']['per_token']:.1f} applications per token"
             + ("" if s.draft_steps is None else f" (speculative, draft_steps={s.draft_steps})"))
    write_tokens(run_dir / "tokens.csv", gen, texts, gpt2_ids, G)
    write_html(run_dir / "depth.html", gen, prompt_texts, texts, title, model.cfg.groups, loaded.info["path"])
    draw_png(run_dir / "depth.png", gen, prompt_texts, texts, title)
    write_json(run_dir / "generation.json", out)
    log.info("%d tokens in %.2f s (%s), %.1f applications per token; wrote %s", len(gen.ids), gen.seconds,
             "speculative" if s.draft_steps is not None else "greedy", out["applications"]["per_token"], run_dir)
    return out


_task = task(generate, "seconds")  # the Hydra task (recdepth/cli.py)
main = hydra_main(_task, "generate")


if __name__ == "__main__":
    # As recdepth.evaluate: run the importable module's main (a pickling launcher then
    # pickles the job by reference).
    import recdepth.generate

    recdepth.generate.main()
