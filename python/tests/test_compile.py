"""A decode step (write + paged attention for every layer) through the
operators under torch.compile(fullgraph=True) gives the eager result, bit for
bit, storage included (torch 2.x; skipped on 1.13)."""
import pytest
import torch

import pagedkv  # noqa: F401  (registers torch.ops.pagedkv and its fake implementations)
from conftest import assert_bit_equal, make_cache, needs_compile

ops = torch.ops.pagedkv
N_LAYERS, N_KV_HEADS, N_HEADS, HEAD_DIM, PAGE_SIZE = 3, 2, 4, 16, 4


def decode_step_fn(layout, quantized):
    """One decode step of an N_LAYERS model: each layer writes its new token's k, v, then attends."""

    def step(k_cache, v_cache, k_scales, v_scales, page_table, positions, lengths, q, k_new, v_new):
        outs = []
        for layer in range(N_LAYERS):
            ops.write.starts(k_cache, v_cache, layer, page_table, positions, k_new[layer], v_new[layer],
                             layout=layout, k_scales=k_scales if quantized else None,
                             v_scales=v_scales if quantized else None)
            outs.append(ops.paged_attention(k_cache, v_cache, layer, page_table, lengths, q[layer] * 0.5, 0.0,
                                            layout=layout, k_scales=k_scales if quantized else None,
                                            v_scales=v_scales if quantized else None))
        return outs

    return step


def prefilled(layout, kv_format, prompt_lengths, dtype, seed):
    cache = make_cache(layout, dtype, n_layers=N_LAYERS, n_pages=24, page_size=PAGE_SIZE, n_kv_heads=N_KV_HEADS,
                       head_dim=HEAD_DIM, kv_format=kv_format)
    gen = torch.Generator().manual_seed(seed)
    rows = [cache.alloc_n(4) for _ in prompt_lengths]
    pt = torch.tensor(rows, dtype=torch.int32)
    for b, n in enumerate(prompt_lengths):
        for layer in range(N_LAYERS):
            k = torch.randn(1, n, N_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
            cache.write(layer, pt[b:b + 1], 0, k, k * 0.5)
    return cache, pt


def step_inputs(cache, positions, dtype, gen):
    B = len(positions)
    return (torch.tensor(positions), torch.tensor(positions) + 1,
            torch.randn(N_LAYERS, B, 1, N_HEADS, HEAD_DIM, generator=gen).to(dtype),
            torch.randn(N_LAYERS, B, 1, N_KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
            torch.randn(N_LAYERS, B, 1, N_KV_HEADS, HEAD_DIM, generator=gen).to(dtype))


def storage(cache):
    return [cache.k_cache, cache.v_cache, cache.k_scales, cache.v_scales]


@needs_compile
@pytest.mark.parametrize("kv_format", ["native", "fp8"])
def test_decode_step_under_torch_compile(layout, kv_format):
    torch._dynamo.reset()
    dtype = torch.float32
    prompts = [5, 9, 2]
    eager_cache, pt = prefilled(layout, kv_format, prompts, dtype, seed=1)
    compiled_cache, pt2 = prefilled(layout, kv_format, prompts, dtype, seed=1)
    assert torch.equal(pt, pt2)
    step = decode_step_fn(layout, kv_format != "native")
    compiled = torch.compile(step, fullgraph=True)
    gen = torch.Generator().manual_seed(7)
    positions = list(prompts)
    for _ in range(3):  # three steps: same shapes, new values and lengths each time
        inputs = step_inputs(eager_cache, positions, dtype, gen)
        want = step(*storage(eager_cache), pt, *inputs)
        got = compiled(*storage(compiled_cache), pt, *inputs)
        for layer, (g, w) in enumerate(zip(got, want)):
            assert_bit_equal(g, w, "layer %d output" % layer)
        for g, w in zip(storage(compiled_cache), storage(eager_cache)):
            if w is not None:
                assert_bit_equal(g, w, "storage after the step")
        positions = [p + 1 for p in positions]
    # the compiled step wrote where the class reads: the cache's own gather agrees
    lengths = torch.tensor(positions)
    for layer in range(N_LAYERS):
        for g, w in zip(compiled_cache.gather(layer, pt, lengths), eager_cache.gather(layer, pt, lengths)):
            assert_bit_equal(g, w)


@needs_compile
def test_gather_under_torch_compile(layout):
    """A gather's length depends on the page table (a data-dependent size in the fake implementation)."""
    torch._dynamo.reset()
    cache, pt = prefilled(layout, "native", [5, 9], torch.float32, seed=3)

    def gathers(k_cache, v_cache, page_table, lengths):
        k, v = ops.gather(k_cache, v_cache, 1, page_table, layout=layout)
        kl, vl = ops.gather.lengths(k_cache, v_cache, 2, page_table, lengths, layout=layout)
        return k + 1, v, kl, vl

    compiled = torch.compile(gathers, fullgraph=True)
    lengths = torch.tensor([5, 9])
    for g, w in zip(compiled(cache.k_cache, cache.v_cache, pt, lengths),
                    gathers(cache.k_cache, cache.v_cache, pt, lengths)):
        assert_bit_equal(g, w)
