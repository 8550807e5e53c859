"""pagedkv: a paged KV cache for LLM inference over torch tensors.

The Python face of the pagedkv C++ library. ``pagedkv.PagedCache`` replaces
the original Python ``PagedCache`` (same constructor, methods and attributes,
same page ids, same values bit for bit), and adds what the C++ classes have:
reference counts (``retain``, ``ref_count``), ``n_free``, per-sequence
lengths, the HND layout, fp8 / int8 pages and ``paged_attention``. Every call
validates its arguments first and raises ``RuntimeError`` (naming the call,
the argument, what was expected and what was given) where the original would
have silently corrupted memory; a call that raises changes nothing.

Also: ``SequenceTable`` and ``PrefixCache`` (the C++ methods, same names), and
the stateless operators ``torch.ops.pagedkv.*`` (write, gather,
paged_attention, copy_pages) on cache tensors plus page tables, with fake
implementations for torch.compile on torch 2.x. See docs/python.md.
"""
import torch

from . import _C
from . import _fake  # noqa: F401  (registers the operators' fake implementations on torch 2.x)
from ._C import CacheView, PrefixStats

__all__ = ["PagedCache", "CacheView", "SequenceTable", "PrefixCache", "PrefixStats", "paged_attention"]
__version__ = "0.3.0"


def _formats(kv_format, k_format, v_format):
    """The (k, v) format names from the constructor's arguments."""
    if kv_format is not None and (k_format is not None or v_format is not None):
        raise RuntimeError(
            "pagedkv.PagedCache: arguments 'kv_format' and 'k_format' / 'v_format' expected one or the other, "
            "got kv_format=%r, k_format=%r, v_format=%r" % (kv_format, k_format, v_format)
        )
    if kv_format is not None:
        k_format = v_format = kv_format
    return ("native" if k_format is None else k_format), ("native" if v_format is None else v_format)


class PagedCache(_C.PagedCache):
    """Paged KV cache: a page pool with reference counts plus K/V storage
    ``[n_layers, n_pages, <page>]``, written and read through page tables.

    ``layout`` "NHD" stores a page as ``[page_size, n_kv_heads, head_dim]``
    (the original's), "HND" as ``[n_kv_heads, page_size, head_dim]``.
    ``kv_format`` ("native", "fp8" or "int8") stores K and V as one byte per
    element with a float32 scale per (token, head); ``k_format`` /
    ``v_format`` choose per side. ``dtype`` stays what ``write`` takes and
    ``gather`` returns.
    """

    def __init__(self, n_layers, n_pages, page_size, n_kv_heads, head_dim, device="cpu", dtype=torch.float16,
                 layout="NHD", kv_format=None, *, k_format=None, v_format=None):
        k_format, v_format = _formats(kv_format, k_format, v_format)
        like = torch.empty(0, device=device, dtype=dtype)  # carries the device and dtype to C++
        super().__init__(n_layers, n_pages, page_size, n_kv_heads, head_dim, like, layout, k_format, v_format)

    def __repr__(self):
        formats = "" if self.k_format == self.v_format == "native" else ", k_format=%r, v_format=%r" % (
            self.k_format, self.v_format)
        return "pagedkv.PagedCache(n_layers=%d, n_pages=%d, page_size=%d, n_kv_heads=%d, head_dim=%d, " \
               "device=%r, dtype=%s, layout=%r%s; %d pages free)" % (
                   self.n_layers, self.n_pages, self.page_size, self.n_kv_heads, self.head_dim, str(self.device),
                   self.dtype, self.layout, formats, self.n_free())


class SequenceTable(_C.SequenceTable):
    """Per-sequence block tables over a PagedCache: create, reserve, fork
    (shared pages), prepare_append (copy-on-write) / commit_append, truncate
    (rollback), batch (page table + lengths for ``bind``), swap_out / swap_in
    to another table's cache. The cache must be the one the pages come from.
    ``window`` >= 1 keeps pages for each sequence's last ``window`` tokens
    only (sliding-window layers); released columns read -1 in ``batch``."""

    def __init__(self, cache, window=0):
        super().__init__(cache, window)
        self._cache = cache

    @property
    def cache(self):
        """The PagedCache this table allocates from."""
        return self._cache


class PrefixCache(_C.PrefixCache):
    """Automatic prefix caching over a SequenceTable: acquire reuses the
    pages of every full page of a prompt that an earlier request inserted."""

    def __init__(self, seqs):
        super().__init__(seqs)
        self._seqs = seqs

    @property
    def seqs(self):
        """The SequenceTable this prefix cache is attached to."""
        return self._seqs


paged_attention = _C.paged_attention
