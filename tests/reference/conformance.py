"""Bit-for-bit conformance of pagedkv with the Python reference design.

Generates random operation scripts that stay inside what the reference
defines (no -1 pages at read positions, no double frees, distinct pages per
write), runs them on ../shared/reference/paged_cache.py and on the C++
library (pagedkv_script_runner, both layouts), and compares every result:
page ids from alloc/alloc_n, n_free, gathered shapes and values.

Usage: python3 conformance.py --runner PATH [--reference DIR] [--scripts N] [--steps N]
"""
import argparse
import os
import random
import subprocess
import sys

import torch

HEADS, DIM = 2, 4
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def values(shape, seed, dtype):
    n = 1
    for s in shape:
        n *= s
    i = torch.arange(n, dtype=torch.int64)
    return (((i * 7 + seed * 131) % 251 - 125).to(torch.float32) / 8.0).view(shape).to(dtype)


def fmt(t):
    return " ".join("%g" % x for x in t.to(torch.float32).contiguous().view(-1).tolist())


def make_script(rng, steps, n_layers, n_pages, page_size):
    """Random valid operations, as text lines; reference-side state is tracked here."""
    allocated = set()
    lines = []
    for _ in range(steps):
        op = rng.random()
        if op < 0.2:
            lines.append("alloc")
            if len(allocated) < n_pages:
                allocated.add(min(set(range(n_pages)) - allocated))
        elif op < 0.3:
            n = rng.randint(0, 4)
            lines.append("alloc_n %d" % n)
            if n <= n_pages - len(allocated):
                for _ in range(n):
                    allocated.add(min(set(range(n_pages)) - allocated))
        elif op < 0.4 and allocated:
            page = rng.choice(sorted(allocated))
            allocated.remove(page)
            lines.append("free %d" % page)
        elif op < 0.7 and allocated:
            batch = rng.randint(1, 3)
            cols = rng.randint(1, max(1, len(allocated) // batch))
            if batch * cols > len(allocated):
                continue
            pages = rng.sample(sorted(allocated), batch * cols)
            seq = rng.randint(0, cols * page_size)
            start = rng.randint(0, cols * page_size - seq)
            layer = rng.randint(0, n_layers - 1)
            lines.append("write %d %d %d %d %d %d %s" % (layer, start, batch, seq, rng.randint(0, 999), cols,
                                                        " ".join(map(str, pages))))
        elif allocated:
            batch = rng.randint(1, 3)
            mapped = rng.randint(1, 4)
            trailing = rng.randint(0, 2)  # all -1 columns: the reference stops there
            live = sorted(allocated)
            rows = [[rng.choice(live) for _ in range(mapped)] + [-1] * trailing for _ in range(batch)]
            total_len = rng.choice([0, rng.randint(1, mapped * page_size)])
            layer = rng.randint(0, n_layers - 1)
            lines.append("gather %d %d %d %d %s" % (layer, total_len, batch, mapped + trailing,
                                                    " ".join(str(p) for r in rows for p in r)))
    return lines


def run_reference(PagedCache, lines, n_layers, n_pages, page_size, dtype):
    cache = PagedCache(n_layers, n_pages, page_size, HEADS, DIM, torch.device("cpu"), dtype)
    cache.k_cache.zero_()  # the reference leaves storage uninitialised; pagedkv zeroes it
    cache.v_cache.zero_()
    out = []
    for line in lines:
        w = line.split()
        if w[0] == "alloc":
            out.append("alloc %d" % cache.alloc())
        elif w[0] == "alloc_n":
            out.append(" ".join(["alloc_n"] + [str(p) for p in cache.alloc_n(int(w[1]))]))
        elif w[0] == "free":
            cache.free(int(w[1]))
            out.append("free n_free=%d" % bin(cache._free_mask).count("1"))
        elif w[0] == "write":
            layer, start, batch, seq, seed, cols = map(int, w[1:7])
            pt = torch.tensor([int(x) for x in w[7:]], dtype=torch.int64).view(batch, cols)
            shape = (batch, seq, HEADS, DIM)
            cache.bind(pt).write(layer, start, values(shape, seed, dtype), values(shape, seed + 1, dtype))
            out.append("write ok")
        else:
            layer, total_len, batch, cols = map(int, w[1:5])
            pt = torch.tensor([int(x) for x in w[5:]], dtype=torch.int64).view(batch, cols)
            k, v = cache.bind(pt, total_len).gather(layer)
            out.append("gather %d %d k %s v %s" % (k.size(0), k.size(1), fmt(k), fmt(v)))
    return out


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runner", required=True, help="path to pagedkv_script_runner")
    parser.add_argument("--reference", default=os.path.join(here, "..", "..", "..", "shared", "reference"),
                        help="folder holding paged_cache.py (default: ../shared/reference)")
    parser.add_argument("--scripts", type=int, default=4, help="random scripts per dtype and page size")
    parser.add_argument("--steps", type=int, default=150, help="operations per script")
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.reference))
    from paged_cache import PagedCache  # noqa: E402

    rng = random.Random(2026)
    script, want, labels = [], [], []
    for dtype_name, dtype in DTYPES.items():
        for page_size in (1, 3, 16):
            for _ in range(args.scripts):
                n_layers, n_pages = 2, rng.randint(1, 20)
                lines = make_script(rng, args.steps, n_layers, n_pages, page_size)
                script.append("cache %d %d %d %d %d %s" % (n_layers, n_pages, page_size, HEADS, DIM, dtype_name))
                want.append("cache")
                labels.append(script[-1])
                script += lines
                want += run_reference(PagedCache, lines, n_layers, n_pages, page_size, dtype)
                labels += ["%s P=%d: %s" % (dtype_name, page_size, line) for line in lines]
    compared = 0
    for layout in ("NHD", "HND"):
        res = subprocess.run([args.runner, layout], input="\n".join(script) + "\n",
                             capture_output=True, text=True, check=False)
        if res.returncode != 0:
            print("runner failed (%s): %s" % (layout, res.stderr))
            return 1
        got = res.stdout.splitlines()
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                print("MISMATCH %s at op %d (%s)\n  pagedkv:   %s\n  reference: %s"
                      % (layout, i, labels[i][:200], g[:200], w[:200]))
                return 1
        if len(got) != len(want):
            print("MISMATCH %s: %d results from pagedkv, %d from the reference" % (layout, len(got), len(want)))
            return 1
        compared += sum(1 for w in want if w != "cache")
    print("conformance: %d results compared bit for bit with the reference, 0 mismatches" % compared)
    return 0


if __name__ == "__main__":
    sys.exit(main())
