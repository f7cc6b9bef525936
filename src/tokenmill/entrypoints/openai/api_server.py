"""``python -m tokenmill.entrypoints.openai.api_server --model M``: vLLM's server entry
point, the same as ``tokenmill serve M`` (the same flags)."""

from __future__ import annotations

import sys

from tokenmill.entrypoints import cli


def main(argv: list[str] | None = None) -> int:
    return cli.main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
