"""`alchemist audit generated/<model>.py [--gguf model.gguf] [-o audits]`: print the table, write the reports.

alchemist/cli.py calls `register(subparsers)`; the subcommand exits 1 when a check fails (2 on bad input,
through the main CLI's AlchemistError handling).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from alchemist.errors import AlchemistError


def _cmd_audit(args) -> int:
    from alchemist.audit import audit_module, write_reports

    module = Path(args.module)
    if not module.is_file():
        raise AlchemistError(f"{module}: no such generated module")
    gguf_path = args.gguf
    if gguf_path is not None:
        from alchemist.models import resolve_model

        gguf_path = resolve_model(gguf_path)  # a path, or a reference model name such as gemma-3-270m
        if not Path(gguf_path).is_file():
            raise AlchemistError(f"{args.gguf}: no such GGUF file")
    report = audit_module(module, gguf_path=gguf_path)
    print(report.table())
    if not args.no_write:
        paths = write_reports(report, args.output)
        print("audit reports: " + ", ".join(str(p) for p in paths))
    if not report.passed:
        print(f"audit FAILED: {', '.join(report.failed)}", file=sys.stderr)
        return 1
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `audit` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "audit",
        help="check a generated module's contracts (its source, then its symbolic graph once it is safe to import)",
        description="Check a generated module against its contracts: provenance, syntax, format, safety and config "
        "from its source; dequantization, orientation, heads and coverage from its loader run on a synthetic file "
        "and its forward graph built (never compiled nor run). With --gguf also against the file and its IR.",
    )
    p.add_argument("module", help="the generated module, e.g. generated/<model>.py")
    p.add_argument(
        "--gguf",
        help="the GGUF file it was generated from, or a reference model name (enables the file/IR comparisons)",
    )
    p.add_argument("-o", "--output", default="audits", help="where the .json/.md reports go (default: audits/)")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    p.set_defaults(fn=_cmd_audit)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alchemist")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except AlchemistError as e:
        print(f"alchemist: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
