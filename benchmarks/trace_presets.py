"""Time and memory to trace each reference workload analytically (target: < 30 s, < 4 GB).

Run: python benchmarks/trace_presets.py [--hardware a100-80gb] [PRESET ...]
Each preset is traced in a fresh process so its peak memory is its own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, resource, sys, time
start = time.perf_counter()
import slackswap
from slackswap.models import build_model
imported = time.perf_counter()
model, batch = build_model(sys.argv[1])
built = time.perf_counter()
p = slackswap.profile(model, batch, sys.argv[2], name=sys.argv[1])
done = time.perf_counter()
s = p.summary()
print(json.dumps({
    "import_s": imported - start, "build_s": built - imported, "trace_s": done - built,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "ops": s["num_ops"], "saved": s["num_saved_tensors"],
    "saved_gib": s["saved_bytes_total"] / 2**30,
    "step_ms": (s["forward_time_s"] + s["backward_time_s"]) * 1e3,
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("presets", nargs="*", default=["bert-large", "gpt2-xl", "llama-7b"])
    parser.add_argument("--hardware", default="a100-80gb")
    args = parser.parse_args()
    print(f"{'preset':12s} {'build s':>8s} {'trace s':>8s} {'peak MB':>8s} {'ops':>6s} "
          f"{'saved':>6s} {'saved GiB':>9s} {'step ms':>8s}")
    for name in args.presets:
        out = subprocess.run([sys.executable, "-c", CHILD, name, args.hardware],
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"{name:12s} {r['build_s']:8.2f} {r['trace_s']:8.2f} {r['peak_rss_mb']:8.0f} "
              f"{r['ops']:6d} {r['saved']:6d} {r['saved_gib']:9.2f} {r['step_ms']:8.1f}")


if __name__ == "__main__":
    main()
