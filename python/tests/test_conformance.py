"""Bit-for-bit conformance of pagedkv.PagedCache with the original Python class.

The Python counterpart of tests/reference/conformance.py: random operation
scripts that stay inside what the original defines (no -1 page where a write
lands or a gather reads, no double free, distinct pages per write) run on
../shared/reference/paged_cache.py and on pagedkv.PagedCache in both layouts,
in the same process, through the same calls (migration = changing the
import). Every result is compared: page ids of alloc / alloc_n, the number
of free pages, and gathered k / v bit for bit (shapes, dtypes, bits).

Where the original corrupts memory (a -1 page, a double free, an id out of
range), pagedkv raises RuntimeError and changes nothing; the tests also show
what the original does there.

PAGEDKV_REFERENCE_DIR names the folder holding paged_cache.py (default
../shared/reference beside the repository); without it these tests skip.
"""
import importlib.util
import os
import random

import pytest
import torch

import pagedkv
from conftest import LAYOUTS, REPO, assert_bit_equal, assert_unchanged, raises_runtime, snapshot

REFERENCE_DIR = os.environ.get("PAGEDKV_REFERENCE_DIR", os.path.join(REPO, "..", "shared", "reference"))
REFERENCE_FILE = os.path.join(REFERENCE_DIR, "paged_cache.py")
HEADS, DIM = 2, 4


def load_reference():
    if not os.path.isfile(REFERENCE_FILE):
        pytest.skip("no reference paged_cache.py in %s (set PAGEDKV_REFERENCE_DIR)" % REFERENCE_DIR)
    spec = importlib.util.spec_from_file_location("reference_paged_cache", REFERENCE_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference():
    return load_reference()


def reference_n_free(cache):
    return bin(cache._free_mask).count("1")


def new_reference(reference, n_layers, n_pages, page_size, dtype):
    cache = reference.PagedCache(n_layers, n_pages, page_size, HEADS, DIM, torch.device("cpu"), dtype)
    cache.k_cache.zero_()  # the original leaves storage uninitialised; pagedkv zeroes it
    cache.v_cache.zero_()
    return cache


def kv_values(gen, batch, seq, dtype, strided):
    """k, v [batch, seq, HEADS, DIM]; strided: slices of one fused [.., 3 * HEADS, DIM] tensor (as a QKV projection)."""
    if strided:
        fused = torch.randn(batch, seq, 3 * HEADS, DIM, generator=gen).to(dtype)
        return fused[:, :, HEADS:2 * HEADS], fused[:, :, 2 * HEADS:]
    return (torch.randn(batch, seq, HEADS, DIM, generator=gen).to(dtype),
            torch.randn(batch, seq, HEADS, DIM, generator=gen).to(dtype))


def make_script(rng, steps, n_layers, n_pages, page_size):
    """Random operations the original defines; its allocation state is tracked here."""
    allocated = set()
    ops = []
    for _ in range(steps):
        op = rng.random()
        if op < 0.2:
            ops.append(("alloc",))
            if len(allocated) < n_pages:
                allocated.add(min(set(range(n_pages)) - allocated))
        elif op < 0.3:
            n = rng.randint(0, 4)
            ops.append(("alloc_n", n))
            if n <= n_pages - len(allocated):
                for _ in range(n):
                    allocated.add(min(set(range(n_pages)) - allocated))
        elif op < 0.4 and allocated:
            page = rng.choice(sorted(allocated))
            allocated.remove(page)
            ops.append(("free", page))
        elif op < 0.7 and allocated:
            batch = rng.randint(1, 3)
            cols = rng.randint(1, max(1, len(allocated) // batch))
            if batch * cols > len(allocated):
                continue
            pages = rng.sample(sorted(allocated), batch * cols)
            seq = rng.randint(0, cols * page_size)
            start = rng.randint(0, cols * page_size - seq)
            ops.append(("write", rng.randint(0, n_layers - 1), start, batch, seq, cols, pages,
                        rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.3))
        elif allocated:
            batch = rng.randint(1, 3)
            mapped = rng.randint(1, 4)
            trailing = rng.randint(0, 2)  # all -1 columns: the original stops there
            live = sorted(allocated)
            rows = [[rng.choice(live) for _ in range(mapped)] + [-1] * trailing for _ in range(batch)]
            total_len = rng.choice([0, rng.randint(1, mapped * page_size)])
            ops.append(("gather", rng.randint(0, n_layers - 1), total_len, rows, rng.random() < 0.5,
                        rng.random() < 0.3))
    return ops


def run(cache, ops, dtype, seed):
    """Runs a script through the original's API; returns one result per operation."""
    gen = torch.Generator().manual_seed(seed)
    original = hasattr(cache, "_free_mask")
    n_free = reference_n_free if original else (lambda c: c.n_free())
    # int32 page tables for pagedkv only: torch 1.13 cannot index with int32 (the original's gather).
    index_dtype = lambda int32: torch.int32 if int32 and not original else torch.int64  # noqa: E731
    out = []
    for op in ops:
        if op[0] == "alloc":
            out.append(cache.alloc())
        elif op[0] == "alloc_n":
            out.append(cache.alloc_n(op[1]))
        elif op[0] == "free":
            cache.free(op[1])
            out.append(n_free(cache))
        elif op[0] == "write":
            _, layer, start, batch, seq, cols, pages, via_view, strided, int32 = op
            pt = torch.tensor(pages, dtype=index_dtype(int32)).view(batch, cols)
            k, v = kv_values(gen, batch, seq, dtype, strided)
            if via_view:
                cache.bind(pt).write(layer, start, k, v)
            else:
                cache.write(layer, pt, start, k, v)
            out.append(None)
        else:
            _, layer, total_len, rows, via_view, int32 = op
            pt = torch.tensor(rows, dtype=index_dtype(int32))
            if via_view or total_len:
                out.append(cache.bind(pt, total_len).gather(layer))
            else:
                out.append(cache.gather(layer, pt))
    return out


def compare(got, want, ops, label):
    assert len(got) == len(want)
    for i, (g, w, op) in enumerate(zip(got, want, ops)):
        where = "%s, op %d %s" % (label, i, op[:3])
        if isinstance(w, tuple):
            assert_bit_equal(g[0], w[0], where + " k")
            assert_bit_equal(g[1], w[1], where + " v")
            assert g[0].is_contiguous() and g[1].is_contiguous()
        else:
            assert g == w, "%s: pagedkv %r, original %r" % (where, g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_random_scripts_match_the_original(reference, dtype, page_size):
    rng = random.Random(2026 + page_size)
    compared = 0
    for script in range(4):
        n_layers, n_pages = 2, rng.randint(1, 20)
        ops = make_script(rng, 120, n_layers, n_pages, page_size)
        want = run(new_reference(reference, n_layers, n_pages, page_size, dtype), ops, dtype, seed=script)
        for layout in LAYOUTS:
            cache = pagedkv.PagedCache(n_layers, n_pages, page_size, HEADS, DIM, torch.device("cpu"), dtype,
                                       layout=layout)
            got = run(cache, ops, dtype, seed=script)
            compare(got, want, ops, "%s %s P=%d script %d" % (layout, dtype, page_size, script))
            cache.check()
            compared += len(ops)
    assert compared > 0


def test_the_migration_is_the_import(reference):
    """The original's own usage, unchanged but for the class: same ids, same bits."""
    def session(PagedCache):
        cache = PagedCache(2, 8, 4, HEADS, DIM, torch.device("cpu"), torch.float16)
        cache.k_cache.zero_()
        cache.v_cache.zero_()
        pages = cache.alloc_n(3)
        page_table = torch.tensor([pages[:2], [pages[2], -1]])
        view = cache.bind(page_table, total_len=6)
        gen = torch.Generator().manual_seed(1)
        k = torch.randn(2, 6, HEADS, DIM, generator=gen).half()
        v = torch.randn(2, 6, HEADS, DIM, generator=gen).half()
        view.write(1, 0, k[:, :4], v[:, :4])  # row 1's second column is -1: 4 tokens fit its first page
        cache.write(1, page_table[:1], 4, k[:1, 4:], v[:1, 4:])
        gathered = view.gather(1)
        full = cache.gather(1, page_table)
        cache.free(pages[0])
        return pages, cache.alloc(), gathered, full, cache.k_cache.shape

    want = session(reference.PagedCache)
    got = session(pagedkv.PagedCache)
    assert got[0] == want[0] and got[1] == want[1] and got[4] == want[4]
    for g, w in zip(got[2] + got[3], want[2] + want[3]):
        assert_bit_equal(g, w)


# ---- where the original corrupts memory, pagedkv raises and changes nothing ----


def written_cache(layout, dtype=torch.float32):
    cache = pagedkv.PagedCache(1, 4, 2, HEADS, DIM, "cpu", dtype, layout=layout)
    pages = cache.alloc_n(2)
    gen = torch.Generator().manual_seed(3)
    pt = torch.tensor([pages])
    cache.write(0, pt, 0, torch.randn(1, 4, HEADS, DIM, generator=gen), torch.randn(1, 4, HEADS, DIM, generator=gen))
    return cache, pages


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_to_unmapped_page(reference, layout):
    # The original indexes k_cache[layer, -1]: the write lands in the last page, which it does not own.
    ref = new_reference(reference, 1, 4, 2, torch.float32)
    ref.alloc_n(2)
    last_before = ref.k_cache[0, 3].clone()
    k = torch.ones(1, 2, HEADS, DIM)
    ref.write(0, torch.tensor([[0, -1]]), 2, k, k)
    assert not torch.equal(ref.k_cache[0, 3], last_before)  # page 3 was never allocated

    cache, pages = written_cache(layout)
    before = snapshot(cache)
    raises_runtime(lambda: cache.write(0, torch.tensor([[pages[0], -1]]), 2, k, k), "pagedkv::PagedCache<%s>::write"
                   % layout, "argument 'page_table'", "got -1 (unmapped)")
    raises_runtime(lambda: cache.bind(torch.tensor([[pages[0], -1]])).write(0, 2, k, k), "page_table[0][1]")
    assert_unchanged(cache, before)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_double_free(reference, layout):
    # The original's ref count goes to -1 and the page stays free: a later alloc hands it out while
    # the count is wrong, and its next free leaves it allocated forever.
    ref = new_reference(reference, 1, 4, 2, torch.float32)
    page = ref.alloc()
    ref.free(page)
    ref.free(page)
    assert ref._refs[page] == -1

    cache, pages = written_cache(layout)
    cache.free(pages[0])
    before = snapshot(cache)
    raises_runtime(lambda: cache.free(pages[0]), "pagedkv::PagePool::free", "argument 'page'", "double free")
    assert_unchanged(cache, before)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_free_out_of_range(reference, layout):
    # The original's free(-1) decrements the last page's count, then fails on the shift: half done.
    ref = new_reference(reference, 1, 4, 2, torch.float32)
    ref.alloc_n(4)
    with pytest.raises(ValueError):
        ref.free(-1)
    assert ref._refs[3] == 0 and reference_n_free(ref) == 0  # page 3 is lost: allocated, with no reference

    cache, _ = written_cache(layout)
    before = snapshot(cache)
    raises_runtime(lambda: cache.free(-1), "argument 'page'", "-1")
    raises_runtime(lambda: cache.free(4), "argument 'page'", "4")
    assert_unchanged(cache, before)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_into_freed_page(reference, layout):
    # The original writes into a page it has freed (and may have handed to another sequence).
    cache, pages = written_cache(layout)
    cache.free(pages[1])
    before = snapshot(cache)
    k = torch.ones(1, 1, HEADS, DIM)
    raises_runtime(lambda: cache.write(0, torch.tensor([pages]), 2, k, k), "use after free")
    assert_unchanged(cache, before)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unmapped_page_beside_a_mapped_one_reads_zeros(reference, layout):
    # A column mapped in one row and -1 in another: the original reads its last page for the -1
    # (whatever it holds); pagedkv reads zeros there, and the same values everywhere else.
    ref = new_reference(reference, 1, 4, 2, torch.float32)
    cache = pagedkv.PagedCache(1, 4, 2, HEADS, DIM, "cpu", torch.float32, layout=layout)
    k = torch.arange(4 * HEADS * DIM, dtype=torch.float32).view(1, 4, HEADS, DIM) + 1
    for c in (ref, cache):
        assert c.alloc_n(4) == [0, 1, 2, 3]
        c.write(0, torch.tensor([[0, 3]]), 0, k, k)
    pt = torch.tensor([[0, 1], [2, -1]])
    ref_k, _ = ref.gather(0, pt)
    got_k, _ = cache.gather(0, pt)
    assert_bit_equal(got_k[0], ref_k[0])
    assert_bit_equal(got_k[1, :2], ref_k[1, :2])
    assert torch.equal(ref_k[1, 2:], k[0, 2:])  # the original: page 3's tokens
    assert torch.count_nonzero(got_k[1, 2:]) == 0


def test_total_len_past_the_mapped_tokens(reference):
    # The original slices silently (asked for 8 tokens, returns 4); pagedkv refuses the bind.
    ref = new_reference(reference, 1, 4, 2, torch.float32)
    pages = ref.alloc_n(2)
    k, _ = ref.bind(torch.tensor([pages]), total_len=8).gather(0)
    assert k.shape[1] == 4
    cache = pagedkv.PagedCache(1, 4, 2, HEADS, DIM, "cpu", torch.float32)
    pages = cache.alloc_n(2)
    raises_runtime(lambda: cache.bind(torch.tensor([pages]), total_len=8), "argument 'total_len'", "<= 4", "got 8")
