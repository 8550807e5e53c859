#!/usr/bin/env python3
"""examples/llama on a multi-turn chat: the device pool alone against host + disk prefix tiers.

    PYTHONPATH=/opt/pagedkv-transformers:/opt/pagedkv-torch2 \\
      python3 bench/llama_multiturn.py --llama build/examples/llama/llama [--threads 2] [--small]

C conversations x T turns (default 32 x 8). Turn 1 of a conversation is a
user message of U random tokens (default 128); each later turn re-sends the
conversation so far: the previous turn's prompt, the engine's answer to it
(A tokens, default 32, greedy) and a new user message of U random tokens.
The model is a random Llama of make_tiny_model.py's preset (default
`bench`: the ~100M shape; building it needs torch and transformers, hence
the PYTHONPATH above); the user messages are seeded, so both setups get the
same conversations (their answers are checked equal: the tiers load pages
bit for bit, so greedy answers cannot differ).

The engine serves one request file per process, so a turn is a process:
every conversation's turn-t prompt is a request of one file, and the turns
run one after another. Each turn runs twice:

  first-token run   max_new_tokens 1: the turn's C prompts are prefilled and
                    each gets its first token. Its --stats give the turn's
                    numbers: prefill_tokens (prompt tokens computed, i.e. not
                    found in any tier), the hits per tier, and serve_seconds:
                    the time to first token of the turn's batch, from the
                    first step to the last request's first token. The engine
                    has no per-request timings, so this is a batch figure: the
                    time until every conversation of the turn has its first
                    token (model loading excluded).
  answer run        max_new_tokens A: the answers the next turn re-sends.

in two setups, each from scratch:

  device            the pool alone (--n-pages, default a quarter of what all
                    conversations' final turns need: too small to keep them
                    all). Nothing outlives a process, so every turn
                    recomputes its whole prompt: a long-running server would
                    keep the conversations its pool holds between turns, so
                    this baseline is the worst case of a pool too small for
                    the working set, not a measure of any pool size.
  tiers             the same pool with --prefix-host-mb (default 256) and
                    --prefix-disk DIR (--prefix-disk-mb, default 4096), one
                    directory for all the runs of the setup: each process
                    persists its pages at exit (host memory's go down to the
                    directory) and the next turn loads its prefix from there.
                    Host memory catches what the pool evicts within a
                    process; across turns the hits come from the directory.

Prints a table per turn (prompt tokens, tokens computed, hits per tier, time
to first token) and the issue's ratios: recomputed tokens device / tiers,
median time to first token from the third turn on, device / tiers, and turn
1 (all misses) tiers / device. Writes everything to --out (JSON). --small
runs 4 conversations x 3 turns of 24-token messages and 8-token answers on
the tiny `gqa` preset (unless --preset is given): a check of the script,
not a measurement.
"""
import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "llama"))
import make_tiny_model  # noqa: E402


def run_engine(a, model_dir, work, name, prompts, new_tokens, extra):
    """One process serving one request file; returns (stats, {id: output tokens}, wall seconds of the process)."""
    req = os.path.join(work, name + ".jsonl")
    with open(req, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": f"c{i}", "prompt": p, "max_new_tokens": new_tokens}) + "\n")
    stats = os.path.join(work, name + ".stats.json")
    out = os.path.join(work, name + ".out.jsonl")
    cmd = [a.llama, "--model", model_dir, "--requests", req, "--out", out, "--stats", stats, "--threads",
           str(a.threads), "--n-pages", str(a.n_pages), "--quiet"] + extra
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr}")
    with open(stats) as f:
        s = json.load(f)
    outputs = {}
    with open(out) as f:
        for line in f:
            o = json.loads(line)
            outputs[o["id"]] = o["tokens"]
    assert len(outputs) == len(prompts), (len(outputs), len(prompts))
    return s, outputs, wall


def run_setup(a, model_dir, setup, vocab):
    work = os.path.join(a.work, setup)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    extra = []
    if setup == "tiers":
        extra = ["--prefix-host-mb", str(a.host_mb), "--prefix-disk", os.path.join(work, "tier"),
                 "--prefix-disk-mb", str(a.disk_mb)]
    rng = random.Random(a.seed)  # the same user messages in both setups
    convs = [[rng.randrange(vocab) for _ in range(a.user)] for _ in range(a.conversations)]
    turns = []
    for t in range(1, a.turns + 1):
        first, _, first_wall = run_engine(a, model_dir, work, f"turn{t}-first", convs, 1, extra)
        answer, outputs, _ = run_engine(a, model_dir, work, f"turn{t}-answer", convs, a.answer, extra)
        answers = [outputs[f"c{i}"] for i in range(a.conversations)]
        row = {
            "turn": t,
            "prompt_tokens": first["prompt_tokens"],
            "computed_tokens": first["prefill_tokens"],
            "hit_tokens": first["prefix_hit_tokens"],
            "hit_tokens_device": first["prefix_hit_tokens_device"],
            "hit_tokens_host": first["prefix_hit_tokens_host"],
            "hit_tokens_disk": first["prefix_hit_tokens_disk"],
            "ttft_seconds": first["serve_seconds"],
            "ttft_cpu_seconds": first["serve_cpu_seconds"],
            "first_process_seconds": first_wall,
            "answer_serve_seconds": answer["serve_seconds"],
            "answer_computed_tokens": answer["prefill_tokens"],
            "answers": answers,
        }
        turns.append(row)
        print(f"{setup} turn {t}: {row['prompt_tokens']} prompt tokens, {row['computed_tokens']} computed, hits "
              f"device {row['hit_tokens_device']} host {row['hit_tokens_host']} disk {row['hit_tokens_disk']}; "
              f"time to first token {row['ttft_seconds']:.3f} s ({row['ttft_cpu_seconds']:.2f} CPU s)", flush=True)
        convs = [c + ans + [rng.randrange(vocab) for _ in range(a.user)] for c, ans in zip(convs, answers)]
    return turns


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama", required=True, help="examples/llama's binary")
    ap.add_argument("--preset", default=None, help="make_tiny_model.py's preset (bench; --small: gqa)")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user", type=int, default=128, help="tokens of each user message")
    ap.add_argument("--answer", type=int, default=32, help="max_new_tokens of each answer")
    ap.add_argument("--n-pages", type=int, default=None,
                    help="the device pool (default: a quarter of what the final turns need, at least 2 prompts')")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--host-mb", type=int, default=256)
    ap.add_argument("--disk-mb", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", default="/tmp/pagedkv-multiturn")
    ap.add_argument("--out", default=None, help="JSON results (default WORK/results.json)")
    ap.add_argument("--small", action="store_true",
                    help="4 conversations x 3 turns, 24-token messages, 8-token answers: a check of the script")
    a = ap.parse_args()
    if a.small:
        a.conversations, a.turns, a.user, a.answer = 4, 3, 24, 8
    if a.preset is None:
        a.preset = "gqa" if a.small else "bench"
    final = a.turns * (a.user + a.answer)  # the longest prompt and its answer, about
    pages_per_conv = (final + a.page_size - 1) // a.page_size + 1
    if a.n_pages is None:
        a.n_pages = max(2 * pages_per_conv, a.conversations * pages_per_conv // 4)
    os.makedirs(a.work, exist_ok=True)

    model_dir = os.path.join(a.work, "model-" + a.preset)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        make_tiny_model.make(model_dir, a.preset, seed=0, reference=False)
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    print(f"{a.conversations} conversations x {a.turns} turns, {a.user}-token messages, {a.answer}-token answers; "
          f"preset {a.preset}; pool {a.n_pages} pages of {a.page_size} (all final turns: "
          f"{a.conversations * pages_per_conv}); {a.threads} threads; {cpu}; load average {os.getloadavg()}",
          flush=True)
    results = {"args": vars(a), "cpu": cpu, "load_average_start": os.getloadavg(), "setups": {}}
    for setup in ("device", "tiers"):
        results["setups"][setup] = run_setup(a, model_dir, setup, vocab)
    results["load_average_end"] = os.getloadavg()

    dev, tie = results["setups"]["device"], results["setups"]["tiers"]
    for d, t in zip(dev, tie):
        if d["answers"] != t["answers"]:
            raise SystemExit(f"turn {d['turn']}: the answers differ with tiers")
    print("\n| turn | prompt tokens | computed: device | computed: tiers | tiers' hits: host / disk | "
          "time to first token: device | tiers |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for d, t in zip(dev, tie):
        print(f"| {d['turn']} | {d['prompt_tokens']} | {d['computed_tokens']} | {t['computed_tokens']} | "
              f"{t['hit_tokens_host']} / {t['hit_tokens_disk']} | {d['ttft_seconds']:.3f} s | "
              f"{t['ttft_seconds']:.3f} s |")
    summary = {}
    later = slice(2, None)  # from the third turn on
    dev_computed = sum(r["computed_tokens"] for r in dev[later])
    tie_computed = sum(r["computed_tokens"] for r in tie[later])
    if dev[later]:
        summary["computed_ratio_from_turn3"] = dev_computed / max(1, tie_computed)
        summary["median_ttft_device_from_turn3"] = statistics.median(r["ttft_seconds"] for r in dev[later])
        summary["median_ttft_tiers_from_turn3"] = statistics.median(r["ttft_seconds"] for r in tie[later])
        summary["ttft_ratio_from_turn3"] = (summary["median_ttft_device_from_turn3"] /
                                            summary["median_ttft_tiers_from_turn3"])
    summary["computed_ratio_all"] = (sum(r["computed_tokens"] for r in dev) /
                                     max(1, sum(r["computed_tokens"] for r in tie)))
    summary["turn1_ttft_tiers_over_device"] = tie[0]["ttft_seconds"] / dev[0]["ttft_seconds"]
    results["summary"] = summary
    print()
    if "computed_ratio_from_turn3" in summary:
        print(f"from turn 3 on: {summary['computed_ratio_from_turn3']:.2f}x fewer tokens computed with tiers "
              f"({dev_computed} against {tie_computed}); median time to first token "
              f"{summary['median_ttft_device_from_turn3']:.3f} s against {summary['median_ttft_tiers_from_turn3']:.3f} s "
              f"({summary['ttft_ratio_from_turn3']:.2f}x)")
    print(f"turn 1 (every prompt a miss): time to first token with tiers / without: "
          f"{summary['turn1_ttft_tiers_over_device']:.3f}")
    out = a.out or os.path.join(a.work, "results.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
