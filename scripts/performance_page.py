#!/usr/bin/env python3
"""Writes docs/performance.md (and, with matplotlib, docs/performance.svg)
from the benchmarks' own output:

  build/bin/tessel-bench --json > bench/results/tessel_bench.json
  .venv/bin/python bench/python_bench.py --json > bench/results/python_bench.json
  .venv/bin/python bench/checkpoint_bench.py --json > bench/results/checkpoint_bench.json
  .venv/bin/python scripts/performance_page.py [--check]

scripts/performance.sh runs them all. The page is this script's: edit the
script (or the benchmarks' descriptions), not the page. --check compares the
page's table with the results and fails if they differ (no plot needed):
tests/docs_performance_test runs it, so figures never drift from their
source.
"""

import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "performance.md"
PLOT = ROOT / "docs" / "performance.svg"

INTRO = """\
# Performance

<!-- Written by scripts/performance_page.py from bench/results/*.json: edit the script, not this page. -->

Every figure is Tessel beside its baseline, measured in the same run on the
same machine, and judged as a ratio against its goal (machines are noisy;
ratios taken in one run are what compare). Four programs measure them:

- `build/bin/tessel-bench` (C++; `--json`, `--only=SUBSTR`, `--list`):
  starts a local cluster of 2 workers and runs each entry of its table
  (`kEntries` in `bench/tessel_bench.cc`) beside a baseline that is not
  Tessel: bare gRPC calls and streams to a server process of the same
  shape, OpenBLAS and Gloo called directly, a plain copy loop.
- `build/bin/tessel-scale-bench` (C++; `--json`, `--only=SUBSTR`): the
  coordinator's own parts driving 64, 256 and 1,024 simulated workers
  that answer at once (`bench/coordinator_scale_bench.cc`), each row at
  1,024 beside the same at 64: growth, not a rival, is the baseline.
- `.venv/bin/python bench/python_bench.py` (`--json`, `--only=NAME`): the
  Python SDK beside grpcio and beside `jax.jit` on the same CPU.
- `.venv/bin/python bench/checkpoint_bench.py` (`--json`, `--only=NAME`):
  checkpoints saved and restored by the workers beside `dd` writing and
  reading the same bytes on the same filesystem, and a training loop's
  step time while it saves.

`scripts/performance.sh` runs them and writes this page from their output
(`bench/results/`). What each row measures, and how (rounds, alternation,
medians), is in the header of its benchmark's source; the commit that
changed a figure says why it moved.
"""

METHOD = """\
## Reading the figures

- A ratio is Tessel's figure over the baseline's, whichever way is better:
  the goal column says whether higher (≥) or lower (≤) is the better side.
- A row marked *missed* is below its goal on this run. Rows that depend on
  this machine's loopback (all_reduce, reshard, fetch and put) swing by up to
  2× from one minute to the next; their benchmarks alternate rounds of each
  side so a slow spell falls on both.
- The GPU figures (`tessel-gpu-bench`, `scripts/gpu-check.sh`) need an NVIDIA
  GPU and are not on this page.
"""


def python_descriptions(module="python_bench.py", prefix="py_"):
    """Each row's description, from the benchmark module's docstring."""
    text = (ROOT / "bench" / module).read_text()
    doc = text.split('"""')[1]
    out, names = {}, []
    for line in doc.splitlines():
        # "py_a  text", or "py_a, py_b  text" for rows that share it.
        m = re.match(rf"({prefix}\w+(?:,\s*{prefix}\w+)*)\s+(.*)", line)
        if m:
            names = re.split(r",\s*", m.group(1))
            for name in names:
                out[name] = m.group(2).strip()
        elif names and line.strip():
            for name in names:
                out[name] += " " + line.strip()
        else:
            names = []
    goal = r"\s*Goal\s*[<>]=\s*[0-9./]+\s*x?(\s*\([^)]*\))?\.?"
    return {k: re.sub(goal, "", v).strip() for k, v in out.items()}


def rows():
    """(source, name, unit, tessel, baseline, ratio, goal, met, what) for every result."""
    out = []
    for source, file in (("tessel-bench", "tessel_bench.json"), ("tessel-scale-bench", "scale_bench.json")):
        tb = RESULTS / file
        if not tb.exists():
            continue
        for name, r in json.loads(tb.read_text()).items():
            out.append(
                (
                    source,
                    name,
                    r["unit"],
                    r["value"],
                    r["baseline"],
                    r["ratio"],
                    r["goal"] if r["goal"] != "-" else "—",
                    r["met"],
                    r.get("note", ""),
                )
            )
    for source, prefix in (("python_bench", "py_"), ("checkpoint_bench", "ckpt_")):
        pb = RESULTS / f"{source}.json"
        if not pb.exists():
            continue
        what = python_descriptions(f"{source}.py", prefix)
        for r in json.loads(pb.read_text()):
            goal = r["goal"] if r["goal"] != "-" else "—"
            out.append(
                (
                    source,
                    r["name"],
                    r["unit"],
                    r["tessel"],
                    r["baseline"],
                    r["ratio"],
                    goal,
                    r["met"],
                    what.get(r["name"], ""),
                )
            )
    return out


def number(x):
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def goal_text(goal):
    m = re.match(r"\s*(>=|<=)\s*([0-9.]+)\s*(x|ms|us)?\s*$", goal)
    if not m:
        return goal
    sign = "≥" if m.group(1) == ">=" else "≤"
    unit = {"ms": " ms", "us": " µs"}.get(m.group(3), "×")
    return f"{sign} {float(m.group(2)):g}{unit}"


def table(results):
    lines = [
        "| benchmark | what | Tessel | baseline | unit | ratio | goal |",
        "|---|---|---|---|---|---|---|",
    ]
    for source, name, unit, ours, base, ratio, goal, met, what in results:
        verdict = "" if met is None else ("" if met else " (*missed*)")
        what = what.replace("|", "\\|")
        lines.append(
            f"| `{name}` | {what} | {number(ours)} | {number(base)} | {unit} | {ratio:.2f}× | {goal_text(goal)}{verdict} |"
        )
    return "\n".join(lines) + "\n"


def machine():
    meta = RESULTS / "machine.txt"
    return meta.read_text().strip() if meta.exists() else "(machine not recorded)"


def page(results):
    plot = "\n![Each ratio beside its goal](performance.svg)\n" if PLOT.exists() else ""
    return (
        INTRO
        + f"\n## The figures\n\nOne run of each program on {machine()}.\n{plot}\n"
        + table(results)
        + "\n"
        + METHOD
    )


def goal_parts(goal):
    """(higher_is_better, target ratio) of a goal, or None for a row without one."""
    m = re.match(r"\s*(>=|<=)\s*([0-9.]+)\s*(x|ms|us)?\s*$", str(goal))
    if not m:
        return None
    # An absolute goal ("<= 100 ms") is stated against a baseline of that figure.
    target = 1.0 if m.group(3) in ("ms", "us") else float(m.group(2))
    return m.group(1) == ">=", target


def draw(results):
    import matplotlib  # noqa: PLC0415 (only to draw: --check needs none)

    matplotlib.use("svg")
    matplotlib.rcParams["svg.hashsalt"] = "tessel"  # the same results draw the same file
    import matplotlib.pyplot as plt  # noqa: PLC0415

    judged = [(r[1], r[5], goal_parts(r[6])) for r in results if goal_parts(r[6])]
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(judged) + 1.2))
    for i, (_, ratio, (higher, target)) in enumerate(judged):
        # How far past its goal each row is, as a multiple of the goal (> 1 is met).
        score = ratio / target if higher else target / ratio
        ax.barh(i, score - 1, left=1, color="#4c9a2a" if score >= 1 else "#c0392b")
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(judged)), [name for name, _, _ in judged], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("ratio / goal, lower-is-better rows inverted: right of the line is met")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(PLOT, metadata={"Date": None})


def main():
    results = rows()
    if not results:
        sys.exit(f"no results in {RESULTS}: run scripts/performance.sh")
    if "--check" in sys.argv:
        written = PAGE.read_text()
        if table(results) not in written:
            sys.exit(
                f"{PAGE.relative_to(ROOT)} differs from {RESULTS.relative_to(ROOT)}: run scripts/performance_page.py"
            )
        print(f"{PAGE.relative_to(ROOT)}: {len(results)} rows, as in the results")
        return
    draw(results)
    PAGE.write_text(page(results))
    print(f"wrote {PAGE.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}: {len(results)} rows")


if __name__ == "__main__":
    main()
