"""Shared helpers of pagedkv's Python tests (pytest python/tests).

The tests import the installed package (pip install --no-build-isolation
./python); run them from the repository root or anywhere but python/, whose
pagedkv/ folder holds the sources without the compiled extension.
"""
import os

import pytest
import torch

import pagedkv

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))

LAYOUTS = ("NHD", "HND")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# torch.library.opcheck and torch.compile: torch 2.x only (the tests that need
# them skip on 1.13, and only those).
HAS_OPCHECK = hasattr(torch.library, "opcheck")
HAS_COMPILE = hasattr(torch, "compile") and HAS_OPCHECK
needs_opcheck = pytest.mark.skipif(not HAS_OPCHECK, reason="torch.library.opcheck needs torch 2.x (torch %s)"
                                   % torch.__version__)
needs_compile = pytest.mark.skipif(not HAS_COMPILE, reason="torch.compile needs torch 2.x (torch %s)"
                                   % torch.__version__)


def bits(t):
    """t's elements as integers of the same width: equal bits <=> torch.equal(bits(a), bits(b))."""
    t = t.contiguous()
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width)


def assert_bit_equal(a, b, what=""):
    assert a.shape == b.shape, "%s: shapes %s and %s" % (what, tuple(a.shape), tuple(b.shape))
    assert a.dtype == b.dtype, "%s: dtypes %s and %s" % (what, a.dtype, b.dtype)
    assert torch.equal(bits(a), bits(b)), "%s: values differ" % what


def snapshot(cache):
    """Everything a failed call must leave as it was: storage, scales, pool."""
    return {
        "k": cache.k_cache.clone(),
        "v": cache.v_cache.clone(),
        "k_scales": None if cache.k_scales is None else cache.k_scales.clone(),
        "v_scales": None if cache.v_scales is None else cache.v_scales.clone(),
        "n_free": cache.n_free(),
        "refs": [cache.ref_count(p) for p in range(cache.n_pages)],
    }


def assert_unchanged(cache, before):
    after = snapshot(cache)
    for key in ("k", "v", "k_scales", "v_scales"):
        if before[key] is None:
            assert after[key] is None
        else:
            assert_bit_equal(after[key], before[key], key)
    assert after["n_free"] == before["n_free"]
    assert after["refs"] == before["refs"]


def tensors_snapshot(*tensors):
    return [None if t is None else t.clone() for t in tensors]


def assert_tensors_unchanged(tensors, before):
    for i, (t, b) in enumerate(zip(tensors, before)):
        if b is not None:
            assert_bit_equal(t, b, "tensor %d" % i)


def raises_runtime(fn, *phrases):
    """fn() raises RuntimeError whose message holds every phrase; returns the message."""
    with pytest.raises(RuntimeError) as info:
        fn()
    message = str(info.value)
    for phrase in phrases:
        assert phrase in message, "%r not in %r" % (phrase, message)
    return message


@pytest.fixture(params=LAYOUTS)
def layout(request):
    return request.param


class generic_backend:
    """pagedkv._C._GenericBackend when `on`: the ATen path CUDA tensors take, forced on the CPU."""

    def __init__(self, on):
        self.scope = pagedkv._C._GenericBackend() if on else None

    def __enter__(self):
        if self.scope is not None:
            self.scope.__enter__()

    def __exit__(self, *exc):
        if self.scope is not None:
            self.scope.__exit__(*exc)


def make_cache(layout="NHD", dtype=torch.float32, n_layers=2, n_pages=16, page_size=4, n_kv_heads=2, head_dim=8,
               **formats):
    return pagedkv.PagedCache(n_layers, n_pages, page_size, n_kv_heads, head_dim, "cpu", dtype, layout, **formats)


def table(rows, dtype=torch.int64):
    """A page table [B, max_pages] from lists (rows padded with -1)."""
    width = max(len(r) for r in rows) if rows else 0
    return torch.tensor([list(r) + [-1] * (width - len(r)) for r in rows], dtype=dtype).view(len(rows), width)
