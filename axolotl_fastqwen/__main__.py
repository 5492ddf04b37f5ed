"""`python -m axolotl_fastqwen doctor|report ...` (console script: `axolotl-fastqwen`). The benchmark
is not part of the installed package: `python -m fastqwen_bench` in a checkout of the repository."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "doctor": ("axolotl_fastqwen.diagnostics.doctor", "versions, kernel choices and known-bad combinations"),
    "report": ("axolotl_fastqwen.integration.report_command", "print a finished Axolotl run's plugin report"),
}


def usage(prog: str = "axolotl-fastqwen", commands: dict = COMMANDS) -> str:
    lines = [f"usage: {prog} {{{','.join(commands)}}} [options]   (--help after a command for its options)", ""]
    lines += [f"  {name:<8} {text}" for name, (_, text) in commands.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, prog: str = "axolotl-fastqwen", commands: dict = COMMANDS) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(prog, commands))
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in commands:
        print(f"unknown command {command!r}\n\n{usage(prog, commands)}", file=sys.stderr)
        return 2
    module = importlib.import_module(commands[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
