"""Chooses which test cases leave the quick tier, from a measured run, and writes
tests/slow_cases.txt (which tests/conftest.py reads: each listed case is marked `slow`).

    ./scripts/test.sh --durations=0 > durations.log    # the quick tier, every case timed
    python scripts/tier_tests.py durations.log          # rewrites tests/slow_cases.txt

The rule, per test function (its parametrized cases together):
- a case slower than --case-limit seconds goes to the slow tier;
- of the rest, the cheapest --cases-per-function stay quick, the others go slow (a grid's
  cases are the same code at other shapes: a few keep the quick tier honest, the slow tier
  runs all of them);
- a function whose every case is over the limit keeps its cheapest case quick if that case
  is under --function-limit seconds, so most functions keep one quick case.
Cases marked `slow` in the code, or listed by an earlier run, are not in a quick tier's log:
their lines are kept. A case the log does not time (a new test) stays quick until the next
run of this script; the budget check in scripts/test.sh (JAX_EPILOG_QUICK_BUDGET_S) says when
that is due.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(\S+::.+?)\s*$")
HEADER = """\
# Test cases run in the slow tier (JAX_EPILOG_TESTS=slow or all), not the quick one.
# Written by scripts/tier_tests.py from a timed run of the quick tier; rerun it rather than
# editing by hand. A line is a pytest node id, or a test function's id (all its cases).
# Node ids are written as pytest's durations report prints them (non-ASCII escaped).
"""


def durations(log: str) -> dict[str, float]:
    """Seconds per node id (setup, call and teardown together) from a --durations=0 log."""
    seconds: dict[str, float] = collections.Counter()
    for line in log.splitlines():
        match = LINE.match(line.strip())
        if match:
            seconds[match.group(3)] += float(match.group(1))
    return dict(seconds)


def slow_cases(seconds: dict[str, float], *, case_limit: float, cases_per_function: int,
               function_limit: float) -> list[str]:
    by_function: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
    for node, took in seconds.items():
        by_function[node.split("[", 1)[0]].append((took, node))
    slow = []
    for function, cases in sorted(by_function.items()):
        cases.sort()
        quick = [node for took, node in cases if took <= case_limit][:cases_per_function]
        if not quick and cases[0][0] <= function_limit:
            quick = [cases[0][1]]
        if not quick:
            slow.append(function)
        else:
            slow.extend(sorted(node for _, node in cases if node not in quick))
    return slow


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="the output of a --durations=0 run")
    parser.add_argument("--case-limit", type=float, default=3.0)
    parser.add_argument("--cases-per-function", type=int, default=4)
    parser.add_argument("--function-limit", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "slow_cases.txt")
    args = parser.parse_args(argv)
    seconds = durations(args.log.read_text())
    if not seconds:
        parser.error(f"{args.log} has no durations: run the tests with --durations=0")
    slow = slow_cases(seconds, case_limit=args.case_limit,
                      cases_per_function=args.cases_per_function,
                      function_limit=args.function_limit)
    # The lines of an earlier run for cases this log did not time (they ran in the slow tier).
    timed = set(seconds) | {node.split("[", 1)[0] for node in seconds}
    earlier = [line for line in args.out.read_text().splitlines()
               if line and not line.startswith("#")] if args.out.exists() else []
    slow = sorted(set(slow) | {line for line in earlier if line not in timed})
    functions = {line for line in slow if "[" not in line}
    moved = sum(took for node, took in seconds.items()
                if node in slow or node.split("[", 1)[0] in functions)
    args.out.write_text(HEADER + "".join(line + "\n" for line in slow))
    total = sum(seconds.values())
    print(f"{len(slow)} lines ({len(functions)} whole functions) in {args.out}: "
          f"{moved:.0f} s of the log's {total:.0f} s leave the quick tier, {total - moved:.0f} s stay")


if __name__ == "__main__":
    main()
