#!/usr/bin/env python3
"""examples/llama against transformers' generate: prefill and decode tokens/s.

    PYTHONPATH=/opt/pagedkv-transformers:/opt/pagedkv-torch2 \\
      python3 bench/llama_vs_transformers.py --llama build-torch2/examples/llama/llama \\
        [--llama build/examples/llama/llama] [--threads 2]

Builds a random Llama of the ~100M shape (make_tiny_model.py --preset bench:
hidden 1024, 8 layers, 16 heads, 4 kv heads, intermediate 2048, vocabulary
32000, tied embeddings: 103M parameters, float32), writes N requests of P
random prompt tokens and G new tokens each (default 32 x 1024, 256), and
times, with the same thread count:

  examples/llama     the engine with its defaults (--max-batch-tokens 2048,
                     page size 16, NHD float32 pages, prefix cache on), all
                     requests in one request file; each --llama given, in
                     turn: a build against the torch on PYTHONPATH (pip's,
                     which transformers runs on) and one against Debian's
                     libtorch, so that both torches are measured in one run.
                     Each is named by the libtorch_cpu and libblas.so.3 that
                     the loader gives it (ldd): Debian's torch multiplies on
                     whatever BLAS Debian's alternatives select.
  transformers       generate() on all N prompts as one batch (equal lengths:
                     no padding), greedy, its default attention (sdpa) and
                     cache (DynamicCache)

each twice: with max_new_tokens 1 (prefill: the prompts and one token) and
with G. Prefill tokens/s = N x P / t(1); decode tokens/s = N x (G - 1) /
(t(G) - t(1)); the same arithmetic for both, from wall times measured inside
each process around the work alone (model loading excluded; for the engine,
--stats' serve_seconds). CPU seconds of the process over the same span are
printed beside them: on a shared machine wall times include waiting.

Then the same with a shared prefix: the first --shared of each prompt
(0.75: 768 tokens) is the same in every request. The engine's prefix cache
skips it for all but the first requests; transformers has no prefix cache,
so it computes the same as before (its prefill is timed again anyway).

Prints a markdown table and writes it and the raw numbers to --out
(JSON), with the engine's prefix-cache hit rate per case. --small runs 4 x
128 prompt tokens and 16 new, with --max-batch-tokens 128 so that the shared
prefix is cached before later requests arrive (with the default budget all
four prompts would be admitted in one step, before any could register it): a
check of the script, not a measurement. At full size the default budget
admits two 1024-token prompts per step, so 30 of the 32 find the prefix.
"""
import argparse
import json
import os
import random
import subprocess
import time

from llama_runs import serve, write_requests

import make_tiny_model  # noqa: E402 (llama_runs put it on the path)


def make_prompts(n, length, shared_fraction, vocab, seed):
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(int(length * shared_fraction))]
    return [shared + [rng.randrange(vocab) for _ in range(length - len(shared))] for _ in range(n)]


def run_engine(llama, model_dir, work, name, prompts, new_tokens, threads, extra):
    req = os.path.join(work, name + ".jsonl")
    write_requests(req, prompts, new_tokens)
    s, tokens = serve(llama, model_dir, req, work, name, threads, extra, echo=True)
    n_out = sum(len(t) for t in tokens.values())
    assert n_out == len(prompts) * new_tokens, (n_out, len(prompts) * new_tokens)
    return {"wall": s["serve_seconds"], "cpu": s["serve_cpu_seconds"], "stats": s}


def describe_build(llama, torch_module):
    """Which torch and which BLAS the loader gives this llama binary, from ldd."""
    p = subprocess.run(["ldd", llama], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    libs = {}
    for line in p.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>":
            libs[parts[0]] = os.path.realpath(parts[2])
    torch_cpu = next((path for name, path in libs.items() if name.startswith("libtorch_cpu.so")), None)
    if torch_cpu is None:
        raise SystemExit(f"{llama}: ldd finds no libtorch_cpu:\n{p.stdout}")
    if torch_cpu.startswith(os.path.dirname(os.path.realpath(torch_module.__file__)) + os.sep):
        torch_name = f"torch {torch_module.__version__} (pip)"
    else:
        torch_name = f"Debian's torch ({os.path.basename(torch_cpu)})"
    blas = libs.get("libblas.so.3")
    if blas is None:
        blas_name = "its own BLAS"
    else:
        # Debian keeps each BLAS alternative in its own folder; blas/ is the reference one.
        folder = os.path.basename(os.path.dirname(blas))
        blas_name = "reference BLAS" if folder == "blas" else folder
    return f"{torch_name}, {blas_name}", {"torch_cpu": torch_cpu, "libblas.so.3": blas}


def run_transformers(model, prompts, new_tokens):
    import torch

    ids = torch.tensor(prompts)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert out.shape == (len(prompts), len(prompts[0]) + new_tokens), out.shape
    return {"wall": wall, "cpu": cpu}


def rates(n, prompt, new, t1, tg):
    """Prefill and decode tokens/s (wall and CPU) from the max_new_tokens=1 and =G runs."""
    r = {}
    for kind in ("wall", "cpu"):
        r["prefill_" + kind] = n * prompt / t1[kind]
        dt = tg[kind] - t1[kind]
        r["decode_" + kind] = n * (new - 1) / dt if dt > 0 else float("nan")
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama", required=True, action="append",
                    help="examples/llama built against a torch (repeat it: each build is timed in turn)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--shared", type=float, default=0.75)
    ap.add_argument("--work", default="/tmp/pagedkv-llama-bench")
    ap.add_argument("--out", default=None, help="JSON results (default WORK/results.json)")
    ap.add_argument("--small", action="store_true", help="4 x 128 prompt tokens, 16 new: a check of the script")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--max-batch-tokens", type=int, default=None,
                    help="the engine's budget a step (its default, 2048, unless given; --small: the prompt length)")
    a = ap.parse_args()
    engine_extra = []
    if a.small:
        a.requests, a.prompt, a.new = 4, 128, 16
        engine_extra = ["--max-batch-tokens", str(a.prompt)]
    if a.max_batch_tokens is not None:
        engine_extra = ["--max-batch-tokens", str(a.max_batch_tokens)]
    os.makedirs(a.work, exist_ok=True)

    import torch
    import transformers
    from transformers import LlamaForCausalLM

    torch.set_num_threads(a.threads)
    model_dir = os.path.join(a.work, "model")
    if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
        make_tiny_model.make(model_dir, "bench", seed=0, reference=False)
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    print(f"{a.requests} requests x {a.prompt} prompt tokens, {a.new} new; {a.threads} threads; {cpu}; torch "
          f"{torch.__version__}, transformers {transformers.__version__}; load average {os.getloadavg()}",
          flush=True)

    builds = []
    for i, llama in enumerate(a.llama):
        name, libs = describe_build(llama, torch)
        builds.append({"key": f"engine{i}", "llama": llama, "name": name, "libs": libs})
        print(f"examples/llama {llama}: {name}", flush=True)
    results = {"requests": a.requests, "prompt": a.prompt, "new": a.new, "threads": a.threads, "cpu": cpu,
               "engine_args": engine_extra,
               "load_average_start": os.getloadavg(), "torch": torch.__version__,
               "transformers": transformers.__version__, "builds": builds, "cases": {}}
    for case, shared in (("distinct prompts", 0.0), (f"{int(a.shared * 100)} % shared prefix", a.shared)):
        prompts = make_prompts(a.requests, a.prompt, shared, vocab, seed=1)
        tag = "shared" if shared else "distinct"
        res = {}
        for b in builds:
            e1 = run_engine(b["llama"], model_dir, a.work, tag + "-1", prompts, 1, a.threads, engine_extra)
            eg = run_engine(b["llama"], model_dir, a.work, tag + "-g", prompts, a.new, a.threads, engine_extra)
            res[b["key"]] = rates(a.requests, a.prompt, a.new, e1, eg)
            res[b["key"] + "_runs"] = [e1, eg]
            res["prefix_hit_rate"] = e1["stats"]["prefix_hit_tokens"] / max(1, e1["stats"]["prefix_query_tokens"])
        if not a.skip_transformers:
            model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            t1 = run_transformers(model, prompts, 1)
            print(f"transformers, max_new_tokens 1: {t1['wall']:.2f} s ({t1['cpu']:.2f} CPU s)", flush=True)
            tg = run_transformers(model, prompts, a.new)
            print(f"transformers, max_new_tokens {a.new}: {tg['wall']:.2f} s ({tg['cpu']:.2f} CPU s)", flush=True)
            res["transformers"] = rates(a.requests, a.prompt, a.new, t1, tg)
            res["transformers_runs"] = [t1, tg]
            del model
        results["cases"][case] = res

    results["load_average_end"] = os.getloadavg()
    print(f"\n{a.requests} requests x {a.prompt} prompt tokens + {a.new} new, {a.threads} threads, {cpu}; load "
          f"average (1, 5, 15 min) {results['load_average_start']} at the start, {results['load_average_end']} at "
          f"the end")
    print("| case | | prefill tokens/s | decode tokens/s | prefill (CPU-s based) | decode (CPU-s based) |")
    print("|---|---|---:|---:|---:|---:|")
    for case, res in results["cases"].items():
        rows = [(f"examples/llama, {b['name']}", res[b["key"]]) for b in builds]
        if "transformers" in res:
            rows.append((f"transformers, torch {torch.__version__}", res["transformers"]))
        for label, r in rows:
            print(f"| {case} | {label} | {r['prefill_wall']:.0f} | {r['decode_wall']:.1f} | "
                  f"{r['prefill_cpu']:.0f} | {r['decode_cpu']:.1f} |")
        if "transformers" in res:
            t = res["transformers"]
            for b in builds:
                e = res[b["key"]]
                print(f"| {case} | ratio, {b['name']} / transformers | {e['prefill_wall'] / t['prefill_wall']:.2f}x | "
                      f"{e['decode_wall'] / t['decode_wall']:.2f}x | {e['prefill_cpu'] / t['prefill_cpu']:.2f}x | "
                      f"{e['decode_cpu'] / t['decode_cpu']:.2f}x |")
    for case, res in results["cases"].items():
        print(f"{case}: examples/llama's prefix-cache hit rate {100 * res['prefix_hit_rate']:.1f} % of prompt tokens")
    out = a.out or os.path.join(a.work, "results.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nraw numbers: {out}")


if __name__ == "__main__":
    main()
