"""`lmpipe run` once per strategy on the same corpus: tokens/s, padding efficiency, loss.

    python -m bench.strategies                   # WikiText-2 valid.txt, the default job's settings

Each run is the real thing (2 producer processes + the trainer, 300 steps of the tiny model) and its
end-of-run summary is what the table shows. Writes bench/results/strategies-<date>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench.common import WIKITEXT, free_port_pair, table, write_result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(WIKITEXT / "valid.txt"))
    p.add_argument("--out", default=None)
    p.add_argument("extra", nargs="*", help="more `lmpipe run` flags (after --)")
    args = p.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPIPE_")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in ("pack", "bucket", "pad-batch", "pad"):
            summary = os.path.join(tmp, f"{strategy}.json")
            cmd = [sys.executable, "-m", "lmpipe", "run", "--data", args.data, "--strategy", strategy,
                   "--metrics-port", "-1", "--port", str(free_port_pair()), "--summary-json", summary, *args.extra]  # fmt: skip
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(summary) as f:
                s = json.load(f)
            rows.append([strategy, s["tokens_per_second"], 100 * s["padding_efficiency"], s["first_loss"], s["last_loss"],
                         100 * s["data_wait_fraction"]])  # fmt: skip
            print(
                f"{strategy}: {s['tokens_per_second']:,.0f} tok/s, padding efficiency {100 * s['padding_efficiency']:.1f}%",
                flush=True,
            )
    body = (
        f"`lmpipe run --data {os.path.basename(args.data)} --strategy S {' '.join(args.extra)}`: 2 producers, the tiny "
        "model, 300 steps of 16 rows x 128 tokens (the defaults). tokens/s counts real tokens only.\n\n"
        + table(
            ["strategy", "tokens/s", "padding efficiency %", "loss first", "loss last", "data wait %"], rows
        )
    )
    print(body)
    write_result("strategies", "lmpipe run, one strategy at a time", body, args.out)


if __name__ == "__main__":
    main()
