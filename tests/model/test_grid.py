"""Grid attention (`model.attention=grid`, data=mazes): each cell of a window's N x N grid reads
itself and its four neighbours. Checked against a dense masked softmax whose mask is built here
from (row, column) pairs, by locality (a change at one cell reaches only its neighbours per
layer), by grid-size independence (the same weights on any N), and the one-line refusals."""

import math

import pytest
import torch
import torch.nn.functional as F

from recdepth.decode import scoring as S
from recdepth.decode.parallel import parallel_exit
from recdepth.decode.settings import DecodeSettings
from recdepth.exits import build
from recdepth.model.config import GPTConfig
from recdepth.model.looped import CausalSelfAttention, LoopedGPT, grid_attention


def cfg(n=5, **kw):
    base = dict(n_layer=3, n_head=2, n_embd=16, block_size=n * n + 2, vocab_size=40, groups=[[1]],
                attention="grid", position="none", state_init="input")
    return GPTConfig(**{**base, **kw})


def model(n=5, seed=0, **kw):
    torch.manual_seed(seed)
    m = LoopedGPT(cfg(n, **kw)).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def dense_mask(n: int) -> torch.Tensor:
    """[T, T]: may position i read position j, from grid coordinates (cell c at position c + 1,
    row c // n, column c % n): itself, or a cell at Manhattan distance 1."""
    T = n * n + 2
    mask = torch.eye(T, dtype=torch.bool)
    for a in range(n * n):
        for b in range(n * n):
            if abs(a // n - b // n) + abs(a % n - b % n) == 1:
                mask[a + 1, b + 1] = True
    return mask


@pytest.mark.parametrize("n", [2, 3, 7])
def test_grid_attention_is_the_neighbour_masked_softmax(n):
    g = torch.Generator().manual_seed(n)
    T = n * n + 2
    q, k, v = (torch.randn(2, 3, T, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(n))
    assert torch.allclose(grid_attention(q, k, v), ref, atol=1e-12, rtol=0)
    attn = CausalSelfAttention(cfg(n))
    assert torch.equal(attn.attend(q, k, v), grid_attention(q, k, v))
    # by hand at one interior cell: softmax over itself and its four neighbours
    if n >= 3:
        c = n + 1  # row 1, column 1
        p = c + 1
        keys = [p, p - 1, p + 1, p - n, p + n]
        w = torch.softmax(torch.stack([(q[..., p, :] * k[..., j, :]).sum(-1) / math.sqrt(8) for j in keys], -1), -1)
        want = sum(w[..., i, None] * v[..., j, :] for i, j in enumerate(keys))
        assert torch.allclose(grid_attention(q, k, v)[..., p, :], want, atol=1e-12, rtol=0)


def test_a_cell_reaches_its_neighbours_one_application_at_a_time():
    """Changing one cell's token moves, after the loop's n applications (and prelude and coda,
    a layer each), exactly the cells within Manhattan distance n + 2 of it."""
    n = 9
    m = model(n)
    idx = torch.randint(0, 40, (1, n * n + 2), generator=torch.Generator().manual_seed(1))
    c = 4 * n + 4  # the centre cell (4, 4)
    other = idx.clone()
    other[0, c + 1] = (idx[0, c + 1] + 1) % 40
    for steps in (1, 2):
        a, b = m(idx, loops=[steps])[0][..., :40], m(other, loops=[steps])[0][..., :40]  # padded logits: -inf
        moved = (a - b).abs().amax(-1)[0]  # [T]
        for cell in range(n * n):
            dist = abs(cell // n - 4) + abs(cell % n - 4)
            assert bool(moved[cell + 1] > 1e-12) == (dist <= steps + 2), (steps, cell)
        assert moved[0] == 0 and moved[-1] == 0  # the EOT and the newline read themselves only


def test_the_same_weights_read_any_grid_size():
    """N comes from the window: a model built for 5 x 5, its block grown (`grow_block`, as
    eval.task does), reads a 9 x 9 grid as one built for it (no positions, no parameter of the
    size)."""
    small, big = model(5, seed=2), model(9, seed=2)
    big.load_state_dict(small.state_dict())
    small.grow_block(83)
    idx = torch.randint(0, 40, (2, 83), generator=torch.Generator().manual_seed(4))
    assert torch.equal(small(idx, loops=[3])[0], big(idx, loops=[3])[0])


def test_a_grid_model_refuses_what_it_cannot_read_in_one_line():
    with pytest.raises(ValueError, match=r"^model\.attention: grid reads a cell's four neighbours as a set.*"
                                         r"position=rope"):
        cfg(position="rope")
    with pytest.raises(ValueError, match=r"^model\.attention: grid reads a cell's four neighbours as a set"):
        cfg(attention_window=2)
    with pytest.raises(ValueError, match=r"^model\.attention: unknown 'hex'"):
        cfg(attention="hex")
    m = model(3)
    with pytest.raises(ValueError, match=r"^model\.attention: grid reads each window as EOT, an N x N grid and a "
                                         r"newline \(N² \+ 2 tokens\), got a window of 10 "):
        m(torch.zeros(1, 10, dtype=torch.long), loops=[1])
    tokens = torch.randint(0, 40, (22,), generator=torch.Generator().manual_seed(0))
    policy = build("fixed", None, max_steps=2)
    with pytest.raises(ValueError, match=r"^eval\.regime: a grid model \(model\.attention=grid\) reads every cell at "
                                         r"once, so it decodes with eval\.regime=parallel only, got 'sequential'"):
        S.evaluate_exit(m, tokens, policy, 11, DecodeSettings(latency_tokens=0, warmup_tokens=0))
    with pytest.raises(ValueError, match=r"^eval\.wake: .*model\.attention=grid"):
        parallel_exit(m, tokens[:11][None], policy, wake=True)
    with pytest.raises(ValueError, match=r"^eval\.tokens: a grid model scores whole grids of 11 tokens \(its block "
                                         r"here\), expected a multiple of 11, got 15$"):  # not a grid of 4 cells
        S.evaluate_exit(m, tokens, policy, 15, DecodeSettings(regime="parallel", latency_tokens=0, warmup_tokens=0))
    with pytest.raises(ValueError, match=r"^exit\.name: 'oracle' decodes token by token, which a grid model "):
        S.evaluate_exit(m, tokens, build("oracle", 0.01, max_steps=2), 11,
                        DecodeSettings(regime="parallel", latency_tokens=0, warmup_tokens=0))


def test_the_parallel_regime_at_fixed_n_is_the_training_forward():
    """exit=fixed in the parallel regime gives each window the training pass's logits at n."""
    m = model(3, seed=5)
    idx = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(6))
    run = parallel_exit(m, idx, build("fixed", None, max_steps=4))
    logits = m(idx, loops=[4])[0]
    assert torch.allclose(run.logits, logits[..., : run.logits.shape[-1]], atol=1e-10, rtol=0)
    assert (run.apps == 4).all()


def test_a_grid_of_15000_cells_is_read_by_gathering_five_keys_a_cell():
    """DeepThinking's largest tested maze image is 124 x 124 pixels; a 123 x 123 grid (15,129
    cells) is read without a dense mask (one would hold T² = 2.3e8 entries a head): checked
    at sampled cells against the softmax over their neighbours written out here."""
    n = 123
    T = n * n + 2
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, T, 8, generator=g) for _ in range(3))
    out = grid_attention(q, k, v)
    assert out.shape == (1, 2, T, 8)
    for c in torch.randint(0, n * n, (40,), generator=g).tolist() + [0, n - 1, n * n - n, n * n - 1]:
        y, x = divmod(c, n)
        keys = [c + 1] + [(y + dy) * n + x + dx + 1 for dy, dx in ((0, -1), (0, 1), (-1, 0), (1, 0))
                          if 0 <= y + dy < n and 0 <= x + dx < n]
        s = torch.stack([(q[..., c + 1, :] * k[..., j, :]).sum(-1) / math.sqrt(8) for j in keys], -1)
        want = sum(w[..., None] * v[..., j, :] for w, j in zip(torch.softmax(s, -1).unbind(-1), keys, strict=True))
        assert torch.allclose(out[..., c + 1, :], want, atol=1e-5, rtol=0), c
