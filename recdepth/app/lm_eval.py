"""recdepth models in EleutherAI's lm-evaluation-harness: `--model recdepth`.

Importing this module registers `RecdepthLM` under the name `recdepth` with lm_eval's
model registry (`recdepth lm-eval ...` / `python -m recdepth.harness ...` is lm_eval's own
command line with it registered; in Python, import this module, then
`lm_eval.simple_evaluate(model="recdepth", model_args=...)`). Needs the optional extra:
`pip install -e ".[eval]"`.

model_args (comma-separated key=value, as lm_eval passes them):
    ckpt=<training checkpoint> or hf=<Huginn-format directory>   the model (exactly one)
    exit=<rule> tau=<τ> min_steps= max_steps= patience= gate=<gate.pt>   the exit rule (one
        τ for every group; default fixed at max_steps=32)
    cache=latest|per_step  warm_start=true|false  backend=module|lean|compiled   as eval.*
    dtype=float32|bfloat16|float16  seed=<noise seed>  max_gen_toks=<generate_until's cap>
and lm_eval's own --batch_size (windows decoded side by side) and --device (its default,
cuda:0, falls back to the CPU where there is no CUDA device, with a warning).

Every request is scored as `recdepth.evaluate` scores a text (SPEC §4): token by token
with the KV cache under the exit rule, each group's loop stopping where the rule says; its
windows keyed for their initial-state noise from 0 at the request's own start, so a
request's result does not depend on the requests decoded beside it. An hf= model's
windows start with its tokenizer's BOS.
- `loglikelihood(context, continuation)`: the continuation's summed log-probability and
  whether every continuation token is the argmax (context and continuation encoded
  together, trailing whitespace moved to the continuation; the sequence cut from the left
  to the block size). An empty context starts from the end-of-text id (GPT-2's
  <|endoftext|>, or the tokenizer's BOS).
- `loglikelihood_rolling(text)`: the summed log-probability of the text's tokens after its
  first, in windows of the block size (`scoring.evaluate_exit` on the text alone).
- `generate_until(context, gen_kwargs)`: greedy generation under the exit rule
  (`generation.greedy`), cut at the first `until` string; sampling is refused.
The applications each scored token took are summed per task: the results' config gains a
`recdepth` block with, per task, the mean applications per group and the mean layer
applications per scored token (`get_model_info`, which lm_eval calls after evaluating).
"""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from recdepth.app.checkpoints import open_model, resolve_device
from recdepth.app.jobs import for_model
from recdepth.app.prompts import codec_of
from recdepth.config.schema import ModelJob
from recdepth.decode.engine import decode_windows
from recdepth.decode.generation import greedy
from recdepth.decode.scoring import evaluate_exit, model_cost
from recdepth.decode.settings import DecodeSettings
from recdepth.exits.gate import load_gate
from recdepth.exits.policy import build

log = logging.getLogger("recdepth.harness")

EXIT_KEYS = ("exit", "tau", "min_steps", "max_steps", "patience", "gate")


@register_model("recdepth")
class RecdepthLM(LM):
    """A recdepth checkpoint (or Huginn-format directory) under an exit rule, for lm_eval."""

    def __init__(self, ckpt: str | None = None, hf: str | None = None, exit: str = "fixed", tau: float | None = None,
                 min_steps: int = 0, max_steps: int = 32, patience: int | None = None, gate: str | None = None,
                 cache: str = "latest", warm_start: bool = False, backend: str = "lean", dtype: str = "float32",
                 seed: int = 0, max_gen_toks: int = 256, batch_size: int | str | None = 16,
                 max_batch_size: int | None = None, device: str | None = None, **unknown):
        super().__init__()
        if unknown:
            raise ValueError(f"model_args: unknown key {sorted(unknown)[0]!r} (expected ckpt, hf, "
                             f"{', '.join(EXIT_KEYS)}, cache, warm_start, backend, dtype, seed, max_gen_toks)")
        if isinstance(batch_size, str) and not batch_size.isdigit():
            raise ValueError(f"batch_size: expected a number of windows decoded side by side, got {batch_size!r} "
                             "(recdepth does not search a batch size: 'auto' is not supported)")
        self.batch = max(1, int(batch_size or 1))
        if device and device.startswith("cuda") and not torch.cuda.is_available():
            # lm_eval's command line asks for cuda:0 unless told otherwise (its default)
            log.warning("device: %s asked for, but torch sees no CUDA device: decoding on the CPU", device)
            device = "cpu"
        job = ModelJob(ckpt=ckpt, hf=hf, dtype=dtype, seed=int(seed), device=device or "auto")
        self._device = resolve_device(job.device)
        self.opened = open_model(job, self._device)
        self.model = self.opened.model.eval()
        self.codec = codec_of(self.opened)
        if self.codec is None:
            raise ValueError(f"hf: {hf} has no tokenizer.json; lm_eval's requests are text")
        kw = {"min_steps": min_steps, "max_steps": max_steps}
        if patience is not None:
            kw["patience"] = int(patience)
        gate_wb = None if gate is None else load_gate(gate)[:2]
        policy = build(exit, tau, groups=self.model.n_groups, gate=gate_wb, **kw)
        self.policy = for_model(policy, self.opened)
        self.bos = self.opened.bos
        # how every request decodes; the windows of _score carry their own BOS, not the engine's
        self.settings = DecodeSettings(cache=cache, warm_start=bool(warm_start), backend=backend, seed=int(seed),
                                       batch_size=self.batch, warmup_tokens=0, latency_tokens=0)
        self.max_gen_toks = int(max_gen_toks)
        self.lead = int(self.bos is not None)
        self.T = self.model.cfg.block_size
        self.cost = model_cost(self.model, self.policy)
        self.args = {"ckpt": ckpt, "hf": hf, "exit": exit, "tau": tau, "min_steps": min_steps, "max_steps": max_steps,
                     "patience": patience, "gate": gate, "cache": cache, "warm_start": bool(warm_start), "backend": backend,
                     "dtype": dtype, "seed": int(seed)}
        self._apps: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(self.model.n_groups))
        self._tokens: dict[str, int] = defaultdict(int)
        self._cost: dict[str, float] = defaultdict(float)  # layer applications with the rule's checks, summed

    # ------------------------------------------------------------------ text
    def _encode(self, text: str) -> list[int]:
        return self.codec.encode(text)[0]

    def _start_id(self) -> int:
        """The id an empty context starts from: BOS, else the end-of-text id."""
        if self.bos is not None:
            return self.bos
        eot = getattr(getattr(self.codec, "vocab", None), "eot_id", None)
        if eot is None:
            raise ValueError("loglikelihood: an empty context needs an end-of-text id, and this model's vocabulary "
                             "has none")
        return eot

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids, encoded together (BPE merges across the seam as in
        the text), trailing whitespace of the context moved to the continuation."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        whole = self._encode(context + continuation)
        ctx = self._encode(context)
        cont = whole[len(ctx):]
        if not ctx and not self.lead:
            ctx = [self._start_id()]
        return ctx, cont

    def _record(self, task: str | None, apps: np.ndarray) -> None:
        key = task or "(no task)"
        self._apps[key] += apps.sum(0)
        self._tokens[key] += len(apps)
        self._cost[key] += float(self.cost.per_token(apps).sum())

    # ------------------------------------------------------------- requests
    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool, np.ndarray]]:
        """(log-probability, greedy, applications [len(cont), G]) of each continuation: each
        sequence one window (cut from the left to fit), windows decoded `batch` at a time."""
        # One window holds block_size + 1 tokens: its first input and block_size targets. An
        # hf= model's BOS is laid in front of the sequence here (the engine's `bos` would
        # leave BOS's own prediction, the first token's, unscored: an empty context's).
        head = [self.bos] if self.lead else []
        out: list = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))  # like with like
        for b in range(0, len(order), self.batch):
            idx = order[b : b + self.batch]
            seqs = [head + (pairs[i][0] + pairs[i][1])[-(self.T + 1 - self.lead):] for i in idx]
            stream = torch.as_tensor([t for s in seqs for t in s], dtype=torch.long, device=self._device)
            starts = np.cumsum([0] + [len(s) for s in seqs[:-1]])
            wins = [(int(st), len(s) - 1) for st, s in zip(starts, seqs, strict=True)]
            nll, apps, _, ok = decode_windows(self.model, stream, wins, self.policy, self.settings,
                                              keys=[0] * len(wins))
            for r, i in enumerate(idx):
                n, k = wins[r][1], min(len(pairs[i][1]), wins[r][1])
                sl = slice(n - k, n)
                out[i] = (-float(nll[r, sl].sum()), bool(ok[r, sl].all()), apps[r, sl].numpy())
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._pair(*r.args) for r in requests]
        res = self._score(pairs)
        for r, (_, _, apps) in zip(requests, res, strict=True):
            self._record(r.task_name, apps)
        return [(ll, greedy_) for ll, greedy_, _ in res]

    @torch.no_grad()
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for r in requests:
            ids = self._encode(r.args[0])
            if len(ids) < 2:
                out.append(0.0)  # no token after the first: nothing scored
                continue
            _, rec = evaluate_exit(self.model, torch.as_tensor(ids, device=self._device), self.policy, len(ids) - 1,
                                   self.settings.replace(bos=self.bos))
            self._record(r.task_name, rec["apps"])
            out.append(-float(rec["nll"].sum()))
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for r in requests:
            context, kw = r.args
            kw = dict(kw or {})
            if kw.pop("do_sample", False) or float(kw.get("temperature", 0.0) or 0.0) > 0:
                raise ValueError("gen_kwargs: recdepth generates greedily (do_sample=false, temperature=0)")
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = ([self.bos] if self.lead else []) + self._encode(context)
            if not ids:
                ids = [self._start_id()]
            ids = ids[-(self.T - 1):]
            n_new = min(int(kw.get("max_gen_toks", self.max_gen_toks)), self.T - len(ids))
            gen = greedy(self.model, ids, self.policy, n_new, self.settings)
            self._record(r.task_name, np.asarray([rec.apps for rec in gen.records]).reshape(-1, self.model.n_groups))
            text = self.codec.decode(gen.ids)
            cut = min([text.find(u) for u in until if u and u in text], default=len(text))
            out.append(text[:cut])
        return out

    # ------------------------------------------------------------- results
    def get_model_info(self) -> dict:
        """The exit setting and, per task, the mean applications per group and layer
        applications per scored token (lm_eval puts this into the results' config)."""
        tasks = {}
        for task, total in sorted(self._apps.items()):
            n = self._tokens[task]
            mean = total / max(n, 1)
            tasks[task] = {"tokens": n, "mean_applications": [round(float(a), 6) for a in mean],
                           "layer_applications": self._cost[task] / max(n, 1)}
            log.info("%s: %d scored tokens, %.3f applications per group %s, %.2f layer applications per token",
                     task, n, float(mean.mean()), tasks[task]["mean_applications"], tasks[task]["layer_applications"])
        return {"recdepth": {**self.args, "kind": self.opened.kind, "source": self.opened.source,
                             "groups": self.model.cfg.groups, "tasks": tasks}}

