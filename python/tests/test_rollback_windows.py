"""SequenceTable.truncate (speculative decoding's rollback) and windowed
tables (SequenceTable(cache, window)) from Python: what they keep, what they
free, and the bad calls that change nothing."""
import pytest
import torch

import pagedkv
from conftest import assert_bit_equal, make_cache, raises_runtime


def append(cache, seqs, seq, k):
    """prepare_append + a write of k [n, 2, 8] (v = -k) at the end of seq + commit_append."""
    n = k.shape[0]
    assert seqs.prepare_append(seq, n)
    pt, lengths = seqs.batch([seq])
    for layer in range(cache.n_layers):
        cache.write(layer, pt, lengths, k.unsqueeze(0), -k.unsqueeze(0))
    seqs.commit_append(seq, n)


def gathered_k(cache, seqs, seq, layer=0):
    pt, lengths = seqs.batch([seq])
    return cache.gather(layer, pt, lengths)[0][0]


def test_truncate_keeps_the_prefix_and_leaves_shared_pages(layout):
    cache = make_cache(layout, torch.float32, n_pages=12, page_size=4)
    seqs = pagedkv.SequenceTable(cache)
    k = torch.randn(10, 2, 8)
    a = seqs.create()
    append(cache, seqs, a, k)
    b = seqs.fork(a)
    pages = seqs.pages(a)
    seqs.truncate(a, 5)  # pages 0 and 1 (1 partly kept); pages 2 stays b's alone
    assert seqs.length(a) == 5 and seqs.pages(a) == pages[:2] and seqs.capacity(a) == 8
    assert [cache.ref_count(p) for p in pages] == [2, 2, 1]
    assert_bit_equal(gathered_k(cache, seqs, a), k[:5])
    extra = torch.randn(2, 2, 8)
    append(cache, seqs, a, extra)  # copies the shared, partly kept page first
    assert seqs.pages(a)[0] == pages[0] and seqs.pages(a)[1] != pages[1]
    assert_bit_equal(gathered_k(cache, seqs, a), torch.cat([k[:5], extra]))
    assert_bit_equal(gathered_k(cache, seqs, b), k)
    seqs.truncate(b, 0)
    assert seqs.pages(b) == [] and seqs.length(b) == 0
    seqs.check()
    seqs.release(a)
    seqs.release(b)
    assert cache.n_free() == 12


def test_truncate_bad_input_changes_nothing(layout):
    cache = make_cache(layout, torch.float32, n_pages=8, page_size=4)
    host_cache = make_cache(layout, torch.float32, n_pages=8, page_size=4)
    seqs, host = pagedkv.SequenceTable(cache), pagedkv.SequenceTable(host_cache)
    a, s = seqs.create(), seqs.create()
    append(cache, seqs, a, torch.randn(6, 2, 8))
    append(cache, seqs, s, torch.randn(3, 2, 8))
    assert seqs.swap_out(s, host)
    pages, n_free = seqs.pages(a), cache.n_free()
    fn = "pagedkv::SequenceTable<%s>::truncate" % layout
    raises_runtime(lambda: seqs.truncate(a, 7), fn, "argument 'n_tokens' expected in [0, 6]", "got 7")
    raises_runtime(lambda: seqs.truncate(a, -1), fn, "'n_tokens'", "got -1")
    with pytest.raises((IndexError, RuntimeError), match="truncate: argument 'seq' expected a live sequence id"):
        seqs.truncate(9, 0)
    raises_runtime(lambda: seqs.truncate(s, 1), fn, "'seq'", "swapped out")
    raises_runtime(lambda: host.truncate(0, 1), "holds another table's swapped-out sequence")
    assert seqs.pages(a) == pages and seqs.length(a) == 6 and cache.n_free() == n_free
    assert seqs.swapped(s) and seqs.length(s) == 3 and host.length(0) == 3
    seqs.check()
    host.check()


def test_windowed_table_keeps_only_the_window(layout):
    cache = make_cache(layout, torch.float32, n_pages=8, page_size=4)
    seqs = pagedkv.SequenceTable(cache, window=5)
    assert seqs.window() == 5 and pagedkv.SequenceTable(cache).window() == 0
    k = torch.randn(30, 2, 8)
    a = seqs.create()
    for t in range(30):
        append(cache, seqs, a, k[t:t + 1])
        dropped = max(0, t + 1 - 5 + 1) // 4  # the next query, at t + 1, sees [t - 3, t + 1]
        assert seqs.pages(a)[:dropped] == [-1] * dropped and -1 not in seqs.pages(a)[dropped:]
        assert 8 - cache.n_free() <= 3  # ceil(4 / 4) + 1 pages with tokens, at most
    assert seqs.length(a) == 30
    seqs.check()
    assert seqs.prepare_append(a, 1)
    pt, lengths = seqs.batch([a])
    assert pt[0, :6].tolist() == [-1] * 6
    view = cache.bind(pt, lengths + 1)  # leading -1 columns are accepted
    q = torch.randn(1, 1, 2, 8)
    raises_runtime(lambda: pagedkv.paged_attention(view, 0, q), "paged_attention", "first -1 at column 0")
    raises_runtime(lambda: view.gather(0), "gather", "first -1 at column 0")
    held = torch.tensor([seqs.pages(a)[6:]])
    assert_bit_equal(cache.gather(0, held, torch.tensor([30 - 24]))[0][0], k[24:])
    # a window cannot grow back
    raises_runtime(lambda: seqs.truncate(a, 27), "SequenceTable<%s>::truncate" % layout, "expected >= 28",
                   "window is 5 tokens", "got 27")
    seqs.truncate(a, 28)
    assert seqs.length(a) == 28 and seqs.pages(a)[:6] == [-1] * 6
    raises_runtime(lambda: pagedkv.PrefixCache(seqs), "PrefixCache", "argument 'seqs'", "without a window",
                   "window 5")
    raises_runtime(lambda: pagedkv.SequenceTable(cache, window=-2), "argument 'window' expected >= 0", "got -2")
    seqs.release(a)
    assert cache.n_free() == 8
