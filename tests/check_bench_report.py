#!/usr/bin/env python3
"""bench/report's limit columns on a synthetic Google Benchmark JSON (a
ctest, `bench_report`): x read is pagedkv over the read-only pass, x limit
pagedkv over the slower of the read-only and FMA-only passes, and cases or
tables without those variants get dashes or no such columns. Runs the
report the way `make bench` does, with --from-json and --no-docs. Exits 1
naming the first mismatch."""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def bench(name, ms):
    """One median entry, as pagedkv_bench writes them with repetitions."""
    return {"name": f"{name}/real_time_median", "run_name": f"{name}/real_time", "run_type": "aggregate",
            "aggregate_name": "median", "real_time": ms * 1000.0, "time_unit": "us", "bytes": 1 << 20,
            "threads": 1}


def report(benchmarks):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"context": {}, "benchmarks": benchmarks}, f)
    try:
        out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "report"), "--from-json", f.name,
                              "--no-docs"], check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return [line for line in out.splitlines() if line.startswith("|")]


def row(lines, case):
    """The cells of `case`'s row, by the header's column names."""
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == f"`{case}`":
            return dict(zip(head, cells))
    raise AssertionError(f"no row for {case} in:\n" + "\n".join(lines))


def expect(what, got, want):
    if got != want:
        print(f"check_bench_report: {what}: expected {want!r}, got {got!r}", file=sys.stderr)
        sys.exit(1)


def main():
    lines = report([
        # FMA-bound: the FMA pass (8 ms) is the slower limit.
        bench("attention_decode/A/memcpy", 20), bench("attention_decode/A/read", 4),
        bench("attention_decode/A/fma", 8), bench("attention_decode/A/pagedkv", 10),
        # Read-bound: the read pass (9 ms) is.
        bench("attention_decode/B/memcpy", 20), bench("attention_decode/B/read", 9),
        bench("attention_decode/B/fma", 8), bench("attention_decode/B/pagedkv", 12),
        # No FMA pass (bf16 scored by dot products): no limit ratio.
        bench("attention_decode/C/memcpy", 20), bench("attention_decode/C/read", 5),
        bench("attention_decode/C/pagedkv", 10),
        # Neither pass (a write).
        bench("write_decode/D/memcpy", 1), bench("write_decode/D/pagedkv", 2),
    ])
    a, b, c, d = (row(lines, f"{k}") for k in ("attention_decode/A", "attention_decode/B", "attention_decode/C",
                                                "write_decode/D"))
    expect("A: x read", a["× read"], "2.50×")
    expect("A: FMA-only pass", a["FMA-only pass"], "8 ms")
    expect("A: x limit (the FMA pass)", a["× limit"], "1.25×")
    expect("B: x limit (the read pass)", b["× limit"], "1.33×")
    expect("C: FMA-only pass", c["FMA-only pass"], "—")
    expect("C: x limit", c["× limit"], "—")
    expect("D: x read", d["× read"], "—")
    expect("D: x limit", d["× limit"], "—")
    expect("D: x memcpy", d["× memcpy"], "2.00×")

    # Without any read or FMA variant the columns are left out.
    lines = report([bench("write_decode/D/memcpy", 1), bench("write_decode/D/pagedkv", 2)])
    expect("header without limits", "FMA-only pass" in lines[0] or "× limit" in lines[0] or "× read" in lines[0],
           False)
    print("check_bench_report: ok")


if __name__ == "__main__":
    main()
