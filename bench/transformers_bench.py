#!/usr/bin/env python3
"""pagedkv.transformers against transformers' DynamicCache + sdpa, from Python.

Random models built with from_config (no download), greedy decoding written
out as its forwards (prefill, then one token per step) so that both sides
run the same calls:
  llama   a ~100M-parameter Llama (hidden 768, 12 layers, 12 query / 4 kv
          heads of 64);
  gemma3  a Gemma-3-shaped model (gemma3_text: hidden 640, 12 layers, 4
          query / 1 kv head of 256, sliding window 512 on five layers of
          six).
Reported per model and side (DynamicCache + sdpa; PagedKVCache + "pagedkv"
with native, fp8 and int8 pages, --formats): prefill tokens/s (the prompt's
forward), decode tokens/s (batch x (new - 1) tokens over the decode
forwards), and the K/V bytes each cache keeps alive:
  held after the prompt's forward, and after the decode forwards (their
      largest): DynamicCache's K/V storages, counted whole (after a forward
      longer than the window, a sliding layer's window is a view into that
      forward's torch.cat result: the whole forward's K/V stay alive until
      the layer's next update); PagedKVCache's pools' storage (allocated
      whole at the first forward, never resized);
  peak inside a forward: for DynamicCache the largest sum of its storages
      at any point of an update (after each torch.cat, the tensor it
      replaces still alive), over the whole run; for PagedKVCache its
      storage (its writes and kernel copy at most the call's own tokens,
      never the cached K/V);
  the ratios of PagedKVCache's peak and held-in-decode bytes to
      DynamicCache's.
A second table splits them by layer type (full / sliding): DynamicCache's
element bytes / storage bytes, PagedKVCache's pages in use / storage.
Not counted on either side: the new tokens' K/V as the model computes them
(activations), and sdpa's temporaries (repeat_kv's copies of K/V for
grouped heads when it runs with a mask). Same process, same torch, same
threads (torch.set_num_threads); the tokens of each PagedKVCache run are
compared with DynamicCache's (fp8 / int8 pages round K/V, so their tokens
may differ). The full-attention pool is sized to the request: batch *
ceil((prompt + new - 1) / 16) pages of 16 tokens.
Memory does not depend on the CPU or on time: a short run (--new 4) gives
the memory columns of a long one, except the decode-held column's extra
new tokens.

  python3 bench/transformers_bench.py [--models llama,gemma3] [--batch 8] [--prompt 2048] [--new 128]
                                      [--threads N] [--dtype float32|bfloat16] [--formats native,fp8,int8]
                                      [--quick]

Needs transformers 5 beside torch 2.x (e.g. PYTHONPATH=/opt/pagedkv-transformers:/opt/pagedkv-torch2)
and the pagedkv package built against that torch. Run on a quiet machine.
"""
import argparse
import copy
import platform
import time
import weakref

import torch

import pagedkv.transformers as pkt
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

MODELS = {
    "llama": ("llama", dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                            num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                            max_position_embeddings=8192)),
    "gemma3": ("gemma3_text", dict(vocab_size=32000, hidden_size=640, intermediate_size=2048, num_hidden_layers=12,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                                   sliding_window_pattern=6, max_position_embeddings=8192)),
}
QUICK = dict(hidden_size=192, intermediate_size=256, num_hidden_layers=6, vocab_size=1024)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _storages(tensors):
    """{storage address: bytes} of the tensors' storages (a view counts its whole storage, once)."""
    found = {}
    for t in tensors:
        if t is not None and t.numel():
            storage = t.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


def dynamic_held(cache):
    """{"full"|"sliding": (bytes of the K/V tensors' elements, bytes of their storages)} of a DynamicCache.

    The two differ after a forward of more than a window: a sliding layer keeps
    a view of its window into that forward's torch.cat result, whose storage
    (the whole forward's K/V) stays alive until the layer's next update."""
    out = {}
    for layer in cache.layers:
        kind = "sliding" if getattr(layer, "is_sliding", False) else "full"
        tensors = [t for t in (layer.keys, layer.values) if t is not None]
        elements = sum(t.numel() * t.element_size() for t in tensors)
        stored = sum(_storages(tensors).values())
        e, s = out.get(kind, (0, 0))
        out[kind] = (e + elements, s + stored)
    return out


class DynamicPeak:
    """The largest bytes of K/V storage a DynamicCache has alive at once, inside its updates included.

    Wraps each layer's update and torch.cat while it runs: after every
    torch.cat (a layer's new K or V, the old one still referenced) and when
    the update returns, it sums the distinct storages of every layer's
    keys/values, the torch.cat results still alive and the returned K/V. The
    model's new-token K/V that go in (activations, the same for pagedkv)
    and sdpa's own temporaries (repeat_kv's copies for grouped heads) are
    not counted. `spent` is the seconds its own counting took, which the
    timings leave out."""

    def __init__(self, cache):
        self.cache = cache
        self.peak = 0
        self.spent = 0.0
        for layer in cache.layers:
            layer.update = self._wrap(layer.update)

    def _note(self, extra):
        start = time.perf_counter()
        tensors = [t for layer in self.cache.layers for t in (layer.keys, layer.values) if t is not None]
        self.peak = max(self.peak, sum(_storages(tensors + extra).values()))
        self.spent += time.perf_counter() - start

    def _wrap(self, update):
        def wrapped(key_states, value_states, *args, **kwargs):
            fresh = []
            real_cat = torch.cat

            def cat(*a, **k):
                result = real_cat(*a, **k)
                fresh.append(weakref.ref(result))
                self._note([r() for r in fresh if r() is not None])
                return result
            torch.cat = cat
            try:
                out = update(key_states, value_states, *args, **kwargs)
            finally:
                torch.cat = real_cat
            self._note([r() for r in fresh if r() is not None] + list(out))
            return out
        return wrapped


def paged_held(cache):
    """{"full"|"sliding": (bytes of the pages in use, bytes the pools' storage holds)} of a PagedKVCache (scales
    included); its storage is allocated whole at the first forward and never changes."""
    out = {}
    for pool in cache.pools:
        if pool.cache is None:
            continue
        kind = "sliding" if pool.window else "full"
        c = pool.cache
        total = sum(t.numel() * t.element_size() for t in (c.k_cache, c.v_cache, c.k_scales, c.v_scales)
                    if t is not None)
        used = total * (c.n_pages - c.n_free()) // c.n_pages
        u, r = out.get(kind, (0, 0))
        out[kind] = (u + used, r + total)
    return out


def total(held, index):
    return sum(v[index] for v in held.values())


def decode(model, cache, ids, new, measure, probe_seconds=lambda: 0.0):
    """Greedy: the prompt's forward, then `new` - 1 one-token forwards.

    Returns (tokens, prefill s, decode s, held after the prompt's forward, held after the decode forwards: each
    entry's largest); `measure(cache)` gives the held dict, taken outside the timed calls; `probe_seconds()` the
    seconds a probe inside the forwards has spent so far, left out of the timings."""
    with torch.inference_mode():
        start, probed = time.perf_counter(), probe_seconds()
        logits = model(ids, cache=cache, logits_to_keep=1).logits
        prefill = time.perf_counter() - start - (probe_seconds() - probed)
        after_prefill = measure(cache)
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens = [token]
        steps = 0.0
        in_decode = {}
        for _ in range(new - 1):
            start, probed = time.perf_counter(), probe_seconds()
            logits = model(token, cache=cache, logits_to_keep=1).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            steps += time.perf_counter() - start - (probe_seconds() - probed)
            for kind, values in measure(cache).items():
                in_decode[kind] = tuple(max(pair) for pair in zip(values, in_decode.get(kind, values)))
            tokens.append(token)
    return torch.cat(tokens, 1), prefill, steps, after_prefill, in_decode


MIB = 1 << 20


def mib(n):
    return "%.1f MiB" % (n / MIB)


def run(name, args):
    family, sizes = MODELS[name]
    sizes = dict(sizes, **(QUICK if args.quick else {}))
    config = AutoConfig.for_model(family, **sizes)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=dtype)
    paged = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="pagedkv", dtype=dtype)
    paged.load_state_dict(reference.state_dict())
    reference.eval(), paged.eval()
    params = sum(p.numel() for p in reference.parameters())
    ids = torch.randint(0, config.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    page_size = 16
    # The full-attention pool sized to the request: every row's prompt and new tokens, no copy-on-write page
    # (greedy decoding forks no row).
    n_pages = args.batch * -(-(args.prompt + args.new - 1) // page_size)
    label = "%s (%.0fM)" % (name, params / 1e6)
    dynamic = DynamicCache(config=reference.config)
    probe = DynamicPeak(dynamic)
    want, prefill_a, decode_a, held_a, decode_held_a = decode(reference, dynamic, ids, args.new, dynamic_held,
                                                              lambda: probe.spent)
    peak_a = probe.peak
    rows = [(label, "DynamicCache + sdpa", prefill_a, decode_a, total(held_a, 1), total(decode_held_a, 1), peak_a,
             "the peak's probe took %.2f s, left out of the timings" % probe.spent)]
    breakdown = [(label, "DynamicCache", held_a, decode_held_a)]
    for kv_format in args.formats.split(","):
        cache = pkt.PagedKVCache(paged.config, n_pages=n_pages, page_size=page_size, kv_format=kv_format)
        pkt.reset_stats()
        got, prefill_b, decode_b, held_b, decode_held_b = decode(paged, cache, ids, args.new, paged_held)
        reserved = total(paged_held(cache), 1)  # the pools' storage: all of it, from the first forward on
        same = int((want == got).all(dim=1).sum())
        rows.append((label, "PagedKVCache + pagedkv, %s pages" % kv_format, prefill_b, decode_b, reserved, reserved,
                     reserved, "%d/%d rows same tokens; %s" % (same, args.batch, pkt.stats())))
        breakdown.append((label, "PagedKVCache, %s" % kv_format, held_b, decode_held_b))
        del cache
    for label_, side, prefill, steps, held_p, held_d, peak, note in rows:
        print("| %s | %s | %.0f | %.1f | %s | %s | %s | %.2fx | %.2fx | %s |" % (
            label_, side, args.batch * args.prompt / prefill, args.batch * (args.new - 1) / steps, mib(held_p),
            mib(held_d), mib(peak), peak / peak_a, held_d / total(decode_held_a, 1), note))
    return breakdown


def print_breakdown(breakdown):
    print("\nPer layer type. DynamicCache: bytes of its K/V tensors' elements / of their storages (a sliding "
          "layer's window is a view into its last update's torch.cat result). PagedKVCache: bytes of the pages "
          "in use / of the pools' storage (allocated whole at the first forward).\n")
    print("| model | cache | layers | after the prompt's forward | after the decode forwards (max) |")
    print("|---|---|---|---:|---:|")
    for label, side, after_prefill, in_decode in breakdown:
        for kind in ("full", "sliding"):
            if kind in after_prefill:
                print("| %s | %s | %s | %s | %s |" % (label, side, kind, *("%s / %s" % (mib(held[kind][0]),
                                                                               mib(held[kind][1]))
                                                                           for held in (after_prefill, in_decode))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,gemma3")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--formats", default="native,fp8,int8",
                        help="PagedKVCache kv_format rows, comma-separated (native, fp8, int8)")
    parser.add_argument("--quick", action="store_true", help="small models (hidden 192, 6 layers): a smoke run")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pkt.enable()
    print("%s, %d threads, torch %s, %s, batch %d, prompt %d, %d new tokens%s\n" % (
        cpu_name(), torch.get_num_threads(), torch.__version__, args.dtype, args.batch, args.prompt, args.new,
        " (--quick sizes)" if args.quick else ""))
    print("| model | cache + attention | prefill tok/s | decode tok/s | KV held after the prompt's forward | "
          "KV held after a decode forward (max) | KV peak (inside a forward) | peak / DynamicCache's | "
          "held in decode / DynamicCache's | |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    breakdown = []
    for name in args.models.split(","):
        breakdown += run(name, args)
    print_breakdown(breakdown)

if __name__ == "__main__":
    main()
