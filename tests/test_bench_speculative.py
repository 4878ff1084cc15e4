"""`python -m recdepth.bench speculative` (issue 21): every side timed after its first
generated token, prompts from the test split, interleaved, CIs over prompts."""

import json

import numpy as np
import pytest
import torch

from recdepth import bench

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_bench_speculative_times_after_the_first_token_on_the_test_split(tiny_ckpt, ckpt_env, tmp_path, monkeypatch):
    from recdepth.decode import generation
    from recdepth.decode.settings import DecodeSettings

    seen = []  # the prompts every configuration ran, in order, with the cache sharing each ran with
    for name in ("greedy", "speculative"):
        fn = getattr(generation, name)

        def spy(model, prompt, *a, _fn=fn, _name=name, **k):
            settings = next(x for x in (*a, *k.values()) if isinstance(x, DecodeSettings))
            seen.append((_name, list(prompt), settings.cache))
            return _fn(model, prompt, *a, **k)
        monkeypatch.setattr(generation, name, spy)
    n, N, P = 3, 6, 5
    out = bench.main(["speculative", "--ckpt", str(tiny_ckpt), "--prompts", str(n), "--new-tokens", str(N),
                      "--prompt-len", str(P), "--draft-steps", "1", "--lookaheads", "3", "--max-steps", "4",
                      "--shallow", "2", "--out", str(tmp_path / "spec.json")])
    assert json.loads((tmp_path / "spec.json").read_text())["rows"] == json.loads(json.dumps(out["rows"]))
    rows = {r["config"]: r for r in out["rows"]}
    assert set(rows) == {f"{rule}/{m}" for rule in ("fixed", "accel")
                         for m in ("greedy/latest", "greedy/per_step", "speculative/1/3")} | {"shallow/greedy/latest"}
    # 7 configurations: one untimed warm-up on prompt 0, then each prompt once per configuration,
    # the order rotated by one per prompt
    assert len(seen) == 7 * (n + 1)
    firsts = [seen[7 * (i + 1)] for i in range(n)]
    assert len({(f[0], f[2]) for f in firsts}) == n
    # prompts: the first P tokens of the first n windows of the held-out stream (the test split)
    from recdepth.app.checkpoints import heldout_tokens, load_checkpoint

    module, data = load_checkpoint(tiny_ckpt, torch.device("cpu"))
    T = module.model.cfg.block_size
    val = heldout_tokens(module, data, n * T, seed=0)
    want = [val[i * T : i * T + P].tolist() for i in range(n)]
    assert [s[1] for s in seen[7:]] == [p for p in want for _ in range(7)]
    for r in rows.values():
        secs = np.array(r["decode_seconds"])
        assert len(secs) == n and (secs > 0).all()
        # tokens/s counts the N − 1 tokens after the first over decode seconds only
        assert r["tokens_per_s"] == pytest.approx(n * (N - 1) / secs.sum())
        assert r["total_seconds"] > secs.sum()  # the prompt's time is left out
        lo, hi = r["tokens_per_s_ci"]
        assert lo <= r["tokens_per_s"] <= hi
        # the medians over prompts, robust to one disturbed prompt
        assert r["median"]["ms_per_token"]["point"] == pytest.approx(np.median(1000 * secs / (N - 1)))
        base = np.array(rows[r["baselines"]["vs_greedy_per_step"]]["decode_seconds"])
        assert r["median"]["vs_greedy_per_step"]["point"] == pytest.approx(np.median(base / secs))
    for rule in ("fixed", "accel"):
        base = rows[f"{rule}/greedy/latest"]
        assert base["vs_greedy_latest"] == {"point": 1.0, "ci": [1.0, 1.0]}
        s = rows[f"{rule}/speculative/1/3"]
        assert s["identical_to_greedy_per_step"] == n  # speculative returns greedy per_step's tokens
        assert s["vs_greedy_per_step"]["point"] == pytest.approx(
            s["tokens_per_s"] / rows[f"{rule}/greedy/per_step"]["tokens_per_s"])
        assert 0 <= s["acceptance"] <= 1 and s["acceptance_ci"][0] <= s["acceptance"] <= s["acceptance_ci"][1]
    assert rows["shallow/greedy/latest"]["applications_per_token"] == 2 * len(module.model.cfg.groups)
