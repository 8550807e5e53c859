"""paged_attention's options (window, softcap, sinks, tree_mask) from Python:
on a view and through the op, on the CPU kernel and the ATen path CUDA
tensors take, against a float64 reference; a windowed SequenceTable's
decode reads around its released pages; bad options raise and change
nothing; the op with options under torch.compile (torch 2.x)."""
import math

import pytest
import torch

import pagedkv
from conftest import (assert_bit_equal, assert_unchanged, generic_backend, make_cache, needs_compile, raises_runtime,
                      snapshot)

ops = torch.ops.pagedkv


def reference(q, k, v, lengths, scale=0.0, window=0, softcap=0.0, sinks=None, tree_mask=None):
    """q [B, Sq, Hq, D]; k, v [B, T, H, D] gathered: the options' rules in float64."""
    B, Sq, Hq, D = q.shape
    scale = scale if scale > 0 else 1.0 / math.sqrt(D)
    outs = []
    for b in range(B):
        L = int(lengths[b])
        group = Hq // k.shape[2]
        kb = k[b, :L].double().repeat_interleave(group, 1).permute(1, 2, 0)  # [Hq, D, L]
        vb = v[b, :L].double().repeat_interleave(group, 1).permute(1, 0, 2)  # [Hq, L, D]
        s = torch.matmul(q[b].double().permute(1, 0, 2), kb) * scale          # [Hq, Sq, L]
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        first_new = L - Sq
        pos = torch.arange(L).view(1, L)
        qpos = torch.arange(Sq).view(Sq, 1) + first_new
        if tree_mask is not None:
            idx = (pos - first_new).clamp(0, Sq - 1).expand(Sq, L)
            seen = (pos < first_new) | ((pos >= first_new) & tree_mask[b].gather(1, idx))
        else:
            seen = pos <= qpos
        if window > 0:
            seen = seen & (pos > qpos - window)
        s = s.masked_fill(~seen, -math.inf)
        if sinks is not None:
            col = sinks.double().view(Hq, 1, 1).expand(Hq, Sq, 1)
            p = torch.softmax(torch.cat([s, col], -1), -1)[..., :L]
        else:
            p = torch.softmax(s, -1)
        p = p.masked_fill(~seen, 0.0)
        outs.append(torch.matmul(p, vb).permute(1, 0, 2))
    return torch.stack(outs)


def filled(layout, lengths, page_size=4, dtype=torch.float32, seed=0):
    n_pages = sum((n + page_size - 1) // page_size for n in lengths) + 1
    cache = make_cache(layout, dtype, n_layers=1, n_pages=n_pages, page_size=page_size, n_kv_heads=2, head_dim=16)
    width = max((n + page_size - 1) // page_size for n in lengths)
    rows = []
    for n in lengths:
        pages = cache.alloc_n((n + page_size - 1) // page_size)
        rows.append(pages + [-1] * (width - len(pages)))
    pt = torch.tensor(rows)
    gen = torch.Generator().manual_seed(seed)
    for b, n in enumerate(lengths):
        k = torch.randn(1, n, 2, 16, generator=gen).to(dtype)
        cache.write(0, pt[b:b + 1], 0, k, (k * 0.7).flip(1))
    lens = torch.tensor(lengths)
    k, v = cache.gather(0, pt, lens)
    return cache, pt, lens, k, v


OPTION_CASES = {
    "window": dict(window=5),
    "window1": dict(window=1),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=torch.tensor([3.0, -1.0, 0.5, 8.0])),
    "tree": dict(tree_mask=torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]] * 2, dtype=torch.bool)),
    "all": dict(window=6, softcap=3.0, sinks=torch.tensor([0.0, 1.0, -2.0, 4.0]),
                tree_mask=torch.tensor([[[1, 0, 0], [0, 1, 0], [1, 1, 1]]] * 2, dtype=torch.bool)),
}


@pytest.mark.parametrize("generic", [False, True], ids=["cpu_kernel", "aten_path"])
@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_options_match_reference_on_views_and_ops(layout, case, generic):
    options = OPTION_CASES[case]
    cache, pt, lens, k, v = filled(layout, [11, 18], seed=3)
    gen = torch.Generator().manual_seed(4)
    for n_queries in ([3] if "tree_mask" in options else [1, 3]):
        q = torch.randn(2, n_queries, 4, 16, generator=gen) * 3
        expected = reference(q, k, v, lens, **options)
        with generic_backend(generic):
            on_view = pagedkv.paged_attention(cache.bind(pt, lengths=lens), 0, q, **options)
            on_op = ops.paged_attention(cache.k_cache, cache.v_cache, 0, pt, lens, q, layout=layout, **options)
        assert (on_view.double() - expected).abs().max() < 1e-5, (case, n_queries)
        assert_bit_equal(on_view, on_op, "the view and the op run the same kernel")


def test_windowed_table_decodes_around_released_pages(layout):
    """A windowed SequenceTable's rows start with -1 columns: attention with
    the window reads around them; without it, it raises."""
    cache = make_cache(layout, torch.float32, n_layers=1, n_pages=8, page_size=4, head_dim=16)
    seqs = pagedkv.SequenceTable(cache, window=5)
    a = seqs.create()
    gen = torch.Generator().manual_seed(5)
    k_all = torch.randn(1, 30, 2, 16, generator=gen)
    for t in range(30):
        assert seqs.prepare_append(a, 1)
        pt, lengths = seqs.batch([a])
        cache.write(0, pt, int(lengths[0]), k_all[:, t:t + 1], k_all[:, t:t + 1] * 2)
        q = torch.randn(1, 1, 2, 16, generator=gen)
        out = pagedkv.paged_attention(cache.bind(pt, lengths=lengths + 1), 0, q, window=5)
        first = max(0, t - 4)
        expected = reference(q, k_all[:, first:t + 1], k_all[:, first:t + 1] * 2, [t + 1 - first])
        assert (out.double() - expected).abs().max() < 1e-5, t
        seqs.commit_append(a, 1)
    pt, lengths = seqs.batch([a])
    assert pt[0, 0] == -1
    raises_runtime(lambda: pagedkv.paged_attention(cache.bind(pt, lengths=lengths), 0, torch.randn(1, 1, 2, 16)),
                   "paged_attention")


def test_bad_options_raise_and_change_nothing(layout):
    cache, pt, lens, k, v = filled(layout, [6, 9])
    q = torch.randn(2, 2, 4, 16)
    view = cache.bind(pt, lengths=lens)
    before = snapshot(cache)
    bad = [
        (dict(window=-1), ["'options.window'", "got -1"]),
        (dict(softcap=-2.0), ["'options.softcap'", "got -2"]),
        (dict(softcap=float("nan")), ["'options.softcap'", "finite"]),
        (dict(sinks=torch.zeros(3)), ["'options.sinks'", "[4]"]),
        (dict(sinks=torch.zeros(4, dtype=torch.float64)), ["'options.sinks'", "float32"]),
        (dict(tree_mask=torch.ones(2, 2, 3, dtype=torch.bool)), ["'options.tree_mask'", "[2, 2, 2]"]),
        (dict(tree_mask=torch.ones(2, 2, 2, dtype=torch.uint8)), ["'options.tree_mask'", "bool"]),
    ]
    for options, phrases in bad:
        raises_runtime(lambda: pagedkv.paged_attention(view, 0, q, **options), "paged_attention", *phrases)
        raises_runtime(lambda: ops.paged_attention(cache.k_cache, cache.v_cache, 0, pt, lens, q, layout=layout,
                                                   **options), "paged_attention", *phrases)
    assert_unchanged(cache, before)


@needs_compile
def test_options_under_torch_compile(layout):
    torch._dynamo.reset()
    cache, pt, lens, k, v = filled(layout, [11, 18], seed=6)
    q = torch.randn(2, 3, 4, 16)
    options = OPTION_CASES["all"]

    def attend(k_cache, v_cache, page_table, lengths, q, sinks, tree_mask):
        return ops.paged_attention(k_cache, v_cache, 0, page_table, lengths, q * 0.5, 0.0, layout=layout, window=6,
                                   softcap=3.0, sinks=sinks, tree_mask=tree_mask)

    args = (cache.k_cache, cache.v_cache, pt, lens, q, options["sinks"], options["tree_mask"])
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    assert_bit_equal(compiled(*args), attend(*args), "compiled against eager")
