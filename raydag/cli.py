"""The ``raydag`` command: ``raydag report RUN_DIR [RUN_DIR ...] -o report.html``;
``raydag checkpoints list|clean [URL]`` (``python -m raydag ...`` too)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raydag", description="raydag's command line")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser(
        "report",
        help="write the HTML report of run records",
        description="Write one self-contained HTML report of one or more run records "
        "(directories written with raydag.record.directory set). Several records are "
        "shown on one clock.",
    )
    rep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run record's directory")
    rep.add_argument("-o", "--output", default="report.html", help="the HTML file to write")
    rep.add_argument("--title", default=None, help="the report's title")
    ck = sub.add_parser(
        "checkpoints",
        help="list or clean a checkpoint store",
        description="List the checkpoints in a store, or remove them. URL: any fsspec "
        "URL; default: raydag.checkpoint.store, else the default store under the user's "
        "cache directory.",
    )
    ck.add_argument("action", choices=["list", "clean"])
    ck.add_argument("url", nargs="?", default=None, metavar="URL", help="the store")
    ck.add_argument(
        "--older-than",
        default=None,
        metavar="AGE",
        help="clean: only checkpoints older than this (e.g. 2d, 12h); partial and "
        "temporary files and other raydag versions' checkpoints go whatever their age",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.command == "checkpoints":
        return _checkpoints(args)

    from raydag.observe.record import RunRecord
    from raydag.observe.report import write_report

    try:
        records = [RunRecord.load(d) for d in args.run_dirs]
    except (FileNotFoundError, NotADirectoryError) as e:
        parser.error(str(e))
    path = write_report(records, args.output, title=args.title)
    sys.stdout.write(f"wrote {path}\n")
    return 0


def _checkpoints(args: argparse.Namespace) -> int:
    import time

    from dask.utils import format_bytes, parse_timedelta

    from raydag import config
    from raydag.runtime.checkpoints import CheckpointError, CheckpointStore, default_store

    store = CheckpointStore(args.url or config.get("checkpoint.store") or default_store())
    files = store.listing()
    now = time.time()
    rows, doomed = [], []
    max_age = parse_timedelta(args.older_than, default="s") if args.older_than else None
    for name, parts in sorted(files.items()):
        size = sum(parts.values())
        try:
            m = store.manifest(name)
        except CheckpointError as e:  # partial, foreign, another raydag version
            rows.append((name, "-", size, str(e)))
            doomed.append(name)
            continue
        age = now - float(m.get("created", now))
        rows.append((name, m.get("key", "?"), size, f"{age / 3600:.1f} h old"))
        if max_age is None or age > max_age:
            doomed.append(name)
    if args.action == "list":
        for name, key, size, note in rows:
            sys.stdout.write(f"{name}  {format_bytes(size):>10}  {key}  ({note})\n")
        total = sum(r[2] for r in rows)
        sys.stdout.write(f"{len(rows)} checkpoints, {format_bytes(total)} in {store.url}\n")
        return 0
    removed = store.remove(doomed)
    sys.stdout.write(f"removed {len(doomed)} checkpoints ({removed} files) from {store.url}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
