"""Shared command line of the docs generators: write a generated page, or check it is current."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def main(path: Path, render: Callable[[], str], description: str) -> int:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--check", action="store_true", help=f"only check that {path.name} is current"
    )
    args = parser.parse_args()
    text = render()
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"docs/{path.name} is out of date: run `python {sys.argv[0]}`", file=sys.stderr)
            return 1
        print(f"docs/{path.name} is up to date")
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0
