"""How long `specchat models` takes with N pairs (issue 47, class 5): writes a models file of N pairs naming the
embedded model and times ``specchat models --models FILE --device cpu`` (and without --device) in a fresh process,
best of ``--repeat``. Figures go to benchmarks/RESULTS.md.

    python benchmarks/models_listing.py [--pairs 10 100 1000] [--repeat 3] [--timeout 300]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PAIR = "  - name: p{i}\n    description: pair {i}\n    target: {{source: packaged:smollm2-135m-instruct}}\n"


def listing_s(models: Path, device: list[str], timeout: float) -> float | None:
    start = time.perf_counter()
    try:
        subprocess.run(
            [sys.executable, "-m", "specchat.app.cli.main", "models", "--models", str(models), *device],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.pairs:
            models = Path(tmp) / f"pairs{n}.yaml"
            models.write_text("pairs:\n" + "".join(PAIR.format(i=i) for i in range(n)), encoding="utf-8")
            for device in (["--device", "cpu"], []):
                runs = [listing_s(models, device, args.timeout) for _ in range(args.repeat)]
                done = [r for r in runs if r is not None]
                best = f"{min(done):.2f} s" if done else f"over {args.timeout:g} s"
                print(f"{n:5d} pairs {' '.join(device) or '(no --device)':14s} best {best} of {runs}", flush=True)


if __name__ == "__main__":
    main()
