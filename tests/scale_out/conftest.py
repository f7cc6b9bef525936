"""Scale-out tests reuse the loader tests' synthetic GGUF writer (quantized shards)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "loader"))  # quant_blocks, gguf_synth
