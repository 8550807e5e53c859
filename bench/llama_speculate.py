#!/usr/bin/env python3
"""examples/llama with --speculate K against without: decode tokens/s.

    PYTHONPATH=/opt/pagedkv-transformers:/opt/pagedkv-torch2 \\
      python3 bench/llama_speculate.py --llama build/examples/llama/llama [--speculate 4] [--threads 2]

Builds the random ~100M Llama of bench/llama_vs_transformers.py
(make_tiny_model.py --preset bench, float32) and serves two workloads of N
requests, P prompt tokens and G new tokens each (default 8 x 256, 64):

  repeating   each prompt is one random 32-token phrase repeated: prompt
              lookup drafts its next 32 tokens from the prompt; a random
              model's greedy continuation of such a prompt mostly repeats
              it too, so drafts are often accepted (this stands in for
              requests that quote their prompt: code edits, summaries that
              copy spans, which a random model cannot be asked to do)
  random      uniform random prompts: drafts come only from the model's own
              output, and are rarely accepted

Each is served with max_new_tokens 1 and G, with and without --speculate K;
decode tokens/s = N x (G - 1) / (t(G) - t(1)) from --stats' serve_seconds
(model loading excluded). The tokens with and without --speculate must be
equal (the script stops otherwise). Prints a markdown table with the
acceptance rate (spec_accepted_tokens / spec_proposed_tokens) of each
workload, and writes it to --out (JSON).
"""
import argparse
import json
import os
import random
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "llama"))
import make_tiny_model  # noqa: E402


def workloads(n, length, vocab, seed):
    rng = random.Random(seed)
    repeating = []
    for _ in range(n):
        phrase = [rng.randrange(vocab) for _ in range(32)]
        repeating.append((phrase * (length // 32 + 1))[:length])
    random_prompts = [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]
    return {"repeating": repeating, "random": random_prompts}


def serve(llama, model_dir, work, name, prompts, new_tokens, threads, extra):
    req = os.path.join(work, name + ".jsonl")
    with open(req, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": f"r{i}", "prompt": p, "max_new_tokens": new_tokens}) + "\n")
    stats, out = os.path.join(work, name + ".stats.json"), os.path.join(work, name + ".out.jsonl")
    cmd = [llama, "--model", model_dir, "--requests", req, "--out", out, "--stats", stats, "--threads", str(threads),
           "--quiet"] + extra
    p = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr}")
    with open(stats) as f:
        s = json.load(f)
    with open(out) as f:
        tokens = {r["id"]: r["tokens"] for r in map(json.loads, f)}
    print(f"{name}: {s['serve_seconds']:.2f} s", flush=True)
    return s, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama", required=True)
    ap.add_argument("--speculate", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--preset", default="bench", help="make_tiny_model.py's preset (gqa: a quick check)")
    ap.add_argument("--work", default="/tmp/pagedkv-speculate")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    model_dir = os.path.join(a.work, "model-" + a.preset)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        make_tiny_model.save(make_tiny_model.build_model(a.preset, 0), a.preset, model_dir)
    vocab = make_tiny_model.PRESETS[a.preset]["vocab_size"]
    rows = []
    for name, prompts in workloads(a.requests, a.prompt, vocab, 1).items():
        times, outputs = {}, {}
        for spec in (0, a.speculate):
            extra = ["--speculate", str(spec)] if spec else []
            for new in (1, a.new):
                s, tokens = serve(a.llama, model_dir, a.work, f"{name}-k{spec}-g{new}", prompts, new, a.threads, extra)
                times[(spec, new)] = s
                outputs[(spec, new)] = tokens
        if outputs[(0, a.new)] != outputs[(a.speculate, a.new)]:
            raise SystemExit(f"{name}: --speculate {a.speculate} changed the tokens")
        decode = {spec: a.requests * (a.new - 1) / (times[(spec, a.new)]["serve_seconds"] -
                                                    times[(spec, 1)]["serve_seconds"])
                  for spec in (0, a.speculate)}
        s = times[(a.speculate, a.new)]
        accepted = s["spec_accepted_tokens"] / max(1, s["spec_proposed_tokens"])
        rows.append({"workload": name, "decode_tokens_per_s": decode[0],
                     "decode_tokens_per_s_speculate": decode[a.speculate], "speedup": decode[a.speculate] / decode[0],
                     "proposed": s["spec_proposed_tokens"], "accepted": s["spec_accepted_tokens"],
                     "acceptance": accepted})
    print(f"\n{a.requests} requests x {a.prompt} prompt tokens, {a.new} new, preset {a.preset}, "
          f"{a.threads} threads, --speculate {a.speculate}\n")
    print("| workload | decode tok/s | with --speculate | speedup | drafts accepted |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['decode_tokens_per_s']:.1f} | {r['decode_tokens_per_s_speculate']:.1f} | "
              f"{r['speedup']:.2f}x | {r['accepted']} of {r['proposed']} ({100 * r['acceptance']:.0f}%) |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
