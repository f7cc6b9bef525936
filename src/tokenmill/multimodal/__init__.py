"""Multimodal input: media -> processed items -> placeholder runs -> encoder embeddings.

``processing.py`` (the boundary: HF image processors, placeholder expansion, hashes),
``inputs.py`` (what a request carries), ``step.py`` (the runner's per-step encoder and
positions), ``encoder_cache.py``, ``mrope.py``, ``media.py`` (loading media safely).
"""
