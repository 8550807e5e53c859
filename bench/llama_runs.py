"""What the examples/llama benchmark scripts share: one engine run on a
request file, and the CPU's name for their tables."""
import json
import os
import platform
import subprocess
import sys

# make_tiny_model.py builds the scripts' random models.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "llama"))


def cpu_name():
    """/proc/cpuinfo's model name, family and model (the tables name the CPU they ran on)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:  # a cloud guest's name alone may not say which core
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


def write_requests(path, prompts, max_new_tokens):
    """A request file of `prompts` (ids r0, r1, ...), each with max_new_tokens."""
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": f"r{i}", "prompt": p, "max_new_tokens": max_new_tokens}) + "\n")


def serve(llama, model_dir, requests_file, work, name, threads, extra=(), quiet=True, echo=False):
    """Runs the engine on `requests_file`; returns (its --stats, {id: tokens}).
    Exits the script with the engine's stderr when it fails; echo: prints
    that stderr (the engine's summary) when it succeeds."""
    stats, out = os.path.join(work, name + ".stats.json"), os.path.join(work, name + ".out.jsonl")
    cmd = [llama, "--model", model_dir, "--requests", requests_file, "--out", out, "--stats", stats,
           "--threads", str(threads)] + (["--quiet"] if quiet else []) + list(extra)
    p = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr}")
    if echo:
        print(p.stderr.strip(), flush=True)
    with open(stats) as f:
        s = json.load(f)
    with open(out) as f:
        tokens = {r["id"]: r["tokens"] for r in map(json.loads, f)}
    return s, tokens
