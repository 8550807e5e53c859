"""The stateless operators torch.ops.pagedkv.*: the same results as the
classes (the same kernels), on the CPU kernels and on the ATen path that
CUDA tensors take; opcheck for every operator on torch 2.x."""
import math
import random

import pytest
import torch

import pagedkv
from conftest import (DTYPES, LAYOUTS, assert_bit_equal, generic_backend, make_cache, needs_opcheck)

ops = torch.ops.pagedkv
FORMATS = [("native", "native"), ("fp8", "fp8"), ("int8", "int8"), ("fp8", "int8"), ("native", "int8")]
FORMAT_IDS = ["%s-%s" % f for f in FORMATS]


def cache_args(cache):
    """The keyword arguments that describe a cache's pages to an op."""
    return dict(layout=cache.layout, k_scales=cache.k_scales, v_scales=cache.v_scales)


def gather_args(cache):
    args = cache_args(cache)
    if cache.k_format != "native" and cache.v_format != "native":
        args["dtype"] = cache.dtype
    return args


def storage(cache):
    return [t for t in (cache.k_cache, cache.v_cache, cache.k_scales, cache.v_scales) if t is not None]


def assert_same_storage(a, b, what):
    for x, y in zip(storage(a), storage(b)):
        assert_bit_equal(x, y, what)


def random_batch(rng, pages, page_size, max_batch=3):
    """A page table of distinct allocated pages [B, cols] plus start positions and a token count that fit it."""
    batch = rng.randint(1, min(max_batch, len(pages)))
    cols = rng.randint(1, len(pages) // batch)
    chosen = rng.sample(pages, batch * cols)
    capacity = cols * page_size
    n_tokens = rng.randint(0, capacity)
    starts = [rng.randint(0, capacity - n_tokens) for _ in range(batch)]
    return chosen, batch, cols, starts, n_tokens


def kv(gen, batch, n_tokens, heads, dim, dtype, strided):
    if strided:  # slices of one fused QKV-like tensor, any strides
        fused = torch.randn(batch, n_tokens, 3 * heads, dim, generator=gen).to(dtype)
        return fused[:, :, heads:2 * heads], fused[:, :, 2 * heads:]
    return (torch.randn(batch, n_tokens, heads, dim, generator=gen).to(dtype),
            torch.randn(batch, n_tokens, heads, dim, generator=gen).to(dtype))


def run_pair(a, b, seed, steps=40, generic=False):
    """The same random writes and gathers through the class (a) and the ops (b); every result compared."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pages = a.alloc_n(a.n_pages)
    assert b.alloc_n(b.n_pages) == pages
    P, H, D = a.page_size, a.n_kv_heads, a.head_dim
    compared = 0
    for step in range(steps):
        chosen, batch, cols, starts, n_tokens = random_batch(rng, pages, P)
        index_dtype = rng.choice([torch.int32, torch.int64])
        pt = torch.tensor(chosen, dtype=index_dtype).view(batch, cols)
        layer = rng.randrange(a.n_layers)
        k, v = kv(gen, batch, n_tokens, H, D, a.dtype, rng.random() < 0.5)
        if rng.random() < 0.5:
            start = starts[0]
            starts = [start] * batch
            a.write(layer, pt, start, k, v)
            with generic_backend(generic):
                ops.write(b.k_cache, b.v_cache, layer, pt, start, k, v, **cache_args(b))
        else:
            start = torch.tensor(starts, dtype=rng.choice([torch.int32, torch.int64]))
            a.write(layer, pt, start, k, v)
            with generic_backend(generic):
                ops.write.starts(b.k_cache, b.v_cache, layer, pt, start, k, v, **cache_args(b))
        assert_same_storage(a, b, "step %d write" % step)
        # gathers: every mapped token, the first total_len, per-sequence lengths
        lengths = torch.tensor([rng.randint(0, cols * P) for _ in range(batch)])
        total_len = rng.randint(1, cols * P)
        want = [a.gather(layer, pt), a.bind(pt, total_len).gather(layer), a.gather(layer, pt, lengths)]
        with generic_backend(generic):
            got = [ops.gather(b.k_cache, b.v_cache, layer, pt, **gather_args(b)),
                   ops.gather(b.k_cache, b.v_cache, layer, pt, total_len, **gather_args(b)),
                   ops.gather.lengths(b.k_cache, b.v_cache, layer, pt, lengths, **gather_args(b))]
        for i, (w, g) in enumerate(zip(want, got)):
            assert_bit_equal(g[0], w[0], "step %d gather %d k" % (step, i))
            assert_bit_equal(g[1], w[1], "step %d gather %d v" % (step, i))
            compared += 1
    return compared


@pytest.mark.parametrize("formats", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_write_gather_ops_match_the_class(layout, formats, dtype, page_size):
    k_format, v_format = formats
    a = make_cache(layout, dtype, n_pages=12, page_size=page_size, k_format=k_format, v_format=v_format)
    b = make_cache(layout, dtype, n_pages=12, page_size=page_size, k_format=k_format, v_format=v_format)
    assert run_pair(a, b, seed=page_size * 7 + len(layout)) == 120


@pytest.mark.parametrize("formats", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_aten_path_gives_the_same_bits(layout, formats, dtype):
    """The ops on the ATen path (what CUDA tensors take) against the class on the CPU kernels."""
    k_format, v_format = formats
    a = make_cache(layout, dtype, n_pages=10, page_size=3, k_format=k_format, v_format=v_format)
    b = make_cache(layout, dtype, n_pages=10, page_size=3, k_format=k_format, v_format=v_format)
    assert run_pair(a, b, seed=11, steps=20, generic=True) == 60


def attention_reference(k, v, lengths, q, scale):
    """float64 causal attention over gathered k, v [B, T, H, D] (zeros past each length)."""
    B, Sq, n_heads, D = q.shape
    group = n_heads // k.shape[2]
    out = torch.zeros(B, Sq, n_heads, D, dtype=torch.float64)
    for b in range(B):
        L = int(lengths[b])
        for s in range(Sq):
            pos = L - Sq + s
            for h in range(n_heads):
                keys = k[b, :pos + 1, h // group].double()
                vals = v[b, :pos + 1, h // group].double()
                w = torch.softmax(keys @ q[b, s, h].double() * scale, dim=0)
                out[b, s, h] = w @ vals
    return out


@pytest.mark.parametrize("formats", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_op(layout, formats, dtype):
    k_format, v_format = formats
    cache = make_cache(layout, dtype, n_layers=2, n_pages=24, page_size=3, n_kv_heads=2, head_dim=16,
                       k_format=k_format, v_format=v_format)
    gen = torch.Generator().manual_seed(5)
    rows = [cache.alloc_n(6), cache.alloc_n(3) + [-1] * 3, cache.alloc_n(5) + [-1]]
    pt = torch.tensor(rows)
    lengths = torch.tensor([17, 9, 13])
    n_queries = 2
    for layer in range(2):
        k = torch.randn(3, 18, 2, 16, generator=gen).to(dtype)
        v = torch.randn(3, 18, 2, 16, generator=gen).to(dtype)
        cache.write(layer, pt, 0, k[:, :9], v[:, :9])
        cache.write(layer, pt[:1], 9, k[:1, 9:17], v[:1, 9:17])
        cache.write(layer, pt[2:], 9, k[2:, 9:13], v[2:, 9:13])
    q = torch.randn(3, n_queries, 4, 16, generator=gen).to(dtype)  # GQA: 4 query heads over 2 kv heads
    for scale in (0.0, 0.3):
        view = cache.bind(pt, lengths)
        want = pagedkv.paged_attention(view, 1, q, scale)
        got = ops.paged_attention(cache.k_cache, cache.v_cache, 1, pt, lengths, q, scale, **cache_args(cache))
        assert_bit_equal(got, want, "op vs class")
        assert_bit_equal(view.paged_attention(1, q, scale), want, "view method vs function")
        k_all, v_all = cache.gather(1, pt, lengths)
        ref = attention_reference(k_all, v_all, lengths, q, scale if scale > 0 else 1 / math.sqrt(16))
        tol = 2e-2 if dtype != torch.float32 else 1e-5
        torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
        with generic_backend(True):
            aten = ops.paged_attention(cache.k_cache, cache.v_cache, 1, pt, lengths, q, scale, **cache_args(cache))
        torch.testing.assert_close(aten.double(), got.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("formats", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("generic", [False, True], ids=["cpu", "aten"])
def test_copy_pages_op(layout, formats, generic):
    k_format, v_format = formats
    a = make_cache(layout, torch.float16, n_pages=8, k_format=k_format, v_format=v_format)
    b = make_cache(layout, torch.float16, n_pages=8, k_format=k_format, v_format=v_format)
    gen = torch.Generator().manual_seed(9)
    for c in (a, b):
        assert c.alloc_n(8) == list(range(8))
    k = torch.randn(1, 32, 2, 8, generator=gen).half()
    v = torch.randn(1, 32, 2, 8, generator=gen).half()
    for layer in range(2):
        a.write(layer, torch.arange(8).view(1, 8), 0, k, v)
        b.write(layer, torch.arange(8).view(1, 8), 0, k, v)
    for src, dst in (([0, 1], [5, 6]), ([2, 3], [3, 2]), ([4], [4]), ([], [])):  # plain, swap, onto itself, none
        a.copy_pages(torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long))
        with generic_backend(generic):
            ops.copy_pages(b.k_cache, b.v_cache, torch.tensor(src, dtype=torch.int32),
                           torch.tensor(dst, dtype=torch.int32), **cache_args(b))
        assert_same_storage(a, b, "copy %s -> %s" % (src, dst))
    assert not torch.equal(a.k_cache[:, 2], a.k_cache[:, 3]) or k_format != "native"


def test_ops_write_into_the_class_storage(layout):
    """An engine may mix the two: ops write a PagedCache's tensors, its methods read them back."""
    cache = make_cache(layout, torch.bfloat16)
    pages = cache.alloc_n(4)
    pt = torch.tensor([pages[:2], pages[2:]])
    k = torch.randn(2, 8, 2, 8).bfloat16()
    v = torch.randn(2, 8, 2, 8).bfloat16()
    ops.write(cache.k_cache, cache.v_cache, 1, pt, 0, k, v, layout=layout)
    got_k, got_v = cache.gather(1, pt)
    assert_bit_equal(got_k, k)
    assert_bit_equal(got_v, v)
    cache.check()


def test_overloads_resolve_by_argument_type():
    cache = make_cache("NHD", torch.float32)
    pages = cache.alloc_n(2)
    pt = torch.tensor([pages])
    k = torch.randn(1, 5, 2, 8)
    ops.write(cache.k_cache, cache.v_cache, 0, pt, 1, k, k)  # int start_pos: write.default
    ops.write(cache.k_cache, cache.v_cache, 0, pt, torch.tensor([1]), k, k)  # tensor: write.starts
    assert ops.gather(cache.k_cache, cache.v_cache, 0, pt)[0].shape[1] == 8
    assert ops.gather(cache.k_cache, cache.v_cache, 0, pt, torch.tensor([6]))[0].shape[1] == 6  # gather.lengths


# ---- opcheck (torch 2.x) ----


def opcheck_samples(layout, formats, dtype=torch.float16, requires_grad=False):
    """(op, args, kwargs) for every operator on one cache; values written first."""
    k_format, v_format = formats
    cache = make_cache(layout, dtype, n_pages=8, page_size=3, k_format=k_format, v_format=v_format)
    pages = cache.alloc_n(8)
    pt = torch.tensor([pages[:3], pages[3:6]], dtype=torch.int32)
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(2, 7, 2, 8, generator=gen).to(dtype)
    v = torch.randn(2, 7, 2, 8, generator=gen).to(dtype)
    cache.write(0, pt, 0, k, v)
    cache.write(1, pt, 0, k, v)
    kc, vc = cache.k_cache, cache.v_cache
    lengths = torch.tensor([7, 5])
    q = torch.randn(2, 1, 4, 8, generator=gen).to(dtype).requires_grad_(requires_grad)
    ca, ga = cache_args(cache), gather_args(cache)
    k_new, v_new = k[:, :2].clone().requires_grad_(requires_grad), v[:, :2].clone()
    return [
        (ops.write.default, (kc, vc, 1, pt, 7, k_new, v_new), ca),
        (ops.write.starts, (kc, vc, 0, pt, torch.tensor([7, 6]), k_new, v_new), ca),
        (ops.gather.default, (kc, vc, 1, pt), ga),
        (ops.gather.default, (kc, vc, 1, pt, 5), ga),
        (ops.gather.lengths, (kc, vc, 0, pt, lengths), ga),
        (ops.paged_attention.default, (kc, vc, 1, pt, lengths, q), ca),
        (ops.paged_attention.default, (kc, vc, 1, pt, lengths, q, 0.25), ca),
        (ops.copy_pages.default, (kc, vc, torch.tensor([0, 1]), torch.tensor([6, 7])), ca),
        (ops.paged_attention.default, (kc, vc, 1, pt, lengths, q.expand(2, 2, 4, 8)),
         dict(ca, window=3, softcap=5.0, sinks=torch.linspace(-1, 1, 4),
              tree_mask=torch.tensor([[[True, False], [True, True]], [[True, False], [False, True]]]))),
    ]


@needs_opcheck
@pytest.mark.parametrize("formats", [("native", "native"), ("fp8", "int8"), ("native", "fp8")],
                         ids=["native", "fp8-int8", "native-fp8"])
def test_opcheck(layout, formats):
    checked = set()
    for op, args, kwargs in opcheck_samples(layout, formats):
        torch.library.opcheck(op, args, kwargs)
        checked.add(op.name() + "." + op._overloadname)
    assert len(checked) == 6


@needs_opcheck
def test_opcheck_with_inputs_that_require_grad(layout):
    """The ops are not differentiable, and registered so: their outputs never require grad."""
    checked = 0
    for op, args, kwargs in opcheck_samples(layout, ("native", "native"), dtype=torch.float32, requires_grad=True):
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            torch.library.opcheck(op, args, kwargs)
            checked += 1
    assert checked == 5  # write, write.starts, and attention three times (once with every option)
    sample = opcheck_samples(layout, ("native", "native"), dtype=torch.float32, requires_grad=True)[5]
    out = ops.paged_attention.default(*sample[1], **sample[2])
    assert sample[1][5].requires_grad and not out.requires_grad


def test_outputs_never_require_grad(layout):
    """On every torch (1.13 too): a non-differentiable op's outputs do not require grad."""
    cache = make_cache(layout, torch.float32)
    pages = cache.alloc_n(2)
    pt = torch.tensor([pages])
    k = torch.randn(1, 5, 2, 8, requires_grad=True)
    ops.write(cache.k_cache, cache.v_cache, 0, pt, 0, k, k.detach(), layout=layout)
    assert not cache.k_cache.requires_grad
    q = torch.randn(1, 1, 2, 8, requires_grad=True)
    out = ops.paged_attention(cache.k_cache, cache.v_cache, 0, pt, torch.tensor([5]), q, layout=layout)
    assert not out.requires_grad
    kc = cache.k_cache.clone().requires_grad_(True)
    assert not any(t.requires_grad for t in ops.gather(kc, cache.v_cache, 0, pt, layout=layout))


@pytest.mark.parametrize("where", ["inference_mode", "created_in_inference_mode", "no_grad"])
def test_engine_contexts(where):
    """Engines run under torch.inference_mode() or no_grad; a cache made in inference mode holds inference
    tensors, which the ops and methods must still write outside it."""
    if where == "created_in_inference_mode":
        with torch.inference_mode():
            cache = make_cache("NHD", torch.float32)
        context = torch.no_grad()
    else:
        cache = make_cache("NHD", torch.float32)
        context = torch.inference_mode() if where == "inference_mode" else torch.no_grad()
    with context:
        pages = cache.alloc_n(2)
        pt = torch.tensor([pages])
        k = torch.randn(1, 5, 2, 8)
        ops.write(cache.k_cache, cache.v_cache, 0, pt, 0, k, k)
        cache.write(1, pt, 0, k, k)
        for layer in range(2):
            assert_bit_equal(ops.gather(cache.k_cache, cache.v_cache, layer, pt, 5)[0], k)
        out = ops.paged_attention(cache.k_cache, cache.v_cache, 0, pt, torch.tensor([5]), torch.randn(1, 1, 2, 8))
        assert out.shape == (1, 1, 2, 8)
