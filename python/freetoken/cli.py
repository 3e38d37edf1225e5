"""The ``ft`` command. Argument parsing, the HTTP server and the scheduler are Rust (``freetoken._core``);
this only hands them ``argv`` and exits with their code."""

import sys


def main(argv: list[str] | None = None) -> int:
    from . import _core

    code = _core.main(["ft", *(sys.argv[1:] if argv is None else argv)])
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
