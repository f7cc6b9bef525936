"""vLLM's ``vllm.utils`` names that example scripts import."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that also takes ``--flag_name`` for ``--flag-name``."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        import sys

        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args([_dashed(a) for a in args], namespace)


def _dashed(arg: str) -> str:
    if not arg.startswith("--") or arg == "--":
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value
