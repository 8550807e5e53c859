"""Bad input for every operator and method: RuntimeError naming the call,
the argument, what was expected and what was given; nothing changes.

The operators have no pool: they check shapes, dtypes, devices, formats and
that every page id a call touches is in range (a -1 where a write lands or a
length reads included). The classes also check the pool (use after free,
double free, shared pages).
"""
import pytest
import torch

import pagedkv
from conftest import (assert_tensors_unchanged, assert_unchanged, make_cache, raises_runtime, snapshot,
                      tensors_snapshot)

ops = torch.ops.pagedkv


def cache_kwargs(cache):
    return dict(layout=cache.layout, k_scales=cache.k_scales, v_scales=cache.v_scales)


@pytest.fixture(params=[("NHD", "native"), ("HND", "native"), ("NHD", "fp8"), ("HND", "int8")],
                ids=["NHD", "HND", "NHD-fp8", "HND-int8"])
def setup(request):
    """A cache (2 layers, 8 pages of 4 tokens, 2 heads, dim 8, float16) with two sequences written."""
    layout, fmt = request.param
    cache = make_cache(layout, torch.float16, n_pages=8, kv_format=fmt)
    pages = cache.alloc_n(6)
    pt = torch.tensor([pages[:3], pages[3:]])
    k = torch.randn(2, 12, 2, 8).half()
    for layer in range(2):
        cache.write(layer, pt, 0, k, k)
    return cache, pt


def storage_of(cache):
    return [cache.k_cache, cache.v_cache, cache.k_scales, cache.v_scales]


def op_raises(cache, fn, *phrases):
    """The op call raises RuntimeError with every phrase and leaves the cache tensors as they were."""
    tensors = storage_of(cache)
    before = tensors_snapshot(*tensors)
    pool = snapshot(cache)
    message = raises_runtime(fn, *phrases)
    assert_tensors_unchanged(tensors, before)
    assert_unchanged(cache, pool)
    return message


K = lambda *shape, dtype=torch.float16: torch.zeros(*shape, dtype=dtype)  # noqa: E731


def test_write_op(setup):
    cache, pt = setup
    kc, vc, kw = cache.k_cache, cache.v_cache, cache_kwargs(cache)
    k = K(2, 3, 2, 8)

    def write(*args, **over):
        a = dict(kw)
        a.update(over)
        return lambda: ops.write(*args, **a)

    name = "pagedkv::write"
    op_raises(cache, write(kc, vc, 0, pt, 0, k, k, layout="XYZ"), name, "argument 'layout'", "\"XYZ\"")
    op_raises(cache, write(kc[0], vc[0], 0, pt, 0, k, k), name, "argument 'k_cache' expected 5-D", "4-D")
    op_raises(cache, write(kc, vc[:, :4].contiguous(), 0, pt, 0, k, k), name, "argument 'v_cache' expected shape")
    op_raises(cache, write(kc.transpose(0, 1), vc.transpose(0, 1), 0, pt, 0, k, k), name,
              "argument 'k_cache' expected a contiguous tensor")
    op_raises(cache, write(kc, vc, 2, pt, 0, k, k), name, "argument 'layer' expected in [0, 2), got 2")
    op_raises(cache, write(kc, vc, -1, pt, 0, k, k), name, "argument 'layer'", "got -1")
    op_raises(cache, write(kc, vc, 0, pt[0], 0, k, k), name, "argument 'page_table' expected 2-D", "1-D")
    op_raises(cache, write(kc, vc, 0, pt.float(), 0, k, k), name, "argument 'page_table' expected dtype int32 or int64")
    op_raises(cache, write(kc, vc, 0, pt, 0, K(2, 3, 2), k), name, "argument 'k' expected 4-D", "3-D")
    op_raises(cache, write(kc, vc, 0, pt, 0, K(2, 3, 3, 8), K(2, 3, 3, 8)), name, "argument 'k' expected n_kv_heads 2")
    op_raises(cache, write(kc, vc, 0, pt, 0, K(2, 3, 2, 4), K(2, 3, 2, 4)), name, "argument 'k' expected head_dim 8")
    op_raises(cache, write(kc, vc, 0, pt, 0, K(3, 3, 2, 8), K(3, 3, 2, 8)), name, "argument 'k' expected batch 2")
    op_raises(cache, write(kc, vc, 0, pt, 0, k, K(2, 4, 2, 8)), name, "arguments 'k' and 'v' expected equal shapes")
    op_raises(cache, write(kc, vc, 0, pt, -1, k, k), name, "argument 'start_pos' expected >= 0, got -1")
    op_raises(cache, write(kc, vc, 0, pt, 10, k, k), name, "write of 3 tokens at start_pos 10",
              "a write past the last column")
    op_raises(cache, write(kc, vc, 0, torch.tensor([[0, 1, 8], [3, 4, 5]]), 8, k, k), name,
              "argument 'page_table' expected a page id in [0, 8) at page_table[0][2], got 8")
    op_raises(cache, write(kc, vc, 0, torch.tensor([[0, 1, -1], [3, 4, 5]]), 8, k, k), name,
              "at page_table[0][2], got -1 (unmapped)")
    if cache.k_scales is None:
        op_raises(cache, write(kc, vc, 0, pt, 0, k.float(), k.float()), name, "argument 'k' expected dtype Half")
        op_raises(cache, write(kc, vc.float(), 0, pt, 0, k, k), name, "argument 'v_cache' expected dtype Half")
        op_raises(cache, write(kc, vc, 0, pt, 0, k, k, k_scales=torch.zeros(2, 8, 8)), name,
                  "argument 'k_cache' expected dtype Byte (fp8 e4m3 codes) or Char (int8 codes)")
    else:
        op_raises(cache, write(kc, vc, 0, pt, 0, k.int(), k.int()), name, "argument 'k' expected dtype float32, "
                  "float16 or bfloat16 for quantized pages")
        op_raises(cache, write(kc, vc, 0, pt, 0, k, k, k_scales=cache.k_scales[:, :4]), name,
                  "argument 'k_scales' expected shape [2, 8, 8]")
        op_raises(cache, write(kc, vc, 0, pt, 0, k, k, v_scales=cache.v_scales.double()), name,
                  "argument 'v_scales' expected dtype Float")
    # per-sequence starts
    # (ops.write.starts by name: a one-element start_pos tensor would also convert to write.default's int)
    starts = lambda s: (lambda: ops.write.starts(kc, vc, 0, pt, s, k, k, **kw))  # noqa: E731
    op_raises(cache, starts(torch.tensor([0])), name, "argument 'start_pos' expected shape [2]")
    op_raises(cache, starts(torch.tensor([0.0, 1.0])), name, "argument 'start_pos' expected dtype int32 or int64")
    op_raises(cache, starts(torch.tensor([0, -2])), name, "argument 'start_pos' expected every value >= 0",
              "start_pos[1] = -2")
    op_raises(cache, starts(torch.tensor([0, 10])), name, "in row 1", "a write past the last column")


def test_gather_ops(setup):
    cache, pt = setup
    kc, vc, kw = cache.k_cache, cache.v_cache, cache_kwargs(cache)
    if cache.k_scales is not None:
        kw["dtype"] = torch.float16
    name = "pagedkv::gather"
    g = lambda *a, **over: (lambda: ops.gather(kc, vc, *a, **dict(kw, **over)))  # noqa: E731
    op_raises(cache, g(5, pt), name, "argument 'layer' expected in [0, 2), got 5")
    op_raises(cache, g(0, pt.view(-1)), name, "argument 'page_table' expected 2-D")
    op_raises(cache, g(0, pt, -1), name, "argument 'total_len' expected >= 0, got -1")
    op_raises(cache, g(0, pt, 13), name, "argument 'total_len' expected <= 12", "got 13")
    op_raises(cache, g(0, torch.tensor([[0, 9]])), name, "expected a page id in [0, 8) at page_table[0][1], got 9")
    op_raises(cache, g(0, torch.tensor([[0, 9]]), 5), name, "at page_table[0][1], got 9")
    if cache.k_scales is None:
        op_raises(cache, g(0, pt, dtype=torch.float32), name, "argument 'dtype' expected dtype Half", "got Float")
    else:
        op_raises(cache, g(0, pt, dtype=None), name, "argument 'dtype' expected a dtype", "got None")
        op_raises(cache, g(0, pt, dtype=torch.int32), name, "argument 'dtype' expected dtype float32, float16 or "
                  "bfloat16 for quantized pages")
    gl = lambda *a: (lambda: ops.gather.lengths(kc, vc, *a, **kw))  # noqa: E731
    op_raises(cache, gl(0, pt, torch.tensor([1, 2, 3])), name, "argument 'lengths' expected shape [2]")
    op_raises(cache, gl(0, pt, torch.tensor([1, -1])), name, "argument 'lengths' expected every value >= 0")
    op_raises(cache, gl(0, pt, torch.tensor([13, 1])), name, "argument 'lengths' expected lengths[0] <= 12 (the tokens", "got 13")
    op_raises(cache, gl(0, torch.tensor([[0, -1, 2], [3, 4, 5]]), torch.tensor([5, 1])), name,
              "expected lengths[0] <= 4", "before its first -1 at column 1")
    op_raises(cache, gl(2, pt, torch.tensor([1, 1])), name, "argument 'layer'")


def test_paged_attention_op(setup):
    cache, pt = setup
    kc, vc, kw = cache.k_cache, cache.v_cache, cache_kwargs(cache)
    lengths = torch.tensor([12, 9])
    q = K(2, 1, 4, 8)
    name = "pagedkv::paged_attention"
    a = lambda *args: (lambda: ops.paged_attention(kc, vc, *args, **kw))  # noqa: E731
    op_raises(cache, a(2, pt, lengths, q), name, "argument 'layer' expected in [0, 2), got 2")
    op_raises(cache, a(0, pt, lengths, K(2, 1, 3, 8)), name, "argument 'q' expected n_heads at dim 2 to be a positive "
              "multiple of the cache's n_kv_heads 2")
    op_raises(cache, a(0, pt, lengths, K(2, 1, 4, 16)), name, "argument 'q' expected head_dim 8")
    op_raises(cache, a(0, pt, lengths, K(3, 1, 4, 8)), name, "argument 'q' expected batch 2")
    if cache.k_scales is None:  # (quantized pages: q's dtype is the one attention computes in)
        op_raises(cache, a(0, pt, lengths, K(2, 1, 4, 8, dtype=torch.float32)), name, "argument 'q' expected dtype Half")
    op_raises(cache, a(0, pt, lengths, K(2, 1, 4, 8, dtype=torch.float64)), name, "argument 'q' expected dtype")
    op_raises(cache, a(0, pt, lengths, K(2, 4, 8)), name, "argument 'q' expected 4-D")
    op_raises(cache, a(0, pt, torch.tensor([12, 0]), q), name, "argument 'lengths' expected lengths[1] >= 1")
    op_raises(cache, a(0, pt, torch.tensor([12, 1]), K(2, 2, 4, 8)), name, "expected lengths[1] >= 2")
    op_raises(cache, a(0, pt, torch.tensor([13, 1]), q), name, "expected lengths[0] <= 12")
    op_raises(cache, a(0, pt, lengths, q, float("inf")), name, "argument 'scale' expected a finite value")
    op_raises(cache, a(0, pt, lengths, q, float("nan")), name, "argument 'scale' expected a finite value")
    op_raises(cache, a(0, torch.tensor([[0, 1, 2], [3, -1, 5]]), lengths, q), name, "before its first -1 at column 1")
    op_raises(cache, a(0, torch.tensor([[0, 1, 2], [3, 4, 50]]), lengths, q), name,
              "expected a page id in [0, 8) at page_table[1][2], got 50")
    ints = torch.zeros(2, 8, 4, 2, 8, dtype=torch.int32)
    raises_runtime(lambda: ops.paged_attention(ints, ints, 0, pt, lengths, q), name,
                   "expected a cache of dtype float32, float16 or bfloat16, got Int")


def test_copy_pages_op(setup):
    cache, _ = setup
    kc, vc, kw = cache.k_cache, cache.v_cache, cache_kwargs(cache)
    name = "pagedkv::copy_pages"
    c = lambda src, dst: (lambda: ops.copy_pages(kc, vc, torch.tensor(src), torch.tensor(dst), **kw))  # noqa: E731
    op_raises(cache, c([0, 1], [2]), name, "arguments 'src' and 'dst' expected the same length, got 2 and 1")
    op_raises(cache, c([0, 1], [6, 6]), name, "argument 'dst' expected distinct pages, got page 6 more than once")
    op_raises(cache, c([0, 8], [6, 7]), name, "argument 'src' expected page ids in [0, 8), got src[1] = 8")
    op_raises(cache, c([0, 1], [6, -1]), name, "argument 'dst' expected page ids in [0, 8), got dst[1] = -1 (unmapped)")
    op_raises(cache, c([[0]], [[1]]), name, "argument 'src' expected 1-D")
    op_raises(cache, lambda: ops.copy_pages(kc, vc, torch.tensor([0.0]), torch.tensor([1]), **kw), name,
              "argument 'src' expected dtype int32 or int64")


def test_every_op_error_is_a_runtime_error(setup):
    """TORCH_CHECK_INDEX (layer, page ids) would surface as IndexError through the dispatcher; the ops raise
    RuntimeError for every bad call."""
    cache, pt = setup
    with pytest.raises(RuntimeError) as info:
        ops.gather(cache.k_cache, cache.v_cache, 7, pt, **cache_kwargs(cache), dtype=torch.float16
                   if cache.k_scales is not None else None)
    assert type(info.value) is RuntimeError
    with pytest.raises(RuntimeError) as info:  # the classes too
        cache.gather(7, pt)
    assert type(info.value) is RuntimeError


# ---- the classes ----


def test_constructor():
    args = (2, 8, 4, 2, 8, "cpu", torch.float16)
    raises_runtime(lambda: pagedkv.PagedCache(0, 8, 4, 2, 8), "pagedkv::PagedCache<NHD>::PagedCache",
                   "argument 'n_layers' expected >= 1, got 0")
    raises_runtime(lambda: pagedkv.PagedCache(2, 0, 4, 2, 8, layout="HND"), "pagedkv::PagedCache<HND>::PagedCache",
                   "argument 'n_pages' expected >= 1, got 0")
    raises_runtime(lambda: pagedkv.PagedCache(2, 8, -4, 2, 8), "argument 'page_size' expected >= 1, got -4")
    raises_runtime(lambda: pagedkv.PagedCache(*args, layout="NDH"), "argument 'layout' expected \"NHD\" or \"HND\"")
    raises_runtime(lambda: pagedkv.PagedCache(*args, kv_format="fp4"), "argument 'k_format'", "\"fp4\"")
    raises_runtime(lambda: pagedkv.PagedCache(*args, v_format="e5m2"), "argument 'v_format'", "\"e5m2\"")
    raises_runtime(lambda: pagedkv.PagedCache(*args, kv_format="fp8", k_format="int8"),
                   "arguments 'kv_format' and 'k_format' / 'v_format' expected one or the other")
    raises_runtime(lambda: pagedkv.PagedCache(2, 8, 4, 2, 8, "cpu", torch.int32, kv_format="int8"),
                   "expected dtype float32, float16 or bfloat16 for quantized pages")
    raises_runtime(lambda: pagedkv.PagedCache(2, 1 << 40, 1 << 20, 8, 128),
                   "expected n_layers x n_pages x page_size x n_kv_heads x head_dim x element size")


def test_pool(layout):
    cache = make_cache(layout, n_pages=4)
    pages = cache.alloc_n(2)
    before = snapshot(cache)
    raises_runtime(lambda: cache.alloc_n(-1), "pagedkv::PagePool::alloc_n", "argument 'n' expected >= 0, got -1")
    raises_runtime(lambda: cache.free(3), "pagedkv::PagePool::free", "double free")
    raises_runtime(lambda: cache.free(4), "pagedkv::PagePool::free", "argument 'page'", "got 4")
    raises_runtime(lambda: cache.retain(2), "pagedkv::PagePool::retain", "free")
    raises_runtime(lambda: cache.retain(-1), "pagedkv::PagePool::retain", "got -1")
    raises_runtime(lambda: cache.ref_count(9), "pagedkv::PagePool::ref_count", "got 9")
    assert_unchanged(cache, before)
    assert cache.alloc_n(3) == [] and cache.n_free() == 2  # too few: [] and no change
    cache.retain(pages[0])
    cache.free(pages[0])
    assert cache.ref_count(pages[0]) == 1


def test_write_gather_bind(setup):
    cache, pt = setup
    L = cache.layout
    k = K(2, 3, 2, 8)
    before = snapshot(cache)
    raises_runtime(lambda: cache.write(2, pt, 0, k, k), "pagedkv::PagedCache<%s>::write" % L,
                   "argument 'layer' expected in [0, 2), got 2")
    raises_runtime(lambda: cache.write(0, pt, -3, k, k), "argument 'start_pos' expected >= 0, got -3")
    raises_runtime(lambda: cache.write(0, pt, torch.tensor([0, 11]), k, k), "a write past the last column")
    raises_runtime(lambda: cache.write(0, pt, 0, k.float(), k.float()), "argument 'k' expected dtype Half")
    raises_runtime(lambda: cache.write(0, pt.view(-1), 0, k, k), "argument 'page_table' expected 2-D")
    raises_runtime(lambda: cache.write(0, torch.tensor([[0, 1, 6], [3, 4, 5]]), 8, k, k),
                   "expected an allocated page at page_table[0][2], got page 6 which is free (use after free)")
    raises_runtime(lambda: cache.gather(0, torch.tensor([[0, 7]])), "pagedkv::PagedCache<%s>::gather" % L,
                   "page 7 which is free (use after free)")
    raises_runtime(lambda: cache.gather(0, pt, torch.tensor([13, 0])), "argument 'lengths' expected lengths[0] <= 12")
    raises_runtime(lambda: cache.bind(pt, 13), "pagedkv::PagedCache<%s>::bind" % L, "argument 'total_len'")
    raises_runtime(lambda: cache.bind(pt, -1), "argument 'total_len' expected >= 0, got -1")
    raises_runtime(lambda: cache.bind(pt, lengths=torch.tensor([1])), "argument 'lengths' expected shape [2]")
    raises_runtime(lambda: cache.bind(pt, "5"), "argument 'total_len' expected an int", "str")
    raises_runtime(lambda: cache.bind(pt, 3, lengths=torch.tensor([1, 1])), "expected one or the other")
    raises_runtime(lambda: cache.bind(pt, lengths=[1, 1]), "argument 'lengths' expected a [B] tensor")
    view = cache.bind(pt, torch.tensor([12, 12]))
    raises_runtime(lambda: view.write(0, 12, k, k), "a write past the last column")
    raises_runtime(lambda: pagedkv.paged_attention(cache.bind(pt, 12), 0, K(2, 1, 4, 8)), "paged_attention<%s>" % L,
                   "argument 'view' expected a view bound with per-sequence lengths")
    raises_runtime(lambda: pagedkv.paged_attention(view, 0, K(2, 1, 3, 8)), "argument 'q' expected n_heads")
    assert_unchanged(cache, before)
    # a view whose pages were freed since bind
    cache.free(int(pt[1, 2]))
    before = snapshot(cache)
    raises_runtime(lambda: view.gather(1), "use after free")
    raises_runtime(lambda: view.write(1, 9, k, k), "use after free")
    raises_runtime(lambda: view.paged_attention(1, K(2, 1, 4, 8)), "use after free")
    assert_unchanged(cache, before)


def test_copy_pages_methods(layout):
    cache = make_cache(layout, n_pages=6)
    pages = cache.alloc_n(4)
    cache.retain(pages[3])
    before = snapshot(cache)
    raises_runtime(lambda: cache.copy_pages(torch.tensor([0]), torch.tensor([3])),
                   "pagedkv::PagedCache<%s>::copy_pages" % layout, "ref_count 1", "dst[0] = 3 with ref_count 2")
    raises_runtime(lambda: cache.copy_pages(torch.tensor([0]), torch.tensor([5])), "dst[0] = 5 which is free")
    raises_runtime(lambda: cache.copy_pages(torch.tensor([0, 1]), torch.tensor([2])), "the same length")
    other = make_cache(layout, n_pages=6, head_dim=4)
    raises_runtime(lambda: cache.copy_pages_from(other, torch.tensor([0]), torch.tensor([1])),
                   "copy_pages_from", "argument 'other' expected the same geometry")
    quantized = make_cache(layout, n_pages=6, kv_format="int8")
    raises_runtime(lambda: cache.copy_pages_from(quantized, torch.tensor([0]), torch.tensor([1])),
                   "argument 'other' expected formats")
    assert_unchanged(cache, before)


def test_sequence_table_and_prefix_cache(layout):
    cache = make_cache(layout, n_pages=8)
    seqs = pagedkv.SequenceTable(cache)
    s = seqs.create()
    assert seqs.reserve(s, 6)
    before = snapshot(cache)
    raises_runtime(lambda: seqs.reserve(7, 4), "pagedkv::SequenceTable<%s>::reserve" % layout, "argument 'seq'")
    raises_runtime(lambda: seqs.reserve(s, -1), "argument 'n_tokens' expected >= 0")
    raises_runtime(lambda: seqs.commit_append(s, 9), "pagedkv::SequenceTable<%s>::commit_append" % layout)
    raises_runtime(lambda: seqs.length(3), "argument 'seq'")
    raises_runtime(lambda: seqs.batch([s, 5]), "SequenceTable<%s>::batch" % layout, "argument 'seq'", "got 5")
    raises_runtime(lambda: seqs.swap_out(s, seqs), "swap_out")
    for method, args in (("fork", (9,)), ("release", (9,)), ("prepare_append", (9, 1)), ("pages", (9,)),
                         ("capacity", (9,)), ("swapped", (9,)), ("swap_in", (9, seqs))):
        raises_runtime(lambda: getattr(seqs, method)(*args), "pagedkv::SequenceTable<%s>::%s" % (layout, method),
                       "argument 'seq'", "got 9")
    raises_runtime(lambda: seqs.prepare_append(s, -2), "argument 'n_tokens' expected >= 0")
    raises_runtime(lambda: seqs.swap_in(s, seqs), "swap_in", "expected a swapped-out sequence")
    assert not seqs.contains(9)
    assert_unchanged(cache, before)
    seqs.commit_append(s, 6)
    prefix = pagedkv.PrefixCache(seqs)
    raises_runtime(lambda: pagedkv.PrefixCache(seqs), "argument 'seqs' expected a table without a prefix cache")
    raises_runtime(lambda: prefix.peek(torch.zeros(2, 3, dtype=torch.long)), "PrefixCache<%s>::peek" % layout,
                   "argument 'tokens' expected 1-D")
    raises_runtime(lambda: prefix.acquire(torch.zeros(3)), "argument 'tokens' expected dtype int32 or int64")
    raises_runtime(lambda: prefix.acquire(torch.arange(9), max_tokens=-2), "argument 'max_tokens'")
    raises_runtime(lambda: prefix.insert(s, torch.arange(2)), "PrefixCache<%s>::insert" % layout, "argument 'tokens'")
    raises_runtime(lambda: prefix.insert(6, torch.arange(9)), "argument 'seq'")
    raises_runtime(lambda: prefix.evict(-1), "argument 'n_pages' expected >= 0")
    assert_unchanged(cache, before)
    assert prefix.stats().lookups == 0
