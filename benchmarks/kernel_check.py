"""Run the kernel correctness tests on a GPU and print a pass/fail table.

Runs ``tests/test_kernels.py -m gpu`` (agreement with ``mx.quantized_matmul`` over M = 1..16,
shapes, bits, group sizes and dtypes; row exactness; a patched model) under pytest without
tests/conftest.py (which imports the engine), then prints one line per test and writes the
results as JSON to --out. Exit status 0 only if every selected test passed and none was
skipped (a skip here means no GPU backend was found).

    python benchmarks/kernel_check.py [--out kernel_check.json] [-k EXPR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


class _Collector:
    def __init__(self):
        self.rows: list[dict] = []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            msg = ""
            if report.outcome == "failed":
                msg = str(report.longrepr).strip().splitlines()[-1][:160]
            elif report.outcome == "skipped":
                msg = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else "")[:160]
            self.rows.append({"test": report.nodeid.split("::", 1)[-1], "outcome": report.outcome,
                              "seconds": round(report.duration, 2), "message": msg})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("-k", dest="expr", default=None, help="pytest -k expression")
    args = ap.parse_args(argv)
    import mlx.core as mx

    from metal_kernels import backend

    print(f"mlx {mx.__version__}, backend {backend()}, device {mx.default_device()}", flush=True)
    collector = _Collector()
    pargs = [str(ROOT / "tests" / "test_kernels.py"), "-m", "gpu", "--noconftest", "-q",
             "-p", "no:cacheprovider", "--rootdir", str(ROOT), "-ra"]
    if args.expr:
        pargs += ["-k", args.expr]
    t0 = time.perf_counter()
    code = pytest.main(pargs, plugins=[collector])
    wall = time.perf_counter() - t0
    rows = collector.rows
    width = max([len(r["test"]) for r in rows] + [10])
    print(f"\n{'test':<{width}}  result   seconds  note")
    for r in rows:
        print(f"{r['test']:<{width}}  {r['outcome'].upper():<7} {r['seconds']:8.2f}  {r['message']}")
    counts = {o: sum(r["outcome"] == o for r in rows) for o in ("passed", "failed", "skipped")}
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
          f"in {wall:.1f} s (pytest exit {int(code)})")
    if args.out:
        Path(args.out).write_text(json.dumps({"backend": backend(), "mlx": mx.__version__,
                                              "counts": counts, "wall_s": wall, "tests": rows},
                                             indent=1))
    ok = int(code) == 0 and counts["failed"] == 0 and counts["skipped"] == 0 and counts["passed"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
