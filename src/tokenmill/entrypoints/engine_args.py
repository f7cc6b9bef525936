"""``EngineArgs``: vLLM's engine-options object, so vLLM example scripts run unchanged.

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args()
    llm = LLM(**asdict(EngineArgs.from_cli_args(args)))   # or LLM(**vars(args))

Its fields are ``EngineConfig``'s (same names and defaults), ``generation_config``, and
vLLM's options that ``tokenmill.vllm_compat`` documents.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.args import GENERATION_CONFIG_HELP, Flag, add_engine_flags, add_flags
from tokenmill.vllm_compat import COMPAT_OPTIONS, check_compat_options


def _fields() -> list[tuple[str, Any, dataclasses.Field]]:
    fields = [
        (f.name, f.type, dataclasses.field(default=f.default))
        for f in dataclasses.fields(EngineConfig)
        if f.init  # derived fields (the resolved speculative config) are not options
    ]
    fields.append(("generation_config", "str", dataclasses.field(default="auto")))
    fields += [(o.name, "Any", dataclasses.field(default=o.default)) for o in COMPAT_OPTIONS]
    return fields


class _EngineArgsMethods:
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add every engine flag (``--model``, ``--max-model-len``, ``-tp``, ...)."""
        add_engine_flags(parser)
        add_flags(
            parser,
            (
                Flag(
                    "--generation-config", "generation_config", str, GENERATION_CONFIG_HELP, "auto"
                ),
            ),
        )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace):
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})

    def create_engine_config(self) -> EngineConfig:
        """The EngineConfig these arguments describe (raises on a vLLM option that cannot
        be honoured here, such as cpu_offload_gb=4 or a tokenizer_revision)."""
        options = dataclasses.asdict(self)
        check_compat_options(options)
        options.pop("generation_config")
        return EngineConfig(**options)


EngineArgs = dataclasses.make_dataclass("EngineArgs", _fields(), bases=(_EngineArgsMethods,))
EngineArgs.__module__ = __name__
EngineArgs.__doc__ = __doc__
