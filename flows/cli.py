"""`trajforge` command line: each subcommand parses its arguments and runs a flow."""
from __future__ import annotations

import argparse
import os
import sys

from sources import REGISTRY, SourceError


def _source_arg(value: str) -> tuple[str, str | None]:
    name, sep, location = value.partition("=")
    if name not in REGISTRY:
        raise argparse.ArgumentTypeError(f"unknown source {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return name, (location or None) if sep else None


def _add_build(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="build the dataset from upstream sources (a Prefect flow)")
    p.add_argument("--source", action="append", type=_source_arg, default=[], metavar="NAME[=PATH_OR_REPO]",
                   help="a source to read, from a local folder/file or a Hub repo id (repeatable); "
                        "default: the three upstream datasets from the Hub")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--rendering", choices=["native", "react"], default="native",
                   help="assistant turn text: upstream wording (native) or Think/Act (react)")
    p.set_defaults(func=_run_build)


def _run_build(args: argparse.Namespace) -> int:
    from flows.build import build_dataset
    from pipeline.build import summary_lines

    sources: dict[str, str | None] = {}
    for name, location in args.source:
        if name in sources:
            raise SourceError(f"source {name} given twice")
        if location is not None and not os.path.exists(location) and location.count("/") != 1:
            raise SourceError(f"source {name}: path {location} does not exist")
        sources[name] = location
    report = build_dataset(sources=sources or None, out=args.out, rendering=args.rendering)
    print("\n".join(summary_lines(report)))
    print(f"dataset: {args.out}/data  quarantine: {args.out}/quarantine  report: {args.out}/report.json")
    return 0


# Each entry adds one subcommand; other capabilities register theirs here.
COMMANDS = [_add_build]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trajforge", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except SourceError as exc:
        print(f"trajforge: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
