#!/usr/bin/env python3
"""examples/llama with --speculate K against without: decode tokens/s.

    PYTHONPATH=/opt/pagedkv-transformers:/opt/pagedkv-torch2 \\
      python3 bench/llama_speculate.py --llama build/examples/llama/llama [--speculate 4] [--threads 2]

Builds the random ~100M Llama of bench/llama_vs_transformers.py
(make_tiny_model.py --preset bench, float32) and serves N requests of P
random prompt tokens and G new tokens each (default 8 x 256, 64), on two
models of that shape and cost:

  copying     the model with every layer's o_proj and down_proj zeroed: the
              layers still compute everything (the same FLOPs and weight
              bytes) but add nothing to the residual, so the next token is
              the one whose embedding best matches the current one, itself:
              the output repeats its last token, prompt lookup drafts that
              repetition, and every draft is accepted. This stands in for
              requests that quote their prompt (code edits, summaries that
              copy spans), which a random model cannot be asked to do: it
              measures what verification gains when drafts hit.
  random      the random model itself: its greedy output neither copies nor
              soon repeats, so prompt lookup rarely finds a draft: what
              --speculate costs when drafts miss.

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

from llama_runs import serve as run_engine, write_requests

import make_tiny_model  # noqa: E402 (llama_runs put it on the path)


def prompts(n, length, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def make_models(preset, work):
    """{"copying": dir, "random": dir}: the preset's random model, and the same with every layer's output
    projections zeroed."""
    dirs = {name: os.path.join(work, f"model-{preset}-{name}") for name in ("copying", "random")}
    if all(os.path.exists(os.path.join(d, "config.json")) for d in dirs.values()):
        return dirs
    import torch

    make_tiny_model.save(make_tiny_model.build_model(preset, 0), preset, dirs["random"])
    model = make_tiny_model.build_model(preset, 0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    make_tiny_model.save(model, preset, dirs["copying"])
    return dirs


def serve(llama, model_dir, work, name, prompts, new_tokens, threads, extra):
    req = os.path.join(work, name + ".jsonl")
    write_requests(req, prompts, new_tokens)
    s, tokens = run_engine(llama, model_dir, req, work, name, threads, extra)
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
    ap.add_argument("--workloads", default="copying,random", help="which of copying,random to serve")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    models = make_models(a.preset, a.work)
    requests = prompts(a.requests, a.prompt, make_tiny_model.PRESETS[a.preset]["vocab_size"], 1)
    rows = []
    for name, model_dir in models.items():
        if name not in a.workloads.split(","):
            continue
        times, outputs = {}, {}
        for spec in (0, a.speculate):
            extra = ["--speculate", str(spec)] if spec else []
            for new in (1, a.new):
                s, tokens = serve(a.llama, model_dir, a.work, f"{name}-k{spec}-g{new}", requests, new, a.threads,
                                  extra)
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
