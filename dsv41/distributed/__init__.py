"""Serving on many devices (issue 32): parallel layouts over torch.distributed (NCCL on GPUs, gloo on CPU).

- `expert_parallel`: routed experts split over ranks, tokens dispatched and combined with all-to-all,
  bit-identical to one device under the engine's batch-invariant numerics.
- `data_parallel`: D engine ranks in lockstep (each its own requests, scheduler, KV pool and prefix cache),
  rank 0 holding the HTTP front (`DataParallelFront`, an `AsyncEngine`); with expert parallelism over them.
- `tensor_parallel`: each engine's attention query heads and output groups split over T ranks, the low-rank
  outputs all-gathered before a replicated `wo_b`; bit-identical to one device.
- `config`: `ParallelConfig`, the `dsv41 serve` layout options.
"""
