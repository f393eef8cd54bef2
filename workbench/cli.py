"""The `stepwise` command.

    stepwise serve|keys|admin|backup|restore|export ...   the backend (kernel_backend.__main__)
    stepwise demo [--sft-steps N]    the quickstart headless: SFT then RL, progress, metrics, cost
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """The console script: its return value is the process's exit status (0: done)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("serve", "keys", "admin", "backup", "restore", "export"):
        from kernel_backend.__main__ import main as backend_main

        backend_main(argv)
        return 0
    if argv and argv[0] == "demo":
        from workbench.recipes.demo import main as demo_main

        demo_main(argv[1:])  # it prints its summary; Python callers get the summaries from demo.main
        return 0
    print("usage: stepwise serve|keys|admin|backup|restore|export|demo ... (see `stepwise serve --help`, `stepwise demo --help`)",
          file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
