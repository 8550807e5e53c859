"""pagedkv.PagedCache, CacheView, paged_attention, SequenceTable and
PrefixCache from Python: attributes, lifetimes, quantized pages, and the
engine flow (sequences -> batch -> bind -> write -> attention)."""
import gc
import math

import pytest
import torch

import pagedkv
from conftest import assert_bit_equal, make_cache


def test_storage_attributes_are_the_storage(layout):
    cache = make_cache(layout, torch.float16, n_layers=3, n_pages=5, page_size=4, n_kv_heads=2, head_dim=8)
    page = (4, 2, 8) if layout == "NHD" else (2, 4, 8)
    assert tuple(cache.k_cache.shape) == (3, 5) + page and tuple(cache.v_cache.shape) == (3, 5) + page
    assert cache.k_cache is cache.k_cache  # the same tensor every time, not a copy
    ptr = cache.k_cache.data_ptr()
    p = cache.alloc()
    k = torch.ones(1, 1, 2, 8).half()
    cache.write(2, torch.tensor([[p]]), 1, k, k * 2)
    assert cache.k_cache.data_ptr() == ptr
    token = cache.k_cache[2, p, 1] if layout == "NHD" else cache.k_cache[2, p, :, 1]
    assert torch.equal(token, k[0, 0])
    cache.k_cache[2, p].zero_()  # writes through the attribute reach the cache
    assert torch.count_nonzero(cache.gather(2, torch.tensor([[p]]))[0]) == 0
    assert (cache.n_layers, cache.n_pages, cache.page_size, cache.n_kv_heads, cache.head_dim) == (3, 5, 4, 2, 8)
    assert cache.dtype == torch.float16 and cache.device == torch.device("cpu") and cache.layout == layout
    assert cache.k_format == cache.v_format == "native" and cache.k_scales is None and cache.v_scales is None
    assert "pagedkv.PagedCache(n_layers=3" in repr(cache)
    cache.check()


@pytest.mark.parametrize("k_format,v_format", [("fp8", "int8"), ("int8", "native")])
def test_quantized_storage(layout, k_format, v_format):
    cache = make_cache(layout, torch.bfloat16, k_format=k_format, v_format=v_format)
    codes = {"fp8": torch.uint8, "int8": torch.int8, "native": torch.bfloat16}
    assert cache.k_cache.dtype == codes[k_format] and cache.v_cache.dtype == codes[v_format]
    assert cache.k_format == {"fp8": "fp8_e4m3"}.get(k_format, k_format)
    assert tuple(cache.k_scales.shape) == (2, 16, 4 * 2) and cache.k_scales.dtype == torch.float32
    assert (cache.v_scales is None) == (v_format == "native")
    assert cache.dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_quantized_error_bounds(layout, fmt):
    """Per element: fp8 |x - x'| <= 2^-4 |x| + 2^-10 scale, int8 <= scale / 2 (before rounding to the dtype)."""
    cache = make_cache(layout, torch.float32, n_pages=8, page_size=3, n_kv_heads=2, head_dim=16, kv_format=fmt)
    pages = cache.alloc_n(8)
    pt = torch.tensor([pages[:4], pages[4:]])
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 12, 2, 16, generator=gen) * torch.logspace(-3, 3, 16)
    cache.write(0, pt, 0, x, -x)
    k, v = cache.gather(0, pt)
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = amax / (448.0 if fmt == "fp8" else 127.0)
    bound = x.abs() / 16 + scale / 1024 if fmt == "fp8" else scale / 2
    assert ((k - x).abs() <= bound * (1 + 1e-6)).all()
    assert ((v + x).abs() <= bound * (1 + 1e-6)).all()


def test_views(layout):
    cache = make_cache(layout)
    pages = cache.alloc_n(4)
    pt = torch.tensor([pages[:2], pages[2:]])
    k = torch.randn(2, 8, 2, 8)
    view = cache.bind(pt)
    view.write(0, 0, k, k + 1)
    assert view.page_table is pt and view.lengths is None and view.total_len == 0
    got_k, got_v = view.gather(0)
    assert_bit_equal(got_k, k)
    assert_bit_equal(got_v, k + 1)
    assert cache.bind(pt, 5).gather(0)[0].shape[1] == 5  # positional total_len
    assert cache.bind(pt, total_len=6).gather(0)[0].shape[1] == 6
    lengths = torch.tensor([3, 7])
    for v in (cache.bind(pt, lengths=lengths), cache.bind(pt, lengths)):  # keyword, or in total_len's place
        assert v.lengths is lengths
        gk, _ = v.gather(0)
        assert gk.shape[1] == 7 and torch.count_nonzero(gk[0, 3:]) == 0 and torch.equal(gk[1], k[1, :7])
    starts = torch.tensor([7, 1])
    view.write(1, starts, k[:, :1], k[:, :1])  # per-sequence start positions
    got_k = cache.gather(1, pt, torch.tensor([8, 2]))[0]
    assert_bit_equal(got_k[0, 7], k[0, 0])
    assert_bit_equal(got_k[1, 1], k[1, 0])


def test_objects_keep_what_they_need_alive(layout):
    cache = make_cache(layout)
    pages = cache.alloc_n(2)
    pt = torch.tensor([pages])
    view = cache.bind(pt, torch.tensor([8]))
    seqs = pagedkv.SequenceTable(cache)
    prefix = pagedkv.PrefixCache(seqs)
    host_cache = make_cache("NHD")
    host = pagedkv.SequenceTable(host_cache)
    s = seqs.create()
    assert seqs.prepare_append(s, 3)
    seqs.commit_append(s, 3)
    assert seqs.swap_out(s, host)  # s's tokens now live in host's cache
    assert host_cache.n_free() == 15
    del cache, seqs, host
    gc.collect()
    k = torch.ones(1, 8, 2, 8)
    view.write(0, 0, k, k)  # the view keeps its cache alive
    assert torch.equal(view.gather(0)[0], k)
    seqs = prefix.seqs  # the prefix cache keeps its table alive, the table its cache
    assert seqs.cache.n_free() == 14
    seqs.release(s)  # frees s's copy in the host table, which the table kept alive
    assert host_cache.n_free() == 16
    assert prefix.n_cached() == 0


def attention_reference(k, v, lengths, q, scale):
    B, Sq, n_heads, D = q.shape
    group = n_heads // k.shape[2]
    out = torch.zeros(B, Sq, n_heads, D, dtype=torch.float64)
    for b in range(B):
        for s in range(Sq):
            pos = int(lengths[b]) - Sq + s
            for h in range(n_heads):
                w = torch.softmax(k[b, :pos + 1, h // group].double() @ q[b, s, h].double() * scale, 0)
                out[b, s, h] = w @ v[b, :pos + 1, h // group].double()
    return out


@pytest.mark.parametrize("kv_format", ["native", "fp8", "int8"])
def test_engine_flow(layout, kv_format):
    """Sequences grow, share a prefix by fork, decode; attention equals a float64 reference on the gathered
    context (what the pages hold)."""
    cache = make_cache(layout, torch.float32, n_layers=2, n_pages=32, page_size=4, n_kv_heads=2, head_dim=16,
                       kv_format=kv_format)
    seqs = pagedkv.SequenceTable(cache)
    gen = torch.Generator().manual_seed(8)
    a = seqs.create()
    assert seqs.prepare_append(a, 10)
    pt, lengths = seqs.batch([a])
    assert pt.dtype == torch.int32 and lengths.tolist() == [0]
    prompt = torch.randn(2, 1, 10, 2, 16, generator=gen)
    for layer in range(2):
        cache.write(layer, pt, 0, prompt[layer], prompt[layer] * 2)
    seqs.commit_append(a, 10)
    b = seqs.fork(a)
    assert seqs.pages(b) == seqs.pages(a) and all(cache.ref_count(p) == 2 for p in seqs.pages(a))
    for step in range(6):
        for s in (a, b):
            assert seqs.prepare_append(s, 1)  # copy-on-write of the shared last page
        pt, lengths = seqs.batch([a, b])
        view = cache.bind(pt, lengths + 1)
        q = torch.randn(2, 1, 4, 16, generator=gen)
        for layer in range(2):
            kv = torch.randn(2, 1, 2, 16, generator=gen)
            view.write(layer, lengths, kv, kv * 2)
            out = pagedkv.paged_attention(view, layer, q)
            k_all, v_all = view.gather(layer)
            ref = attention_reference(k_all, v_all, lengths + 1, q, 1 / math.sqrt(16))
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        for s in (a, b):
            seqs.commit_append(s, 1)
    assert seqs.length(a) == seqs.length(b) == 16
    shared = [p for p in seqs.pages(a) if p in seqs.pages(b)]
    assert len(shared) == 2  # the two full prompt pages stay shared; the third was copied on write
    n_free = cache.n_free()
    seqs.release(b)
    assert cache.n_free() == n_free + 2
    assert seqs.size() == 1 and not seqs.contains(b) and seqs.capacity(a) >= 16


def test_swap_out_and_in_across_layouts(layout):
    dev = make_cache(layout, torch.float16, n_pages=8)
    host = make_cache("HND" if layout == "NHD" else "NHD", torch.float16, n_pages=8)
    seqs, host_seqs = pagedkv.SequenceTable(dev), pagedkv.SequenceTable(host)
    s = seqs.create()
    assert seqs.prepare_append(s, 7)
    pt, _ = seqs.batch([s])
    k = torch.randn(1, 7, 2, 8).half()
    for layer in range(2):
        dev.write(layer, pt, 0, k, -k)
    seqs.commit_append(s, 7)
    before = [dev.gather(layer, pt, torch.tensor([7])) for layer in range(2)]
    assert seqs.swap_out(s, host_seqs) and seqs.swapped(s) and dev.n_free() == 8
    assert seqs.swap_in(s, host_seqs) and not seqs.swapped(s) and host.n_free() == 8
    pt, lengths = seqs.batch([s])
    for layer in range(2):
        for g, w in zip(dev.gather(layer, pt, lengths), before[layer]):
            assert_bit_equal(g, w)


def test_copy_pages_between_layouts(layout):
    a = make_cache(layout, torch.float32, n_pages=4)
    b = make_cache("HND" if layout == "NHD" else "NHD", torch.float32, n_pages=4)
    pa, pb = a.alloc_n(2), b.alloc_n(3)
    k = torch.randn(1, 8, 2, 8)
    a.write(1, torch.tensor([pa]), 0, k, k)
    b.copy_pages_from(a, torch.tensor(pa), torch.tensor(pb[1:]))
    assert_bit_equal(b.gather(1, torch.tensor([pb[1:]]))[0], k)
    a.copy_pages(torch.tensor([pa[0]]), torch.tensor([pa[1]]))
    assert_bit_equal(a.gather(1, torch.tensor([[pa[1]]]))[0], k[:, :4])


def test_prefix_cache(layout):
    cache = make_cache(layout, n_pages=16, page_size=4)
    seqs = pagedkv.SequenceTable(cache)
    prefix = pagedkv.PrefixCache(seqs)
    prompt = torch.arange(100, 111)  # 11 tokens: two full pages
    s = seqs.create()
    assert seqs.prepare_append(s, 11)
    seqs.commit_append(s, 11)
    assert prefix.insert(s, prompt) == 2 and prefix.n_cached() == 2
    assert prefix.peek(prompt) == 8
    t, matched = prefix.acquire(prompt)
    assert matched == 8 and seqs.length(t) == 8 and seqs.pages(t)[:2] == seqs.pages(s)[:2]
    assert prefix.acquire(prompt, salt=5) == (t + 1, 0)  # another salt shares nothing
    stats = prefix.stats()
    assert (stats.lookups, stats.hit_tokens, stats.inserted_pages) == (2, 8, 2)
    assert "PrefixStats(lookups=2" in repr(stats)
    seqs.release(s)
    seqs.release(t)
    assert prefix.n_evictable() == 1  # the leaf; the first page continues into it
    assert prefix.evict(1) == 1
    prefix.clear()
    assert prefix.n_cached() == 0 and cache.n_free() == 16
    prefix.reset_stats()
    assert prefix.stats().lookups == 0
    prefix.check()
