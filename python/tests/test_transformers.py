"""pagedkv.transformers against transformers' own cache and attention: tiny
random models (from_config, no download) of every supported family, float32,
generate with PagedKVCache + "pagedkv" and with DynamicCache + sdpa (eager
where transformers' sdpa has no soft-cap or sinks) must give the same tokens
and, step by step, logits within 1e-4. Skipped where transformers 5 is not
importable (Debian's torch 1.13 in `make test`)."""
import copy
import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("pagedkv.transformers needs transformers 5.x (found %s)" % transformers.__version__,
                allow_module_level=True)

import pagedkv  # noqa: E402
import pagedkv.transformers as pkt  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402

pkt.enable()

WINDOW = 7  # shorter than every prompt below: the sliding layers drop pages
PROMPT = 20
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, initializer_range=0.2)
FAMILY_CONFIG = {
    "llama": {},
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": {},
    "gemma": {},
    "gemma2": dict(sliding_window=WINDOW),
    "gemma3_text": dict(sliding_window=WINDOW, sliding_window_pattern=2),
    "phi3": dict(sliding_window=WINDOW),
    "gpt_oss": dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
}
# transformers' sdpa takes neither Gemma 2's soft-cap nor gpt-oss's sinks.
REFERENCE_ATTENTION = {"gemma2": "eager", "gpt_oss": "eager"}
TOL = 1e-4
MARGIN = 1e-3  # a reference step whose top-2 logits are closer is a near tie: the comparison would mean nothing

_models = {}


def models(family):
    """(config, reference model, pagedkv model): the same random weights."""
    if family not in _models:
        config = AutoConfig.for_model(family, **BASE, **FAMILY_CONFIG[family])
        torch.manual_seed(0)
        # from_config keeps the config object and sets its attn_implementation: one copy per model
        reference = AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=REFERENCE_ATTENTION.get(family, "sdpa")).eval()
        paged = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="pagedkv").eval()
        paged.load_state_dict(reference.state_dict())
        _models[family] = (config, reference, paged)
    return _models[family]


def prompt(batch=1, length=PROMPT, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=generator)


def generate(model, ids, cache, seed=None, **kwargs):
    args = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    args.update(kwargs)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(ids, cache=cache, **args)


def assert_same_generation(reference, paged, greedy=True, tol=TOL):
    if greedy:  # near ties would make a rounding difference a different token
        for step, logits in enumerate(reference.logits):
            top2 = logits.float().topk(2, dim=-1).values
            margin = (top2[:, 0] - top2[:, 1]).min().item()
            assert margin > MARGIN, "step %d: the reference's top-2 logits are %.2g apart (a near tie: change " \
                "the seed)" % (step, margin)
    assert paged.sequences.tolist() == reference.sequences.tolist()
    assert len(paged.logits) == len(reference.logits)
    for step, (a, b) in enumerate(zip(reference.logits, paged.logits)):
        diff = (a - b).abs().max().item()
        assert diff <= tol, "step %d: logits differ by %.3g" % (step, diff)


def compare(family, ids=None, cache_args=None, attention_mask=None, seed=None, greedy=True, **kwargs):
    """Generates with both; returns the PagedKVCache and the stats of its run."""
    config, reference, paged = models(family)
    ids = prompt() if ids is None else ids
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    expected = generate(reference, ids, DynamicCache(config=config), seed=seed, **kwargs)
    cache = pkt.PagedKVCache(paged.config, **dict(dict(n_pages=64, page_size=3), **(cache_args or {})))
    pkt.reset_stats()
    got = generate(paged, ids, cache, seed=seed, **kwargs)
    assert_same_generation(expected, got, greedy)
    return cache, pkt.stats()


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIG))
def test_greedy_matches_transformers(family):
    cache, counts = compare(family, prompt(batch=2))
    assert counts == {"kernel_calls": 2 * 5, "fallback_calls": 0}
    # the window's pages only: at most ceil((WINDOW - 1 + 1) / 3) + 1 per row and sliding pool
    sliding = [pool for pool in cache.pools if pool.window]
    for pool in sliding:
        assert pool.cache.n_pages - pool.cache.n_free() <= 2 * (-(-WINDOW // 3) + 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3_text", "gpt_oss"])
def test_cuda_tensors(family):
    """The model on a GPU: the pages on its device, the native CUDA kernels (never run yet where this is written:
    no GPU; every CPU test above runs the same Python)."""
    config, reference, paged = models(family)
    reference, paged = copy.deepcopy(reference).cuda(), copy.deepcopy(paged).cuda()
    ids = prompt(batch=2).cuda()
    expected = generate(reference, ids, DynamicCache(config=config))
    cache = pkt.PagedKVCache(paged.config, n_pages=64, page_size=3)
    pkt.reset_stats()
    got = generate(paged, ids, cache)
    assert all(pool.cache.k_cache.is_cuda for pool in cache.pools if pool.cache is not None)
    assert pkt.stats()["fallback_calls"] == 0
    assert_same_generation(expected, got, tol=1e-3)  # cuBLAS and the GPU's sdpa sum in other orders


def paged_config(family):
    return models(family)[2].config


@pytest.mark.parametrize("family,page_size,layout", [("llama", 1, "HND"), ("llama", 16, "NHD"),
                                                     ("gemma3_text", 1, "NHD"), ("gemma3_text", 16, "HND"),
                                                     ("mistral", 3, "HND")])
def test_page_sizes_and_layouts(family, page_size, layout):
    compare(family, prompt(batch=2, seed=page_size), cache_args=dict(page_size=page_size, layout=layout))


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIG))
def test_the_kernel_takes_every_familys_options(family):
    """So that the unpadded generations above never fall back."""
    assert pkt.missing_kernel_options(paged_config(family)) == set()


@pytest.mark.parametrize("family,padded", [("gemma3_text", False), ("qwen2", True), ("gpt_oss", False)])
def test_sliding_layers_attend_a_long_prompt_in_chunks(family, padded, monkeypatch):
    """A sliding layer writes and attends a forward SLIDING_CHUNK queries at a time, its table freeing what leaves
    the window between chunks: its pool holds a window and a chunk, however long the prompt."""
    monkeypatch.setattr(pkt, "SLIDING_CHUNK", WINDOW)  # a 20-token prompt takes 3 chunks
    ids = prompt(batch=2, seed=11)
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :9], mask[1, :9] = 0, 0
    cache, _ = compare(family, ids, attention_mask=mask, cache_args=dict(page_size=2))
    for pool in cache.pools:
        if pool.window:
            assert pool.cache.n_pages == 2 * (-(-(2 * WINDOW - 1) // 2) + 2)


def test_sliding_chunk_argument_sizes_the_sliding_pools():
    """sliding_chunk=3: 20-token prompts take 7 chunks; each sliding pool holds a window and a chunk per row."""
    cache, counts = compare("gemma3_text", prompt(batch=2, seed=11), cache_args=dict(page_size=2, sliding_chunk=3))
    assert counts["fallback_calls"] == 0 and "sliding_chunk=3" in repr(cache)
    for pool in cache.pools:
        if pool.window:
            assert pool.cache.n_pages == 2 * (-(-(WINDOW - 1 + 3) // 2) + 2)


def test_sliding_pools_need_no_more_pages_than_the_full_pool():
    """n_pages sized to the request (beams: each row's tokens and a copy-on-write page) bounds the sliding pools,
    whose window-and-chunk size would be larger."""
    rows, page_size, tokens = 2, 2, PROMPT + 5
    n_pages = rows * (-(-tokens // page_size) + 1)
    cache, counts = compare("gemma3_text", prompt(batch=1, seed=5), num_beams=rows,
                            cache_args=dict(n_pages=n_pages, page_size=page_size))
    assert counts["fallback_calls"] == 0
    sliding = [pool for pool in cache.pools if pool.window]
    assert sliding and all(pool.cache.n_pages == n_pages for pool in sliding)
    assert n_pages < rows * (-(-(WINDOW - 1 + pkt.SLIDING_CHUNK) // page_size) + 2)
    for pool in cache.pools:
        pool.seqs.check()
        pool.cache.check()


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_left_padded_batch_falls_back_and_matches(family):
    ids = prompt(batch=2, seed=4)
    mask = torch.ones_like(ids)
    ids[0, :6], mask[0, :6] = 0, 0
    _, counts = compare(family, ids, attention_mask=mask)
    assert counts["fallback_calls"] > 0


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_beam_search(family):
    cache, _ = compare(family, prompt(batch=1, seed=5), num_beams=2)
    assert cache.batch_size == 2
    for pool in cache.pools:
        pool.seqs.check()
        pool.cache.check()


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_prompt_lookup_crops(family, monkeypatch):
    crops = []
    original = pkt.PagedKVCache.crop
    monkeypatch.setattr(pkt.PagedKVCache, "crop", lambda self, n: (crops.append(n), original(self, n))[1])
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11] * 3])
    compare(family, ids, prompt_lookup_num_tokens=3, max_new_tokens=8)
    assert any(n < 0 for n in crops), crops


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_sampling_with_a_seed(family):
    compare(family, prompt(batch=2, seed=6), seed=123, greedy=False, do_sample=True, top_k=20, max_new_tokens=6)


class _RoundTripLayer(DynamicLayer):
    """transformers' own layer on K/V rounded as pagedkv's quantized pages round them."""

    def __init__(self, kv_format):
        super().__init__()
        self.kv_format = kv_format

    def update(self, key_states, value_states, *args, **kwargs):
        batch, heads, n, dim = key_states.shape
        pages = pagedkv.PagedCache(1, batch * n, 1, heads, dim, "cpu", key_states.dtype, "NHD", self.kv_format)
        table = torch.tensor(pages.alloc_n(batch * n)).view(batch, n)
        pages.write(0, table, 0, key_states.transpose(1, 2), value_states.transpose(1, 2))
        k, v = pages.gather(0, table)
        return super().update(k.transpose(1, 2), v.transpose(1, 2))


@pytest.mark.parametrize("kv_format", ["fp8", "int8"])
def test_quantized_pages_match_the_same_rounding(kv_format):
    config, reference, paged = models("llama")
    ids = prompt(batch=2, seed=7)
    rounded = Cache(layers=[_RoundTripLayer(kv_format) for _ in range(config.num_hidden_layers)])
    expected = generate(reference, ids, rounded)
    cache = pkt.PagedKVCache(paged.config, n_pages=64, page_size=3, kv_format=kv_format)
    # A float32 difference of 1e-6 in a layer's input can move a later layer's K across a rounding boundary
    # (an int8 step is amax / 127): the tokens agree, the logits as closely as one such step allows.
    assert_same_generation(expected, generate(paged, ids, cache), tol=1e-2)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_float16_pages(family):
    """The soft-cap and sinks families in float16, HND pages: transformers' float16 run's tokens."""
    config, reference, paged = models(family)
    reference, paged = copy.deepcopy(reference).half(), copy.deepcopy(paged).half()
    ids = prompt(batch=2, seed=3)
    expected = generate(reference, ids, DynamicCache(config=config), max_new_tokens=4)
    pkt.reset_stats()
    got = generate(paged, ids, pkt.PagedKVCache(paged.config, n_pages=64, page_size=4, layout="HND"),
                   max_new_tokens=4)
    assert_same_generation(expected, got, tol=5e-2)  # float16 logits: 11 significant bits
    assert pkt.stats()["fallback_calls"] == 0


def test_output_attentions_falls_back():
    config, reference, paged = models("llama")
    ids = prompt(batch=1, seed=8)
    cache = pkt.PagedKVCache(paged.config, n_pages=16, page_size=4)
    pkt.reset_stats()
    with torch.no_grad():
        out = paged(ids, cache=cache, output_attentions=True)
    assert pkt.stats() == {"kernel_calls": 0, "fallback_calls": 2}
    assert len(out.attentions) == 2 and out.attentions[0].shape == (1, 4, PROMPT, PROMPT)


def test_pagedkv_attention_with_transformers_cache_falls_back():
    config, reference, paged = models("gemma3_text")
    ids = prompt(batch=2, seed=9)
    expected = generate(reference, ids, DynamicCache(config=config))
    pkt.reset_stats()
    assert_same_generation(expected, generate(paged, ids, DynamicCache(config=config)))
    assert pkt.stats()["kernel_calls"] == 0 and pkt.stats()["fallback_calls"] == 2 * 5


def test_two_models_at_once():
    """Each cache's K/V reach its own model's attention: the handle rides on the tensors."""
    _, _, llama = models("llama")
    _, _, gemma = models("gemma3_text")
    ids = prompt(batch=2, seed=10)
    alone = {name: generate(model, ids, pkt.PagedKVCache(model.config, n_pages=64, page_size=3)).sequences
             for name, model in (("llama", llama), ("gemma", gemma))}
    together = {}

    def run(name, model):
        together[name] = generate(model, ids, pkt.PagedKVCache(model.config, n_pages=64, page_size=3),
                                  max_new_tokens=5).sequences

    threads = [threading.Thread(target=run, args=item) for item in (("llama", llama), ("gemma", gemma))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in alone:
        assert together[name].tolist() == alone[name].tolist()


# ---------------------------------------------------------------- bad input


def test_unsupported_family_is_refused():
    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(ValueError, match="supported family.*got model_type 'gpt2'"):
        pkt.PagedKVCache(config)
    with pytest.raises(ValueError, match="'layout'"):
        pkt.PagedKVCache(paged_config("llama"), layout="XYZ")
    with pytest.raises(ValueError, match="'n_pages'"):
        pkt.PagedKVCache(paged_config("llama"), n_pages=0)
    with pytest.raises(ValueError, match="'sliding_chunk'"):
        pkt.PagedKVCache(paged_config("gemma3_text"), sliding_chunk=0)


def test_cache_too_small_changes_nothing():
    _, _, paged = models("llama")
    cache = pkt.PagedKVCache(paged.config, n_pages=4, page_size=4)  # 2 rows of 20 tokens need 10
    with pytest.raises(RuntimeError, match="cache is too small"):
        generate(paged, prompt(batch=2), cache)
    assert cache.get_seq_length() == 0 and cache.pages_in_use == 0
    generate(paged, prompt(batch=1, length=8), cache, max_new_tokens=3)  # what fits still runs
    assert cache.get_seq_length() == 10


def test_cache_reused_for_another_batch_or_model():
    _, _, llama = models("llama")
    cache = pkt.PagedKVCache(llama.config, n_pages=64, page_size=4)
    generate(llama, prompt(batch=2), cache, max_new_tokens=2)
    held, length = cache.pages_in_use, cache.get_seq_length()
    with pytest.raises(RuntimeError, match="batch of 3 sequences; the cache holds 2"):
        generate(llama, prompt(batch=3), cache, max_new_tokens=2)
    assert (cache.pages_in_use, cache.get_seq_length()) == (held, length)
    other = AutoModelForCausalLM.from_config(copy.deepcopy(llama.config), attn_implementation="pagedkv").eval()
    with pytest.raises(RuntimeError, match="another model"):
        with torch.no_grad():
            other(prompt(batch=2, length=1), cache=cache)
    assert (cache.pages_in_use, cache.get_seq_length()) == (held, length)
    _, _, gemma = models("gemma")
    with pytest.raises(RuntimeError):
        with torch.no_grad():
            gemma(prompt(batch=2, length=1), cache=cache)
    assert (cache.pages_in_use, cache.get_seq_length()) == (held, length)
    cache.reset()
    assert cache.pages_in_use == 0
    generate(llama, prompt(batch=3), cache, max_new_tokens=2)


def test_model_without_pagedkv_attention_is_refused():
    _, reference, _ = models("llama")
    cache = pkt.PagedKVCache(reference.config, n_pages=64, page_size=4)
    with pytest.raises(RuntimeError, match="attn_implementation='sdpa'"):
        generate(reference, prompt(), cache)
    assert cache.get_seq_length() == 0


def forward(model, ids, cache):
    with torch.no_grad():
        return model(ids, cache=cache).logits


def test_crop_deeper_than_a_forward_truncates_full_attention_tables():
    config, reference, paged = models("llama")
    ids = prompt(batch=2, seed=12)
    dynamic = DynamicCache(config=config)
    cache = pkt.PagedKVCache(paged.config, n_pages=64, page_size=3)
    for chunk in (ids[:, :12], ids[:, 12:16], ids[:, 16:17]):
        forward(reference, chunk, dynamic), forward(paged, chunk, cache)
    dynamic.crop(-6), cache.crop(-6)  # the last two forwards and one token before them
    assert cache.get_seq_length() == dynamic.get_seq_length() == 11
    expected, got = forward(reference, ids[:, 11:15], dynamic), forward(paged, ids[:, 11:15], cache)
    assert (expected - got).abs().max().item() <= TOL
    for pool in cache.pools:
        pool.seqs.check()


def test_crop_of_a_sliding_model_takes_back_the_last_forward_only():
    _, _, paged = models("gemma3_text")
    ids = prompt(batch=1, seed=13)
    cache = pkt.PagedKVCache(paged.config, n_pages=64, page_size=3)
    forward(paged, ids[:, :16], cache)
    forward(paged, ids[:, 16:19], cache)
    with pytest.raises(ValueError, match="more than the sliding layers still hold uncommitted"):
        cache.crop(-4)
    assert cache.get_seq_length() == 19
    cache.crop(-2)
    assert cache.get_seq_length() == 17
    reference = pkt.PagedKVCache(paged.config, n_pages=64, page_size=3)
    forward(paged, ids[:, :17], reference)
    assert (forward(paged, ids[:, 17:18], cache) - forward(paged, ids[:, 17:18], reference)).abs().max() <= TOL


def test_a_stale_handle_is_refused():
    _, _, paged = models("llama")
    cache = pkt.PagedKVCache(paged.config, n_pages=64, page_size=4)
    attention = paged.model.layers[0].self_attn
    key = torch.randn(1, 2, 3, 16)
    old_key, old_value = cache.update(key, key, 0)
    cache.update(key, key, 0)  # layer 0 again: a new forward, the first one's handle is stale
    query = torch.randn(1, 4, 3, 16)
    with pytest.raises(RuntimeError, match="no longer the cache's forward in flight"):
        pkt.attention(attention, query, old_key, old_value, None, scaling=0.25)
