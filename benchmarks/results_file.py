"""Where a benchmark writes its results: a file of this run unless asked to update the tracked one.

By default `benchmarks/results/runs/<name>-<time>.json` (git-ignored), so trying a benchmark never
rewrites the figures the README quotes; `--update-results` writes `benchmarks/results/<name>.json`
(commit it with the README change), `--out PATH` anywhere.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def add_out_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--out", help=f"results file (default: {RESULTS.name}/runs/{name}-<time>.json)")
    parser.add_argument(
        "--update-results",
        action="store_true",
        help=f"write the tracked {RESULTS.name}/{name}.json that the README quotes",
    )


def results_file(args: argparse.Namespace, name: str) -> Path:
    if args.out:
        return Path(args.out)
    if args.update_results:
        return RESULTS / f"{name}.json"
    return RESULTS / "runs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
