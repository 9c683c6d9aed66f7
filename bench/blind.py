"""Measure the audit on a blind batch of real silent-bug reports (tests/_blind_batch<N>.py).

    python bench/blind.py --batch 1 [--json bench/results/blind_batch1.json] [--verbose]

Prints, per case, whether the bug is proven without the audit, which catalog ids only the bug side raised at
WARN or above (caught), and the WARN/FAIL findings of the fixed twin (false alarms); then the totals.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests._blind import load, outcome  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--json", default="")
    parser.add_argument("--verbose", action="store_true", help="print every WARN/FAIL message")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    results = [outcome(case) for case in load(args.batch)]
    for r in results:
        mark = "caught" if r.caught else "MISSED"
        twin = f"twin {len(r.twin_loud)} WARN/FAIL" if r.twin_loud else "twin quiet"
        proof = "proven" if r.proven else "NOT PROVEN"
        print(f"{r.key:42s} {proof:10s} {mark:6s} {','.join(r.caught_by) or '-':28s} {twin}"
              + (f"  error: {r.error}" if r.error else ""))
        if args.verbose:
            for line in r.bug_loud:
                print(f"    bug : {line}")
            for line in r.twin_loud:
                print(f"    twin: {line}")
    caught = sum(r.caught for r in results)
    noisy = sum(bool(r.twin_loud) for r in results)
    proven = sum(r.proven for r in results)
    print(f"\nbatch {args.batch}: {caught} of {len(results)} caught at WARN or above; "
          f"{noisy} of {len(results)} twins with a WARN or FAIL; {proven} of {len(results)} proven")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"batch": args.batch, "caught": caught, "cases": len(results), "noisy_twins": noisy,
                       "results": [dataclasses.asdict(r) for r in results]}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
