"""The parallel regime (recdepth/decode/parallel.py): every position loops at once, the rule
read per position (halted states kept) or per instance."""

import pytest
import torch

from recdepth import exits
from recdepth.decode.engine import decode_step, new_caches
from recdepth.decode.parallel import parallel_exit, window_changed
from recdepth.decode.settings import DecodeSettings
from recdepth.model.looped import GPTConfig, LoopedGPT


def one_group(window=None, seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=12, vocab_size=60, groups=[[1]],
                    state_init="zero", attention_window=window)
    return LoopedGPT(cfg).double().eval()


IDX = torch.randint(0, 60, (3, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_fixed_depth_is_the_training_pass(level):
    m = one_group()
    run = parallel_exit(m, IDX, exits.build("fixed", None, max_steps=5), level)
    ref, _ = m(IDX, loops=[5])
    torch.testing.assert_close(run.logits, ref, rtol=1e-10, atol=1e-10)
    assert torch.all(run.apps == 5) and torch.all(run.steps == 5)


def test_token_level_stops_each_position_where_token_by_token_decoding_with_copy_forward_does():
    """A state rule: at application j a position reads the earlier ones at min(j − 1, their
    stop) in both regimes, so they stop every position at the same application (the
    token-by-token one then writes once more: + 1) with the same output."""
    m = one_group()
    policy = exits.build("stepnorm_rel", 0.3, max_steps=48)
    run = parallel_exit(m, IDX, policy, "token")
    caches = new_caches(m, 3, 12, "per_step", 48)
    out, apps = [], []
    for t in range(12):
        logits, a = decode_step(m, IDX[:, t], t, caches, policy, DecodeSettings(cache="per_step", copy_forward=True))
        out.append(logits)
        apps.append(a[:, 0])
    apps = torch.stack(apps, 1)
    assert len(run.apps.unique()) >= 5 and int(run.apps.max()) < 48
    assert torch.equal(apps, run.apps + 1)
    torch.testing.assert_close(torch.stack(out, 1), run.logits, rtol=1e-9, atol=1e-9)
    assert torch.equal(run.steps, run.apps.max(1).values)


@pytest.mark.parametrize("patience", [1, 2])
def test_sequence_level_stops_where_every_answer_has_stood_still_for_patience_applications(patience):
    """argmax_stability per instance against the answers of the training pass at every depth:
    the first n at which every position's argmax equals its argmax at n − 1 .. n − patience."""
    m = one_group(seed=1)
    N = 40
    policy = exits.build("argmax_stability", None, max_steps=N, patience=patience, decode="coda")
    run = parallel_exit(m, IDX, policy, "sequence")
    answers = torch.stack([m(IDX, loops=[n])[0].argmax(-1) for n in range(1, N + 1)])  # [N, B, T]
    for b in range(IDX.shape[0]):
        want = next((n for n in range(patience + 1, N + 1)
                     if all(torch.equal(answers[n - 1, b], answers[n - 1 - k, b]) for k in range(1, patience + 1))), N)
        assert int(run.steps[b]) == want
        assert torch.all(run.apps[b] == want)
        torch.testing.assert_close(run.logits[b], m(IDX[b : b + 1], loops=[want])[0][0], rtol=1e-9, atol=1e-9)
    assert len(run.steps.unique()) > 1 or int(run.steps[0]) < N  # the rule decided somewhere


@pytest.mark.parametrize("level, wake", [("token", False), ("token", True), ("sequence", False)])
def test_a_batch_of_instances_gives_each_its_result_alone(level, wake):
    m = one_group(window=2)
    policy = exits.build("stepnorm_rel", 0.2, max_steps=30)
    run = parallel_exit(m, IDX, policy, level, wake)
    for b in range(IDX.shape[0]):
        one = parallel_exit(m, IDX[b : b + 1], policy, level, wake)
        assert torch.equal(one.apps[0], run.apps[b]) and int(one.steps[0]) == int(run.steps[b])
        torch.testing.assert_close(one.logits[0], run.logits[b], rtol=1e-10, atol=1e-10)


def test_window_changed_by_hand():
    active = torch.tensor([[True, False, False, False, True, False]])
    assert window_changed(active, 2).tolist() == [[False, True, False, False, False, True]]
    assert window_changed(active, 3).tolist() == [[False, True, True, False, False, True]]
    assert window_changed(active, None).tolist() == [[False, True, True, True, True, True]]


def test_wake_only_adds_applications():
    """A woken position runs again: it never takes fewer applications than without waking."""
    m = one_group(window=2)
    policy = exits.build("stepnorm_rel", 0.3, max_steps=30)
    asleep, awake = (parallel_exit(m, IDX, policy, "token", w) for w in (False, True))
    assert torch.all(awake.apps >= asleep.apps) and bool((awake.apps > asleep.apps).any())


@pytest.mark.parametrize("kw, match", [({"level": "batch"}, "eval.exit_level"),
                                       ({"level": "sequence", "wake": True}, "eval.wake")])
def test_bad_settings_are_one_line_errors(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        parallel_exit(one_group(), IDX, exits.build("fixed", None, max_steps=2), **kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw, match", [({"regime": "batch"}, "^eval.regime: expected one of sequential, parallel"),
                                       ({"exit_level": "sequence"}, "^eval.exit_level / eval.wake: the parallel"),
                                       ({"regime": "parallel", "exit_level": "sequence", "wake": True}, "^eval.wake"),
                                       ({"regime": "parallel", "warm_start": True}, "^eval.warm_start: not with"),
                                       ({"regime": "parallel", "context_steps": 4}, "^eval.context_steps: not with")])
def test_regime_settings_are_checked_in_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        DecodeSettings(**kw)
    assert "\n" not in str(e.value)


def test_settings_side_by_side_refuse_the_parallel_regime():
    from recdepth.decode.scoring import evaluate_exits

    with pytest.raises(ValueError, match="^eval.regime: parallel decodes one setting at a time"):
        evaluate_exits(one_group(), IDX.flatten(), [exits.build("fixed", None, max_steps=2)] * 2, 20,
                       DecodeSettings(regime="parallel"))
