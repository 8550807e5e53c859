#!/usr/bin/env python3
"""examples/llama on a Gemma-3-shaped model: what freeing out-of-window pages saves.

    PYTHONPATH=/opt/pagedkv-transformers:/opt/pagedkv-torch2 \\
      python3 bench/llama_windows.py --llama build/examples/llama/llama [--threads 2] [--small]

Builds make_tiny_model.py's `gemma3-bench` model (random weights, float32:
gemma3_text, hidden 1024, 6 layers of which 5 slide with window 512 and 1
attends to everything, 8 query heads on 4 kv heads of 128) and serves N
requests of P random prompt tokens and G new tokens (default 32 x 4096,
128) twice, with the default pools (every request at once, no preemption):

  window   the sliding layers' pages leave a sequence as they fall out of
           its window (--sliding-pages window, the engine's default);
  all      they stay until the request ends (--sliding-pages all), as in a
           cache without windowed tables. Attention is windowed in both, so
           the tokens must be equal (the script stops otherwise).

Reported per run, from --stats: the peak pages of each pool, the peak KV
bytes (each pool's peak pages x its bytes per page, every layer, k and v),
prefill tokens/s (steps that prefilled; they also decode the requests
already running) and decode tokens/s (decode-only steps); and the ratio of
peak KV bytes window / all (the issue's goal: at most 0.3) and of decode
tokens/s (no lower). --small: 4 requests of 96 tokens on the tiny `gemma3`
preset (window 10): a check of the script, not a measurement.
"""
import argparse
import json
import os
import random

from llama_runs import cpu_name, serve, write_requests

import make_tiny_model  # noqa: E402 (llama_runs put it on the path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama", required=True, help="examples/llama's binary")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--preset", default=None, help="make_tiny_model.py's preset (gemma3-bench; --small: gemma3)")
    ap.add_argument("--work", default="/tmp/pagedkv-windows")
    ap.add_argument("--out", default=None, help="JSON results (default WORK/results.json)")
    ap.add_argument("--small", action="store_true", help="4 x 96 prompt tokens, 8 new, the tiny gemma3 preset")
    a = ap.parse_args()
    if a.small:
        a.requests, a.prompt, a.new = 4, 96, 8
    preset = a.preset or ("gemma3" if a.small else "gemma3-bench")
    os.makedirs(a.work, exist_ok=True)
    model_dir = os.path.join(a.work, "model-" + preset)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        make_tiny_model.save(make_tiny_model.build_model(preset, 0), preset, model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    rng = random.Random(1)
    vocab = make_tiny_model.PRESETS[preset]["vocab_size"]
    requests = os.path.join(a.work, f"requests-{a.requests}x{a.prompt}.jsonl")
    write_requests(requests, [[rng.randrange(vocab) for _ in range(a.prompt)] for _ in range(a.requests)], a.new)

    runs, outputs = {}, {}
    for mode in ("window", "all"):
        print(f"{mode}: serving {a.requests} x {a.prompt} prompt tokens, {a.new} new ...", flush=True)
        s, tokens = serve(a.llama, model_dir, requests, a.work, f"{preset}-{mode}", a.threads,
                          ["--sliding-pages", mode])
        runs[mode], outputs[mode] = s, tokens
        print(f"{mode}: {s['serve_seconds']:.1f} s, peak KV {s['peak_kv_bytes'] / 2**20:.1f} MiB", flush=True)
    if outputs["window"] != outputs["all"]:
        raise SystemExit("the tokens differ between --sliding-pages window and all")

    layer_types = config.get("layer_types") or []
    n_sliding = sum(t == "sliding_attention" for t in layer_types)
    rows = []
    for mode in ("window", "all"):
        s = runs[mode]
        rows.append({"mode": mode, "peak_pages_full": s["peak_pages_full"],
                     "peak_pages_sliding": s["peak_pages_sliding"], "peak_kv_bytes": s["peak_kv_bytes"],
                     "prefill_tokens_per_s": s["prefill_tokens"] / s["prefill_seconds"],
                     "decode_tokens_per_s": s["decode_tokens"] / s["decode_seconds"] if s["decode_seconds"] else 0.0,
                     "serve_seconds": s["serve_seconds"]})
    w, f = rows
    kv_ratio = w["peak_kv_bytes"] / f["peak_kv_bytes"]
    decode_ratio = w["decode_tokens_per_s"] / f["decode_tokens_per_s"] if f["decode_tokens_per_s"] else 0.0
    print(f"\n{preset}: {len(layer_types) - n_sliding} full + {n_sliding} sliding layers (window "
          f"{config.get('sliding_window')}), {a.requests} requests x {a.prompt} prompt tokens, {a.new} new, "
          f"{a.threads} threads, {cpu_name()}; tokens equal in both runs\n")
    print("| sliding layers' pages | peak pages full / sliding | peak KV | prefill tok/s | decode tok/s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['peak_pages_full']} / {r['peak_pages_sliding']} | "
              f"{r['peak_kv_bytes'] / 2**20:.0f} MiB | {r['prefill_tokens_per_s']:.0f} | "
              f"{r['decode_tokens_per_s']:.1f} |")
    print(f"\npeak KV window / all: {kv_ratio:.3f} (goal <= 0.3); decode tok/s window / all: {decode_ratio:.2f} "
          f"(goal >= 1)")
    out = a.out or os.path.join(a.work, "results.json")
    with open(out, "w") as fh:
        json.dump({"args": vars(a), "preset": preset, "cpu": cpu_name(), "rows": rows, "kv_ratio": kv_ratio,
                   "decode_ratio": decode_ratio}, fh, indent=1)


if __name__ == "__main__":
    main()
