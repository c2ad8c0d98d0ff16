"""The Python benchmarks' output: their rows as JSON (--json, what
scripts/performance_page.py reads) or as a table. A row is (name, unit,
Tessel's figure, the baseline's, goal, met: True, False or None for no goal)."""

import json
import sys


def report(rows):
    if "--json" in sys.argv:
        print(
            json.dumps(
                [
                    {"name": n, "unit": u, "tessel": o, "baseline": b, "ratio": o / b, "goal": g, "met": m}
                    for n, u, o, b, g, m in rows
                ],
                indent=1,
            )
        )
        return
    width = max([len(r[0]) for r in rows] + [16])
    print(f"{'benchmark':<{width}} {'tessel':>12} {'baseline':>12} {'unit':<8} {'ratio':>7}  goal")
    for n, u, o, b, g, m in rows:
        verdict = "" if m is None else "met" if m else "MISSED"
        print(f"{n:<{width}} {o:>12,.2f} {b:>12,.2f} {u:<8} {o / b:>6.2f}x  {g} {verdict}")
