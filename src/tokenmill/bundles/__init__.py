"""Prepared-model bundles: a load's request-independent results kept on disk and mapped back.

``fingerprint`` (the key), ``tensor_file`` (aligned safetensors), ``capture`` (a model's
tensors out and in), ``store`` (one bundle folder), ``cache`` (the shared cache: locks, LRU),
``commands`` (``tokenmill cache``), ``phases`` (start-up timing). Hooked in by
``engine.loading.load_model`` when ``EngineConfig.prepare_bundle`` is on.
"""
