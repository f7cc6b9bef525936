"""Weight formats of linear layers: dense, int8 per row, int4 groups (CPU kernels)."""
