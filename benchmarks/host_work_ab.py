"""Two versions of the runtime, one against the other, on ``benchmarks/host_work.py``.

Run: python benchmarks/host_work_ab.py BEFORE [--after REV] [--rounds 4] [--steps 15]
        [host_work.py options, e.g. --budget 1.0]

On this project's 2-core CPU machines one ``host_work.py`` process differs from the next
by 1 to 3 ms of predicted forward Python on the same code (``docs/results-host``,
third and twelfth passes): more than most single changes are worth, so one run before
and one after decide nothing. This checks out ``BEFORE`` (and ``--after``, default the
work tree as it is) into temporary git worktrees, runs ``host_work.py --cheap-ops`` in a
fresh process for each in turn, ``--rounds`` times, and prints every run and each
side's median, least and most: the predicted forward host time and its Python part.
The worktrees are removed at the end. Nothing is written elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def checkout(rev: str, into: Path) -> Path:
    """``rev`` as a detached git worktree under ``into``."""
    path = into / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(path),
                    rev], check=True)
    return path


def one_run(tree: Path, steps: int, extra: list[str], out: Path) -> dict[str, float]:
    """``host_work.py --cheap-ops`` of ``tree``'s runtime, in a process of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tree / "src"), str(tree / "benchmarks")])}
    subprocess.run([sys.executable, str(tree / "benchmarks" / "host_work.py"), "--cheap-ops",
                    "--steps", str(steps), "--json", str(out), *extra],
                   check=True, env=env, stdout=subprocess.DEVNULL, cwd=tree / "benchmarks")
    predicted = json.loads(out.read_text())["predicted"]
    return {"forward": predicted["forward_added_ms"], "python": predicted["forward_python_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="a git revision")
    parser.add_argument("--after", help="a git revision (default: the work tree)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15)
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        made: list[Path] = []
        try:
            made.append(checkout(args.before, base))
            trees = {"before": made[0], "after": ROOT}
            if args.after:
                made.append(checkout(args.after, base))
                trees["after"] = made[1]
            runs: dict[str, list[dict[str, float]]] = {side: [] for side in trees}
            for k in range(args.rounds):
                for side, tree in trees.items():
                    run = one_run(tree, args.steps, extra, base / f"{side}-{k}.json")
                    runs[side].append(run)
                    print(f"round {k + 1} {side:6}: forward {run['forward']:.1f} ms "
                          f"({run['python']:.1f} Python)", flush=True)
        finally:
            for path in made:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(path)], check=False)
    for side, values in runs.items():
        forward = [r["forward"] for r in values]
        python = [r["python"] for r in values]
        print(f"{side:6}: forward median {statistics.median(forward):.1f} ms "
              f"(least {min(forward):.1f}, most {max(forward):.1f}); Python median "
              f"{statistics.median(python):.1f} ms")


if __name__ == "__main__":
    main()
