"""``python -m zfunc.ops``: build every known op and say which ones fell back, and why.

Options: ``--json`` prints the rows as JSON; ``--verbose`` shows the compiler
output; ``--strict`` exits 1 if an op failed to build for any reason other
than being disabled or needing a GPU this machine lacks.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import warnings

# op module -> the function that builds (or loads) what it needs
OPS = {
    "zfunc.ops.cpu_adam": "load",
    "zfunc.ops.cuda_adam": "load",
    "zfunc.ops.aio": "backend_status",
    "zfunc.ops.large_blocks": "load",
}


def build_all() -> tuple[list[dict], dict[str, dict[str, str]]]:
    """Ask every op module to build; returns builder rows and per-module extras."""
    from . import builder

    extras: dict[str, dict[str, str]] = {}
    for modname, fn in OPS.items():
        try:
            mod = importlib.import_module(modname)
        except ImportError as e:
            extras[modname] = {"import": f"not importable: {e}"}
            continue
        result = getattr(mod, fn)()
        if isinstance(result, dict):  # e.g. aio's per back-end status
            extras[modname] = {str(k): str(v) for k, v in result.items()}
    return builder.report(), extras


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(rows[0]), line(["-" * w for w in widths])] + [line(r) for r in rows[1:]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zfunc.ops", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON rows")
    ap.add_argument("--verbose", action="store_true", help="show compiler output")
    ap.add_argument("--strict", action="store_true",
                    help="exit 1 if an op that should build here did not")
    args = ap.parse_args(argv)
    if args.verbose:
        os.environ["ZFUNC_OPS_VERBOSE"] = "1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the table says it all, once
        rows, extras = build_all()
    if args.json:
        print(json.dumps({"ops": rows, "extras": extras}, indent=2))
    else:
        table = [["op", "status", "why"]]
        for r in rows:
            table.append([r["name"], "built" if r["built"] else "fallback", r["reason"]])
        print(_table(table))
        for mod, info in extras.items():
            print(f"\n{mod}:")
            print(_table([["part", "status"]] + [[k, v] for k, v in info.items()]))
        flags = next((r["flags"] for r in rows if not r.get("cuda")), "")
        if flags:
            print(f"\nC++ flags: {flags}")
    expected = ("built", "disabled", "CUDA not available", "this torch build has no CUDA")
    failed = [r for r in rows if not r["reason"].startswith(expected)]
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
