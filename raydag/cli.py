"""The ``raydag`` command: ``raydag report RUN_DIR [RUN_DIR ...] -o report.html``."""

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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    from raydag.observe.record import RunRecord
    from raydag.observe.report import write_report

    try:
        records = [RunRecord.load(d) for d in args.run_dirs]
    except (FileNotFoundError, NotADirectoryError) as e:
        parser.error(str(e))
    path = write_report(records, args.output, title=args.title)
    sys.stdout.write(f"wrote {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
