"""The `stepwise` command: `stepwise serve` runs the backend (more commands to come: lab, demo)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("serve", "keys", "export"):
        from kernel_backend.__main__ import main as backend_main

        backend_main(argv)
        return
    print("usage: stepwise serve|keys|export ... (see `stepwise serve --help`)", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
