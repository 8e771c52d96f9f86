"""Cancel tiny Ray tasks as they finish, round after round: Ray 2.60's cancel race.

A driver whose own ``ray.cancel`` meets a task's reply aborts (``Check failed: ...
Tried to complete task that was not pending``). ``--via ray`` shows it: here it aborted
in 5 of 5 runs, in rounds 3 to 64. ``--via raydag`` cancels the way raydag does
(``raydag.runtime.cancel``). Joins the Ray of ``RAY_ADDRESS``, or starts one.

    python tests/cancel_race.py --via ray --rounds 150
"""

from __future__ import annotations

import argparse
import random
import time

import ray

from raydag import runtime


@ray.remote
def tiny() -> None:
    time.sleep(random.random() * 0.004)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--via", choices=["ray", "raydag"], required=True)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    cancelled = finished = 0
    for n in range(args.rounds):
        refs = [tiny.remote() for _ in range(60)]
        time.sleep(random.random() * 0.05)  # some queued, some running, some ending
        if args.via == "ray":
            for ref in refs:
                ray.cancel(ref, force=args.force)
        else:
            runtime.cancel(refs, force=args.force)
        for ref in refs:
            try:
                ray.get(ref, timeout=60)
                finished += 1
            except ray.exceptions.TaskCancelledError:
                cancelled += 1
        print(f"round {n + 1}", flush=True)
    print(f"survived {args.rounds} rounds: {cancelled} cancelled, {finished} finished", flush=True)


if __name__ == "__main__":
    main()
