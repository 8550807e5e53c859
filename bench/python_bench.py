#!/usr/bin/env python3
"""The original Python PagedCache against pagedkv.PagedCache, from Python.

Cases (the engine's two hot calls, as the C++ benchmark names them):
  gather_decode  B sequences of T tokens each: gather(layer, page_table), the
                 original's total-length semantics (every mapped page);
  write_prefill  B prompts of S tokens: write(layer, page_table, 0, k, v);
  write_decode   B sequences, one new token each, at position T - 1.
Both classes run in this process on the same threads (torch.set_num_threads:
ATen's pool, which the original's indexing and pagedkv's at::parallel_for
both use), fp16, 8 kv heads x 128, pages of 16 tokens, layer 0 of 2. Beside
them: `copy`, a torch copy of the same bytes (out.copy_(src), contiguous):
what moving those bytes costs at best. Each time is the median of --repeats
calls after warm-up; the speed-up is original / pagedkv.

  python3 bench/python_bench.py [--threads N] [--repeats N] [--quick] [--layout NHD|HND|both]

Run on a quiet machine: other processes on the cores change the numbers.
"""
import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

import pagedkv

HERE = os.path.dirname(os.path.abspath(__file__))
HEADS, DIM, PAGE = 8, 128, 16
DTYPE = torch.float16


def load_reference(folder):
    path = os.path.join(folder, "paged_cache.py")
    if not os.path.isfile(path):
        sys.exit("python_bench: no paged_cache.py in %s (--reference DIR)" % folder)
    spec = importlib.util.spec_from_file_location("reference_paged_cache", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PagedCache


def median_time(fn, repeats, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fmt_time(seconds):
    if seconds >= 1e-3:
        return "%.3g ms" % (seconds * 1e3)
    return "%.3g us" % (seconds * 1e6)


def fmt_bytes(n):
    return "%.3g MiB" % (n / 2 ** 20) if n >= 2 ** 20 else "%.3g KiB" % (n / 2 ** 10)


def caches(Reference, layout, n_pages):
    ref = Reference(2, n_pages, PAGE, HEADS, DIM, torch.device("cpu"), DTYPE)
    ref.k_cache.normal_()
    ref.v_cache.normal_()
    ours = pagedkv.PagedCache(2, n_pages, PAGE, HEADS, DIM, "cpu", DTYPE, layout=layout)
    return ref, ours


def page_table(batch, cols, n_pages):
    """Each sequence's pages, scattered over the pool (as after some churn)."""
    perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(0))[: batch * cols]
    return perm.view(batch, cols).to(torch.int64)


def case_gather_decode(Reference, layout, batch, n_tokens, repeats):
    cols = n_tokens // PAGE
    n_pages = batch * cols + 8
    ref, ours = caches(Reference, layout, n_pages)
    ours.alloc_n(n_pages)
    pt = page_table(batch, cols, n_pages)
    nbytes = 2 * batch * n_tokens * HEADS * DIM * 2
    src = torch.randn(nbytes // 2, dtype=torch.float32).to(DTYPE)
    dst = torch.empty_like(src)
    return {
        "case": "gather_decode/%s/B%dxT%d" % (layout, batch, n_tokens),
        "bytes": nbytes,
        "original": median_time(lambda: ref.gather(0, pt), repeats),
        "pagedkv": median_time(lambda: ours.gather(0, pt), repeats),
        "copy": median_time(lambda: dst.copy_(src), repeats),
    }


def case_write(Reference, layout, batch, n_tokens, start, repeats, name):
    cols = (start + n_tokens + PAGE - 1) // PAGE
    n_pages = batch * cols + 8
    ref, ours = caches(Reference, layout, n_pages)
    ours.alloc_n(n_pages)
    pt = page_table(batch, cols, n_pages)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(batch, n_tokens, HEADS, DIM, generator=gen).to(DTYPE)
    v = torch.randn(batch, n_tokens, HEADS, DIM, generator=gen).to(DTYPE)
    nbytes = 2 * k.numel() * k.element_size()
    src = torch.cat([k.view(-1), v.view(-1)])
    dst = torch.empty_like(src)
    ref.write(0, pt, start, k, v)
    ours.write(0, pt, start, k, v)
    # the same bits land in the same pages (token-major view for HND)
    want, got = ref.gather(0, pt), ours.gather(0, pt)
    assert all(torch.equal(w[:, start:start + n_tokens], g[:, start:start + n_tokens]) for w, g in zip(want, got))
    return {
        "case": "%s/%s/B%dxS%d" % (name, layout, batch, n_tokens),
        "bytes": nbytes,
        "original": median_time(lambda: ref.write(0, pt, start, k, v), repeats),
        "pagedkv": median_time(lambda: ours.write(0, pt, start, k, v), repeats),
        "copy": median_time(lambda: dst.copy_(src), repeats),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch.set_num_threads for both (default: torch's, %(default)s)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per case (median)")
    parser.add_argument("--quick", action="store_true", help="small sizes and 3 repeats: checks that it runs")
    parser.add_argument("--layout", choices=["NHD", "HND", "both"], default="both")
    parser.add_argument("--reference", default=os.path.join(HERE, "..", "..", "shared", "reference"),
                        help="folder holding the original paged_cache.py (default ../shared/reference)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    Reference = load_reference(args.reference)
    repeats = 3 if args.quick else args.repeats
    layouts = ["NHD", "HND"] if args.layout == "both" else [args.layout]
    if args.quick:
        gathers, prefills, decodes = [(4, 256)], [(2, 128)], [(8, 256)]
    else:
        gathers, prefills, decodes = [(32, 2048), (8, 8192), (1, 32768)], [(4, 2048), (1, 8192)], [(32, 2048),
                                                                                                   (256, 1024)]
    rows = []
    for layout in layouts:
        for batch, n_tokens in gathers:
            rows.append(case_gather_decode(Reference, layout, batch, n_tokens, repeats))
        for batch, n_tokens in prefills:
            rows.append(case_write(Reference, layout, batch, n_tokens, 0, repeats, "write_prefill"))
        for batch, n_tokens in decodes:
            rows.append(case_write(Reference, layout, batch, 1, n_tokens - 1, repeats, "write_decode"))
    print("torch %s, pagedkv %s, %d threads, fp16, %d kv heads x %d, pages of %d tokens, median of %d%s"
          % (torch.__version__, pagedkv.__version__, torch.get_num_threads(), HEADS, DIM, PAGE, repeats,
             " (--quick: sizes too small to mean anything)" if args.quick else ""))
    print()
    print("| case | bytes | original | pagedkv | speed-up | pagedkv / copy |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print("| `%s` | %s | %s | %s | %.1fx | %.2fx |" % (r["case"], fmt_bytes(r["bytes"]), fmt_time(r["original"]),
                                                         fmt_time(r["pagedkv"]), r["original"] / r["pagedkv"],
                                                         r["pagedkv"] / r["copy"]))


if __name__ == "__main__":
    main()
