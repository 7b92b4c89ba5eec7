"""Serving on many devices (issue 32): parallel layouts over torch.distributed (NCCL on GPUs, gloo on CPU).

- `expert_parallel`: routed experts split over ranks, tokens dispatched and combined with all-to-all,
  bit-identical to one device under the engine's batch-invariant numerics.
"""
