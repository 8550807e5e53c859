"""Fake (meta) implementations of the torch.ops.pagedkv operators.

torch.compile, torch.export and FakeTensor tracing run these instead of the
kernels: they give each output's shape, dtype and device without reading any
data. A gather's length depends on the page table's contents (the mapped
columns, or max(lengths)), so it is a data-dependent size there. Registered on
torch 2.x only (torch.library.register_fake, or impl_abstract before 2.4);
torch 1.x has no fake tensors.
"""
import torch

_register_fake = getattr(torch.library, "register_fake", None) or getattr(torch.library, "impl_abstract", None)


def _register(qualname):
    if _register_fake is None:
        return lambda fn: fn
    return _register_fake(qualname)


def _page_dims(k_cache, layout):
    """(page_size, n_kv_heads, head_dim) of [n_layers, n_pages, <page>] storage."""
    if layout == "HND":
        return k_cache.shape[3], k_cache.shape[2], k_cache.shape[4]
    return k_cache.shape[2], k_cache.shape[3], k_cache.shape[4]


def _gather_dtype(k_cache, v_cache, k_scales, v_scales, dtype):
    """A gather's output dtype: a native side's (no scales), else `dtype`."""
    native = k_cache.dtype if k_scales is None else v_cache.dtype if v_scales is None else None
    if native is not None:
        if dtype is not None and dtype != native:
            raise RuntimeError("pagedkv::gather: argument 'dtype' expected dtype %s (the cache's native side), got %s"
                               % (native, dtype))
        return native
    if dtype is None:
        raise RuntimeError("pagedkv::gather: argument 'dtype' expected a dtype (float32, float16 or bfloat16) "
                           "to dequantize into, got None")
    return dtype


def _dynamic_size(upper):
    """A data-dependent size in [0, upper]."""
    ctx = torch.library.get_ctx()
    return ctx.new_dynamic_size(min=0, max=upper if isinstance(upper, int) else None)


@_register("pagedkv::write")
def _write(k_cache, v_cache, layer, page_table, start_pos, k, v, layout="NHD", k_scales=None, v_scales=None):
    return None


@_register("pagedkv::write.starts")
def _write_starts(k_cache, v_cache, layer, page_table, start_pos, k, v, layout="NHD", k_scales=None, v_scales=None):
    return None


@_register("pagedkv::gather")
def _gather(k_cache, v_cache, layer, page_table, total_len=0, layout="NHD", k_scales=None, v_scales=None, dtype=None):
    page_size, n_heads, head_dim = _page_dims(k_cache, layout)
    out_dtype = _gather_dtype(k_cache, v_cache, k_scales, v_scales, dtype)
    if total_len > 0:  # the first total_len tokens
        n_tokens = total_len
    else:  # page_size x the leading columns that map a page in some row
        n_tokens = _dynamic_size(page_table.shape[1]) * page_size
    shape = (page_table.shape[0], n_tokens, n_heads, head_dim)
    return k_cache.new_empty(shape, dtype=out_dtype), v_cache.new_empty(shape, dtype=out_dtype)


@_register("pagedkv::gather.lengths")
def _gather_lengths(k_cache, v_cache, layer, page_table, lengths, layout="NHD", k_scales=None, v_scales=None,
                    dtype=None):
    page_size, n_heads, head_dim = _page_dims(k_cache, layout)
    out_dtype = _gather_dtype(k_cache, v_cache, k_scales, v_scales, dtype)
    n_tokens = _dynamic_size(page_table.shape[1] * page_size)  # max(lengths)
    shape = (page_table.shape[0], n_tokens, n_heads, head_dim)
    return k_cache.new_empty(shape, dtype=out_dtype), v_cache.new_empty(shape, dtype=out_dtype)


@_register("pagedkv::paged_attention")
def _paged_attention(k_cache, v_cache, layer, page_table, lengths, q, scale=0.0, layout="NHD", k_scales=None,
                     v_scales=None, window=0, softcap=0.0, sinks=None, tree_mask=None):
    return q.new_empty(q.shape)


@_register("pagedkv::copy_pages")
def _copy_pages(k_cache, v_cache, src, dst, layout="NHD", k_scales=None, v_scales=None):
    return None
