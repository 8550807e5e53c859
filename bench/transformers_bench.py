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
Reported per model and side: prefill tokens/s (the prompt's forward),
decode tokens/s (batch x new tokens over the decode forwards), and the KV
bytes: DynamicCache's largest K/V held after a forward (its torch.cat
copies during a forward come on top), pagedkv's largest pages in use after
a forward and the bytes its pools reserve. Same process, same torch, same
threads (torch.set_num_threads); the tokens of both sides are compared.

  python3 bench/transformers_bench.py [--models llama,gemma3] [--batch 8] [--prompt 2048] [--new 128]
                                      [--threads N] [--dtype float32|bfloat16] [--quick]

Needs transformers 5 beside torch 2.x (e.g. PYTHONPATH=/opt/pagedkv-transformers:/opt/pagedkv-torch2)
and the pagedkv package built against that torch. Run on a quiet machine.
"""
import argparse
import copy
import platform
import time

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


def dynamic_bytes(cache):
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def paged_bytes(cache):
    """(bytes of the pages in use, bytes the pools reserve)."""
    used = reserved = 0
    for pool in cache.pools:
        if pool.cache is None:
            continue
        storage = [pool.cache.k_cache, pool.cache.v_cache] + [s for s in (pool.cache.k_scales, pool.cache.v_scales)
                                                              if s is not None]
        total = sum(t.numel() * t.element_size() for t in storage)
        reserved += total
        used += total * (pool.cache.n_pages - pool.cache.n_free()) // pool.cache.n_pages
    return used, reserved


def decode(model, cache, ids, new, measure):
    """Greedy: the prompt's forward, then `new` - 1 one-token forwards. Returns (tokens, prefill s, decode s, peak)."""
    peak = 0
    with torch.inference_mode():
        start = time.perf_counter()
        logits = model(ids, cache=cache, logits_to_keep=1).logits
        prefill = time.perf_counter() - start
        peak = max(peak, measure(cache))
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens = [token]
        start = time.perf_counter()
        for _ in range(new - 1):
            logits = model(token, cache=cache, logits_to_keep=1).logits
            peak = max(peak, measure(cache))
            token = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
        steps = time.perf_counter() - start
    return torch.cat(tokens, 1), prefill, steps, peak


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
    n_pages = args.batch * (-(-(args.prompt + args.new) // page_size) + 1)
    want, prefill_a, decode_a, peak_a = decode(reference, DynamicCache(config=reference.config), ids, args.new,
                                               dynamic_bytes)
    cache = pkt.PagedKVCache(paged.config, n_pages=n_pages, page_size=page_size)
    pkt.reset_stats()
    got, prefill_b, decode_b, peak_b = decode(paged, cache, ids, args.new, lambda c: paged_bytes(c)[0])
    reserved = paged_bytes(cache)[1]
    same = int((want == got).all(dim=1).sum())
    fmt = "| %s (%.0fM) | %s | %.0f | %.1f | %.1f MiB | %s |"
    mib = 1 << 20
    print(fmt % (name, params / 1e6, "DynamicCache + sdpa", args.batch * args.prompt / prefill_a,
                 args.batch * (args.new - 1) / decode_a, peak_a / mib, ""))
    print(fmt % (name, params / 1e6, "PagedKVCache + pagedkv", args.batch * args.prompt / prefill_b,
                 args.batch * (args.new - 1) / decode_b, peak_b / mib,
                 "%.1f MiB reserved; %d/%d rows same tokens; %s" % (reserved / mib, same, args.batch, pkt.stats())))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,gemma3")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--quick", action="store_true", help="small models (hidden 192, 6 layers): a smoke run")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pkt.enable()
    print("%s, %d threads, torch %s, %s, batch %d, prompt %d, %d new tokens%s\n" % (
        cpu_name(), torch.get_num_threads(), torch.__version__, args.dtype, args.batch, args.prompt, args.new,
        " (--quick sizes)" if args.quick else ""))
    print("| model | cache + attention | prefill tok/s | decode tok/s | KV held (max) | |")
    print("|---|---|---:|---:|---:|---|")
    for name in args.models.split(","):
        run(name, args)


if __name__ == "__main__":
    main()
