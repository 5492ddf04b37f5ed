"""`python -m axolotl_fastqwen bench|profile|doctor ...` (console script: `axolotl-fastqwen`)."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "bench": ("axolotl_fastqwen.bench.run", "every training path side by side on one model and token stream"),
    "profile": ("axolotl_fastqwen.bench.profile",
                "torch.profiler trace of one path: top kernels, GPU idle gaps, launches by issuing op"),
    "doctor": ("axolotl_fastqwen.bench.doctor", "versions, kernel choices and known-bad combinations"),
    "report": ("axolotl_fastqwen.integration.report_command", "print a finished Axolotl run's plugin report"),
}


def usage() -> str:
    lines = ["usage: axolotl-fastqwen {bench,profile,doctor,report} [options]   (--help after a command for its options)", ""]
    lines += [f"  {name:<8} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
