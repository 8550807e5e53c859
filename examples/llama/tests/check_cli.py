#!/usr/bin/env python3
"""The llama example's command line on good and bad input (standard library
only: the checkpoint is written here with struct and json).

    check_cli.py --llama BUILD/examples/llama/llama --work DIR

Bad input (flags, a missing or truncated file, a malformed request line, a
token outside the vocabulary, a prompt the pool can never hold, a config that
disagrees with the weights, a model family the example does not run, a
prefix cache asked for over sliding-window layers) must give exit code 2 and a message naming the
file, line and field; never a crash or a signal. A good run must exit 0 and
write one output line per request.
"""
import argparse
import json
import os
import random
import shutil
import struct
import subprocess
import sys

CONFIG = {"model_type": "llama", "vocab_size": 50, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
          "rope_theta": 10000.0, "eos_token_id": None}


def tensors(config, rng):
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                       p + "self_attn.q_proj.weight": [h, h], p + "self_attn.k_proj.weight": [kv, h],
                       p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, h],
                       p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h],
                       p + "mlp.down_proj.weight": [h, i]})
    out = {}
    for name, shape in shapes.items():
        n = 1
        for s in shape:
            n *= s
        out[name] = (shape, [rng.gauss(0, 0.3) for _ in range(n)])
    return out


def write_safetensors(path, named):
    header, data = {}, b""
    for name, (shape, values) in sorted(named.items()):
        raw = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def write_model(d, config, rng):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    write_safetensors(os.path.join(d, "model.safetensors"), tensors(config, rng))


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_tiers(a, m, run, bad, requests, failures):
    """Prefix tiers: tokens never change; a pool too small to keep every
    prefix hits host memory; a second process hits what the first left on
    the disk or on a Redis server (started here when redis-server exists)."""
    import time
    stem = [3, 9, 27, 31, 12, 5, 44, 8, 19, 23, 2, 40]
    lines = [json.dumps({"id": f"r{i}", "prompt": stem + [10 + i, 20 + i, 30 + i], "max_new_tokens": 3})
             for i in range(6)]
    # Between the two that share stem + a tail, others push the first's pages out of a 6-page pool.
    other = [json.dumps({"id": f"o{i}", "prompt": [45 - j for j in range(14)] + [i], "max_new_tokens": 2})
             for i in range(3)]
    reqs = requests("tiers.jsonl", "\n".join([lines[0]] + other + lines[1:]) + "\n")
    base = m + ["--requests", reqs, "--threads", "1", "--page-size", "4", "--max-seqs", "1", "--quiet"]

    def tokens_and_stats(extra, what):
        stats = os.path.join(a.work, "tiers-stats.json")
        rc, out, err = run(base + ["--stats", stats] + extra)
        if rc != 0:
            failures.append(f"{what}: exit {rc}: {err}")
            return None, {}
        with open(stats) as f:
            return {r["id"]: r["tokens"] for r in map(json.loads, out.splitlines())}, json.load(f)

    def check(what, got, stats, key, want_hits):
        ok = got == reference and stats.get(key, 0) >= want_hits and \
            stats["prefix_hit_tokens"] == sum(stats[f"prefix_hit_tokens_{t}"] for t in
                                              ("device", "host", "disk", "remote"))
        print(f"{'ok  ' if ok else 'FAIL'} {what}: {key} {stats.get(key)}, tokens {'equal' if got == reference else 'DIFFER'}")
        if not ok:
            failures.append(f"{what}: {key} = {stats.get(key)} (want >= {want_hits}), tokens {got} vs {reference}")

    reference, _ = tokens_and_stats(["--prefix-cache", "off"], "tiers reference")
    got, stats = tokens_and_stats(["--n-pages", "6", "--prefix-host-mb", "1"], "host tier")
    check("host tier, pool too small for every prefix", got, stats, "prefix_hit_tokens_host", 4)
    disk = os.path.join(a.work, "tiers-disk")
    shutil.rmtree(disk, ignore_errors=True)
    got, stats = tokens_and_stats(["--prefix-host-mb", "1", "--prefix-disk", disk], "disk tier, first run")
    check("disk tier, first run", got, stats, "prefix_hit_tokens_disk", 0)
    got, stats = tokens_and_stats(["--prefix-disk", disk, "--prefix-disk-mb", "4"], "disk tier, second run")
    check("disk tier, a second process", got, stats, "prefix_hit_tokens_disk", 12)
    bad("--prefix-disk-mb 0", base + ["--prefix-disk", disk, "--prefix-disk-mb", "0"], ["--prefix-disk-mb"])
    bad("--prefix-disk on a file", base + ["--prefix-disk", reqs], ["--prefix-disk", "expected a directory"])
    bad("--prefix-redis without a port", base + ["--prefix-redis", "localhost"], ["--prefix-redis"])
    bad("tiers without a prefix cache", base + ["--prefix-host-mb", "1", "--prefix-cache", "off"],
        ["need --prefix-cache on"])
    server = shutil.which("redis-server")
    rc, _, err = run(base + ["--prefix-redis", "127.0.0.1:1"])
    if rc == 2 and "built without hiredis" in err:
        print("skip Redis tier: llama was built without hiredis")
        return
    if server is None:
        print("skip Redis tier: no redis-server")
        return
    port = free_port()
    redis_dir = os.path.join(a.work, "tiers-redis")
    os.makedirs(redis_dir, exist_ok=True)
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--dir", redis_dir, "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        address = f"127.0.0.1:{port}"
        got, stats = tokens_and_stats(["--prefix-redis", address], "Redis tier, first engine")
        check("Redis tier, first engine", got, stats, "prefix_hit_tokens_remote", 0)
        got, stats = tokens_and_stats(["--prefix-redis", address], "Redis tier, second engine")
        check("Redis tier, a second engine", got, stats, "prefix_hit_tokens_remote", 12)
    finally:
        proc.kill()
        proc.wait()
    # The server gone: misses with a warning, the same tokens.
    got, stats = tokens_and_stats(["--prefix-redis", address], "Redis tier, server gone")
    check("Redis tier, server gone", got, stats, "prefix_hit_tokens_remote", 0)


def check_speculate(a, m, run, bad, requests, failures):
    """--speculate K gives exactly the tokens of a run without it (greedy),
    drafting from prompts that repeat themselves (a random model's greedy
    loops repeat too), with several requests batched, prefix caching,
    preemption by recompute and by swap, both layouts, page sizes 1 and 3;
    --stats counts the drafts, and some are accepted."""
    rng = random.Random(7)
    lines = []
    for i in range(6):
        phrase = [rng.randrange(1, 50) for _ in range(5)]
        prompt = phrase * 3 + [rng.randrange(1, 50) for _ in range(i)]
        lines.append(json.dumps({"id": "s%d" % i, "prompt": prompt, "max_new_tokens": 10 + 5 * i}))
    reqs = requests("speculate.jsonl", "\n".join(lines) + "\n")
    bad("negative --speculate", m + ["--requests", reqs, "--speculate", "-1"], ["--speculate expected an integer >= 0", "'-1'"])
    base = m + ["--requests", reqs, "--threads", "1", "--quiet"]
    cases = [[], ["--layout", "hnd", "--page-size", "1"], ["--page-size", "3", "--n-pages", "40", "--max-batch-tokens", "16"],
             ["--page-size", "3", "--n-pages", "40", "--preempt", "recompute", "--prefix-cache", "off"]]
    for extra in cases:
        rc, plain_out, err = run(base + extra)
        plain = {r["id"]: r["tokens"] for r in map(json.loads, plain_out.splitlines())} if rc == 0 else None
        for k in ("1", "4"):
            stats_path = os.path.join(a.work, "speculate-stats.json")
            rc2, out, err2 = run(base + extra + ["--speculate", k, "--stats", stats_path])
            got = {r["id"]: r["tokens"] for r in map(json.loads, out.splitlines())} if rc2 == 0 else None
            stats = json.load(open(stats_path)) if rc2 == 0 else {}
            ok = rc == 0 and rc2 == 0 and got == plain and len(got) == 6 and \
                stats.get("spec_proposed_tokens", 0) > 0 and 0 < stats.get("spec_accepted_tokens", 0) <= \
                stats["spec_proposed_tokens"]
            print(f"{'ok  ' if ok else 'FAIL'} --speculate {k} {' '.join(extra)}: exit {rc2}, "
                  f"{stats.get('spec_accepted_tokens')} of {stats.get('spec_proposed_tokens')} drafts accepted")
            if not ok:
                failures.append(f"--speculate {k} {extra}: exit {rc}/{rc2}, tokens {got} against {plain}, "
                                f"stats {stats}, stderr {err2}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama", required=True)
    ap.add_argument("--work", required=True)
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    rng = random.Random(0)
    model = os.path.join(a.work, "model")
    write_model(model, CONFIG, rng)
    good = os.path.join(a.work, "good.jsonl")
    with open(good, "w") as f:
        f.write('{"id": "a", "prompt": [1, 2, 3], "max_new_tokens": 4}\n\n{"id": "b", "prompt": [7]}\n')
    failures = []

    def run(args):
        p = subprocess.run([a.llama] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return p.returncode, p.stdout, p.stderr

    def bad(what, args, fragments, code=2):
        rc, out, err = run(args)
        ok = rc == code and all(f in err for f in fragments)
        print(f"{'ok  ' if ok else 'FAIL'} {what}: exit {rc}: {err.strip().splitlines()[-1] if err.strip() else ''}")
        if not ok:
            failures.append(f"{what}: exit {rc} (want {code}), stderr lacks one of {fragments}:\n{err}")

    def requests(name, text):
        path = os.path.join(a.work, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    m = ["--model", model]
    bad("no flags", [], ["--model DIR is required"])
    bad("unknown flag", m + ["--requests", good, "--frobnicate", "1"], ["unknown flag --frobnicate"])
    bad("flag without value", m + ["--requests"], ["--requests needs a value"])
    bad("page size 0", m + ["--requests", good, "--page-size", "0"], ["--page-size expected an integer >= 1", "'0'"])
    bad("bad layout", m + ["--requests", good, "--layout", "nhw"], ["--layout expected nhd or hnd"])
    bad("bad kv format", m + ["--requests", good, "--kv-format", "fp4"], ["--kv-format expected native, fp8 or int8"])
    bad("missing model", ["--model", os.path.join(a.work, "nowhere"), "--requests", good], ["config.json: cannot open"])
    bad("missing requests", m + ["--requests", os.path.join(a.work, "none.jsonl")], ["none.jsonl: cannot open"])
    path = requests("malformed.jsonl", '{"id": "a", "prompt": [1]}\n{"id": "b", "prompt": [1,\n')
    bad("malformed line", m + ["--requests", path], ["malformed.jsonl:2:", "not valid JSON"])
    path = requests("vocab.jsonl", '{"id": "a", "prompt": [1, 50]}\n')
    bad("token outside the vocabulary", m + ["--requests", path], ["vocab.jsonl:1:", "'prompt[1]'", "[0, 50)"])
    path = requests("field.jsonl", '{"id": "a", "prompt": [1], "max_new_tokens": "8"}\n')
    bad("mistyped field", m + ["--requests", path], ["field.jsonl:1:", "'max_new_tokens'"])
    bad("prompt the pool can never hold", m + ["--requests", good, "--n-pages", "1", "--page-size", "4"],
        ["good.jsonl:1:", "more than the pool can ever hold"])

    truncated = os.path.join(a.work, "truncated")
    shutil.copytree(model, truncated)
    st = os.path.join(truncated, "model.safetensors")
    os.truncate(st, os.path.getsize(st) - 64)
    bad("truncated safetensors", ["--model", truncated, "--requests", good], ["model.safetensors", "truncated?"])
    os.truncate(st, 5)
    bad("safetensors shorter than its header length", ["--model", truncated, "--requests", good],
        ["model.safetensors", "shorter than the 8-byte header length"])
    corrupt = os.path.join(a.work, "corrupt")
    shutil.copytree(model, corrupt)
    with open(os.path.join(corrupt, "model.safetensors"), "r+b") as f:
        f.seek(8)
        f.write(b"[")
    bad("corrupt safetensors header", ["--model", corrupt, "--requests", good], ["model.safetensors", "not valid JSON"])
    disagree = os.path.join(a.work, "disagree")
    shutil.copytree(model, disagree)
    with open(os.path.join(disagree, "config.json"), "w") as f:
        json.dump(dict(CONFIG, num_key_value_heads=4), f)
    bad("config disagreeing with the weights", ["--model", disagree, "--requests", good],
        ["model.layers.0.self_attn.k_proj.weight", "num_key_value_heads 4"])
    with open(os.path.join(disagree, "config.json"), "w") as f:
        json.dump(dict(CONFIG, rope_scaling={"rope_type": "yarn", "factor": 2.0}), f)
    bad("unsupported rope type", ["--model", disagree, "--requests", good], ["config.json", "'rope_scaling.rope_type' is 'yarn'"])
    with open(os.path.join(disagree, "config.json"), "w") as f:
        json.dump(dict(CONFIG, model_type="phi3"), f)
    bad("unknown family", ["--model", disagree, "--requests", good],
        ["config.json", "'model_type' is 'phi3'", "gemma3_text"])
    check_sliding(a, model, good, run, bad, failures)
    bad("unwritable --out", m + ["--requests", good, "--out", os.path.join(a.work, "no", "such", "dir.jsonl")],
        ["cannot open for writing (--out)"])

    rc, out, err = run(["--help"])
    if rc != 0 or "--max-batch-tokens" not in out:
        failures.append(f"--help: exit {rc}, output lacks the flags")
    for extra in ([], ["--layout", "hnd", "--page-size", "3", "--prefix-cache", "off"], ["--kv-format", "int8"]):
        rc, out, err = run(m + ["--requests", good, "--max-new-tokens", "5", "--threads", "1"] + extra)
        lines = [json.loads(line) for line in out.splitlines()]
        got = {r["id"]: r["tokens"] for r in lines}
        ok = rc == 0 and set(got) == {"a", "b"} and len(got["a"]) == 4 and len(got["b"]) == 5 and \
            all(0 <= t < 50 for ts in got.values() for t in ts) and "2/2 requests done" in err and "prefix cache" in err
        print(f"{'ok  ' if ok else 'FAIL'} good run {' '.join(extra)}: exit {rc}, {got}")
        if not ok:
            failures.append(f"good run {extra}: exit {rc}, stdout {out!r}, stderr {err}")
    # float16 computes where the libtorch can (torch 2.x); Debian's 1.13 cannot on the CPU: a clear refusal
    rc, out, err = run(m + ["--requests", good, "--dtype", "float16", "--threads", "1"])
    ok = (rc == 0 and len(out.splitlines()) == 2) or (rc == 2 and "--dtype float16: this libtorch cannot compute" in err)
    print(f"{'ok  ' if ok else 'FAIL'} --dtype float16: exit {rc}")
    if not ok:
        failures.append(f"--dtype float16: exit {rc}, stderr {err}")
    check_tiers(a, m, run, bad, requests, failures)
    check_speculate(a, m, run, bad, requests, failures)
    empty = requests("empty.jsonl", "\n")
    rc, out, err = run(m + ["--requests", empty])
    if rc != 0 or out:
        failures.append(f"empty request file: exit {rc}, stdout {out!r}")
    if failures:
        print(f"\n{len(failures)} FAILURES:\n" + "\n".join(failures))
        return 1
    print("OK")
    return 0


def check_sliding(a, model, good, run, bad, failures):
    """The same weights as a Mistral (Llama's layers and a sliding window on
    each): a second pool, the prefix cache off (refused when named), the
    sliding pool's flag and stats."""
    mistral = os.path.join(a.work, "mistral")
    shutil.copytree(model, mistral)
    with open(os.path.join(mistral, "config.json"), "w") as f:
        json.dump(dict(CONFIG, model_type="mistral", sliding_window=3), f)
    m = ["--model", mistral, "--requests", good]
    stats = os.path.join(a.work, "mistral-stats.json")
    rc, out, err = run(m + ["--max-new-tokens", "5", "--threads", "1", "--page-size", "2", "--stats", stats])
    st = json.load(open(stats)) if rc == 0 else {}
    ok = rc == 0 and len(out.splitlines()) == 2 and "prefix cache off" in err and "sliding-window layers" in err and \
        st.get("sliding_window") == 3 and st.get("peak_pages_sliding", 0) > 0 and st.get("peak_pages_full") == 0 and \
        st.get("prefix_cache") is False
    print(f"{'ok  ' if ok else 'FAIL'} mistral (sliding window 3): exit {rc}, stats {st.get('peak_pages_sliding')} "
          f"sliding pages at peak")
    if not ok:
        failures.append(f"mistral run: exit {rc}, stdout {out!r}, stderr {err}, stats {st}")
    bad("prefix cache over sliding layers", m + ["--prefix-cache", "on"],
        ["--prefix-cache on", "config.json", "sliding-window layers (window 3)"])
    bad("prefix tier over sliding layers", m + ["--prefix-host-mb", "1"], ["need --prefix-cache on", "sliding-window"])
    bad("a sliding pool too small", m + ["--n-pages-sliding", "1", "--page-size", "2"],
        ["'prompt'", "sliding window of 3 tokens", "--n-pages-sliding"])
    # --sliding-pages all: the sliding pages stay to the end (a: 14 tokens written, b: 5), the same tokens;
    # peak_kv_bytes = peak pages x bytes per page (2 layers, k and v, 2 tokens of 2 heads x 4 float32s).
    long = os.path.join(a.work, "long.jsonl")
    with open(long, "w") as f:
        f.write('{"id": "a", "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9], "max_new_tokens": 6}\n{"id": "b", "prompt": [7]}\n')
    runs = {}
    for mode in ("window", "all"):
        path = os.path.join(a.work, f"mistral-{mode}.json")
        rc, out, err = run(["--model", mistral, "--requests", long, "--max-new-tokens", "5", "--threads", "1",
                            "--page-size", "2", "--stats", path, "--sliding-pages", mode])
        runs[mode] = (rc, out, json.load(open(path)) if rc == 0 else {})
    (rc_w, out_w, st_w), (rc_a, out_a, st_a) = runs["window"], runs["all"]
    page_bytes = 2 * 2 * 2 * 2 * 4 * 4
    ok = rc_w == 0 and rc_a == 0 and sorted(out_w.splitlines()) == sorted(out_a.splitlines()) and \
        st_w.get("sliding_pages") == "window" and st_a.get("sliding_pages") == "all" and \
        st_a.get("peak_pages_sliding") == 7 + 3 and st_w.get("peak_pages_sliding", 99) < 7 + 3 and \
        st_w.get("peak_kv_bytes") == st_w.get("peak_pages_sliding", 0) * page_bytes and \
        st_a.get("peak_kv_bytes") == st_a.get("peak_pages_sliding", 0) * page_bytes
    print(f"{'ok  ' if ok else 'FAIL'} --sliding-pages window / all: peak sliding pages "
          f"{st_w.get('peak_pages_sliding')} / {st_a.get('peak_pages_sliding')}, the same tokens")
    if not ok:
        failures.append(f"--sliding-pages: window {runs['window']}, all {runs['all']}")
    for preempt in ("swap", "recompute"):  # a pool of 8 for 7 + 3 pages: one request waits, swapped or recomputed
        path = os.path.join(a.work, f"mistral-all-{preempt}.json")
        rc, out, err = run(["--model", mistral, "--requests", long, "--max-new-tokens", "5", "--threads", "1",
                            "--page-size", "2", "--stats", path, "--sliding-pages", "all", "--n-pages-sliding", "8",
                            "--preempt", preempt])
        st = json.load(open(path)) if rc == 0 else {}
        ok = rc == 0 and sorted(out.splitlines()) == sorted(out_w.splitlines()) and st.get("peak_pages_sliding") <= 8 \
            and st.get("preempted_swap", 0) + st.get("preempted_recompute", 0) > 0
        print(f"{'ok  ' if ok else 'FAIL'} --sliding-pages all, pool of 8, --preempt {preempt}: exit {rc}, "
              f"preempted {st.get('preempted_swap')} / {st.get('preempted_recompute')}, the same tokens")
        if not ok:
            failures.append(f"--sliding-pages all --preempt {preempt}: exit {rc}, stdout {out!r}, stderr {err}, {st}")
    bad("bad --sliding-pages", m + ["--sliding-pages", "some"], ["--sliding-pages expected window or all", "'some'"])


if __name__ == "__main__":
    sys.exit(main())
