"""How `dsv41 serve` splits the work over processes (a dataclass; `dsv41 serve` builds its options from the
fields' help, as it does for `EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ParallelConfig:
    """How `dsv41 serve` splits the work (vLLM's option names)."""

    data_parallel_size: int = field(
        default=1,
        metadata={
            "help": (
                "engine ranks, one process each, every rank with its own requests, scheduler, KV pool and prefix "
                "cache; the HTTP front gives each new request to the rank with the fewest outstanding requests"
            )
        },
    )
    expert_parallel_size: int = field(
        default=1,
        metadata={
            "help": (
                "1 (every rank holds every expert) or equal to --data-parallel-size: each MoE layer's routed "
                "experts are split over the data-parallel ranks (vLLM's expert parallelism over the DP ranks) and "
                "tokens reach their experts by all-to-all; results stay bit-identical to one device"
            )
        },
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": (
                "ranks per engine (one process each): every attention layer's query heads and output groups are split "
                "over them, the rest replicated (dsv41.distributed.tensor_parallel); must divide the model's output "
                "groups; results stay bit-identical to one device. D x T processes in all"
            )
        },
    )
    engram_sharding: str = field(
        default="auto",
        metadata={
            "choices": ("auto", "sharded", "replicated"),
            "help": (
                "sharded: every rank holds only its share of each Engram table's rows and asks the owners for the others "
                "(exact: rows are moved, never summed; dsv41.distributed.engram_parallel); replicated: every rank holds "
                "the whole tables; auto: sharded when expert parallelism is on (its ranks already meet in the MoE "
                "all-to-all rounds, and the release's ~196 GB of tables cannot be held whole next to 1/8 of its "
                "experts), else replicated (no collective is added to a layout that has none)"
            ),
        },
    )
    engram_memory: str = field(
        default="device",
        metadata={
            "choices": ("device", "host"),
            "help": (
                "where a rank keeps its Engram rows: device memory, or host (CPU) memory with each lookup read there "
                "(what fits the release on 8 x 80 GB; on a CPU-only machine both are the same memory)"
            ),
        },
    )
    heartbeat_s: float = 30.0  # an idle front still runs an empty round this often (see the module doc)

    @property
    def expert_parallel(self) -> bool:
        return self.expert_parallel_size > 1

    @property
    def world_size(self) -> int:
        """Processes in all: data-parallel engines x tensor-parallel ranks each."""
        return self.data_parallel_size * self.tensor_parallel_size

    @property
    def engram_sharded(self) -> bool:
        """Whether each rank holds only its share of the Engram tables' rows."""
        return self.engram_sharding == "sharded" or (self.engram_sharding == "auto" and self.expert_parallel)

    def validate(self) -> None:
        for name in ("engram_sharding", "engram_memory"):
            choices = self.__dataclass_fields__[name].metadata["choices"]
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be one of {', '.join(choices)}, got {getattr(self, name)!r}"
                )
        if self.world_size == 1 and (self.engram_sharding == "sharded" or self.engram_memory == "host"):
            raise ValueError(
                "--engram-sharding sharded and --engram-memory host are built for serves over more "
                "than one rank (--data-parallel-size or --tensor-parallel-size > 1)"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        if self.expert_parallel_size not in (1, self.data_parallel_size):
            raise ValueError(
                f"--expert-parallel-size {self.expert_parallel_size}: expert parallelism runs over the "
                f"data-parallel ranks, so it must be 1 (off) or equal to --data-parallel-size "
                f"({self.data_parallel_size})"
            )
        if self.heartbeat_s <= 0:
            raise ValueError(f"ParallelConfig.heartbeat_s must be > 0, got {self.heartbeat_s}")
