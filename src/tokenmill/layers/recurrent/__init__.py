"""Layers whose cache is a recurrent state per request (``kv_cache/spec.RecurrentState``).

- ``plan.StatePlan``: one step as these layers run it (one-token sequences batched, longer
  ones one by one), built once per forward by the model;
- ``conv.CausalConv1d``: the depthwise causal convolution with its window of past inputs;
- ``delta_rule`` / ``ssd``: the gated delta rule and Mamba2's SSD in PyTorch, chunked for
  prefill and one step for decode: the reference the other kernels match;
- ``scan.ScanKernels``: the scan kernels a model runs, chosen once at load (native C steps
  on CPU, ``triton_scan`` on CUDA, else the reference);
- ``gated_deltanet.GatedDeltaNet``: Qwen3.5's linear-attention layer.
"""
