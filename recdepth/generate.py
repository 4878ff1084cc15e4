"""`python -m recdepth.generate ckpt=<path> prompt="..." exit=accel`: greedy generation from a
prompt under an exit rule, showing how many loop applications each token took
(docs/spec.md §4d; the engine is `recdepth.decode.generation`).

    python -m recdepth.generate ckpt=<run>/train/checkpoints/last.ckpt prompt="ROMEO:" max_new_tokens=64
    python -m recdepth.generate ckpt=<same> prompt="ROMEO:" eval.cache=per_step \\
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
built, `vocab_to_gpt2`), so text is GPT-2 BPE mapped into it (`recdepth.data.vocabulary.Vocab`), with
no corpus read; a prompt token outside the compact vocabulary becomes its "other" entry
(logged). `prompt_ids` are model ids and need no tokenizer.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from omegaconf import DictConfig

from recdepth.app.checkpoints import resolve_device
from recdepth.app.prompts import Stream, load_model, pieces, prompt_of
from recdepth.cli.runner import hydra_main, job_dir, refuse, start_job, task
from recdepth.config.build import exit_policy
from recdepth.config.schema import GenerateConfig, validated
from recdepth.decode.depth_view import draw_png, write_html, write_tokens
from recdepth.decode.engine import warm_up
from recdepth.decode.generation import Generation, greedy, speculative
from recdepth.decode.state_decode import has_coda
from recdepth.exits.policy import ExitPolicy
from recdepth.model.looped import LoopedGPT
from recdepth.training.runs import write_json

log = logging.getLogger("recdepth.generate")


RESULTS = ("generation.json", "tokens.csv", "depth.html", "depth.png")


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
    """Untimed: the first calls allocate and pick kernels (under the compiled step, at every
    attention span too: `engine.warm_up`)."""
    s = run.speculative
    settings = run.eval.settings(seed=run.seed)
    greedy(model, prompt[:1], policy, 2, settings)
    first = torch.tensor(prompt[:1], device=next(model.parameters()).device)
    warm_up(model, first, policy, settings.replace(warmup_tokens=0))
    if s.draft_steps is not None:
        speculative(model, prompt[:1], policy, 3, s.draft_steps, 1, settings)


def generate(cfg: DictConfig) -> dict:
    """Generate from cfg.prompt (or prompt_ids) with cfg.ckpt under cfg.exit; write the run
    directory's files and return generation.json's dict."""
    run_dir = job_dir(cfg, "generate")
    run = validated(cfg)
    policy = exit_policy(run)
    refuse(run_dir, *RESULTS)
    device = resolve_device(run.device)
    loaded = load_model(run, device)
    model = loaded.model
    settings = run.eval.settings(seed=run.seed)  # how each token is decoded (eval.cache, warm_start, backend)
    policy.check_model(model.n_groups, model.cfg.n_embd)
    policy = policy.resolve(has_coda(model), hf=loaded.info["source"] == "hf")  # exit.decode, kl_direction: auto
    ids, prompt_text = prompt_of(run, loaded)
    if model.wpe is None:  # rope: any position has its angles, so the block grows to what is asked
        model.grow_block(len(ids) + run.max_new_tokens - 1, "max_new_tokens")
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
        gen = greedy(model, ids, policy, run.max_new_tokens, settings, on_token=stream)
    else:
        gen = speculative(model, ids, policy, run.max_new_tokens, s.draft_steps, s.lookahead, settings,
                          on_token=stream)
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
        "settings": {"exit": _exit_settings(policy), "cache": run.eval.cache, "warm_start": run.eval.warm_start,
                     "backend": run.eval.backend, "seed": run.seed,
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
            ref = greedy(model, ids, policy, run.max_new_tokens, settings.replace(warm_start=False))
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


_task = task(generate, "seconds")  # the Hydra task (recdepth/cli/runner.py)
main = hydra_main(_task, "generate")


if __name__ == "__main__":
    # As recdepth.evaluate: run the importable module's main (a pickling launcher then
    # pickles the job by reference).
    import recdepth.generate

    recdepth.generate.main()
