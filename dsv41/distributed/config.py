"""How `dsv41 serve` splits the work over processes (a dataclass; `dsv41 serve` builds its options from the
fields' help, as it does for `EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ParallelConfig:
    """How `dsv41 serve` splits the work (vLLM's option names)."""

    data_parallel_size: int = field(default=1, metadata={"help": (
        "engine ranks, one process each, every rank with its own requests, scheduler, KV pool and prefix "
        "cache; the HTTP front gives each new request to the rank with the fewest outstanding requests")})
    expert_parallel_size: int = field(default=1, metadata={"help": (
        "1 (every rank holds every expert) or equal to --data-parallel-size: each MoE layer's routed "
        "experts are split over the data-parallel ranks (vLLM's expert parallelism over the DP ranks) and "
        "tokens reach their experts by all-to-all; results stay bit-identical to one device")})
    tensor_parallel_size: int = field(default=1, metadata={"help": (
        "ranks per engine (one process each): every attention layer's query heads and output groups are split "
        "over them, the rest replicated (dsv41.distributed.tensor_parallel); must divide the model's output "
        "groups; results stay bit-identical to one device. D x T processes in all")})
    heartbeat_s: float = 30.0  # an idle front still runs an empty round this often (see the module doc)

    @property
    def expert_parallel(self) -> bool:
        return self.expert_parallel_size > 1

    @property
    def world_size(self) -> int:
        """Processes in all: data-parallel engines x tensor-parallel ranks each."""
        return self.data_parallel_size * self.tensor_parallel_size

    def validate(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        if self.expert_parallel_size not in (1, self.data_parallel_size):
            raise ValueError(f"--expert-parallel-size {self.expert_parallel_size}: expert parallelism runs over the "
                             f"data-parallel ranks, so it must be 1 (off) or equal to --data-parallel-size "
                             f"({self.data_parallel_size})")
        if self.heartbeat_s <= 0:
            raise ValueError(f"ParallelConfig.heartbeat_s must be > 0, got {self.heartbeat_s}")
