"""Data-parallel engine ranks in lockstep, with expert parallelism over them (issue 32;
../shared/docs/serving-at-scale.md: "data-parallel attention + expert parallelism").

D ranks, one process each, in one torch.distributed group (gloo on CPU). Each rank has a whole `LLMEngine`:
its own scheduler, KV pool and prefix cache, its own requests. With expert parallelism (EP = D, vLLM's "EP
over the DP ranks") each rank keeps only its share of every MoE layer's routed experts (`shard_experts`), so
every forward needs the other ranks: every engine step is a collective step.

A *round* (every rank runs one per loop iteration, rank 0 leading):
1. rank 0 holds the HTTP front (`DataParallelFront`). It sends each rank its commands (new requests, which it
   places on the rank with the fewest outstanding requests, and aborts) and whether this round steps, with
   one `scatter_object_list`;
2. every rank applies its commands; if the round steps, it runs `LLMEngine.step()` when it has work and then
   `end_step`, which serves the other ranks' MoE rounds with its experts until every rank has finished its
   own forwards (`dsv41.distributed.expert_parallel`): a rank with no work joins the MoE collectives, so
   nobody stalls;
3. one `gather_object` brings every rank's outputs, rejected requests, "still has work" flag and engine
   metrics back to rank 0, which streams the outputs to their clients.

The gathered flags are how the ranks agree whether anyone has work: rank 0 steps the next round only when
some rank still has work or a command is on its way, and sends that decision to everyone in step 1, so all
ranks step together or none does. When nobody has work rank 0 sleeps on its command queue and the other
ranks sleep inside the scatter (a blocking socket read, no spinning); rank 0 still runs an empty round every
`heartbeat_s` so an idle group notices a dead rank and never reaches gloo's collective timeout.

A request's numerics do not depend on its rank or on what the others are doing: the engine's batch-invariant
GEMMs make an expert's output for a row independent of the rows it shares a GEMM with, and the combine sums
each token's expert outputs in the single-device order. So greedy tokens and logprobs are bit-identical to
the single-device engine's (tests/distributed/test_data_parallel.py).

torch.distributed carries everything between ranks (commands, outputs and the MoE rows), so the same code
runs under `dsv41 serve --data-parallel-size D` (which spawns the ranks) and under torchrun.
"""

from __future__ import annotations

import logging
import queue

import torch
import torch.distributed as dist

from dsv41.distributed.affinity import AffinityConfig, PrefixAffinity
from dsv41.distributed.config import ParallelConfig
from dsv41.distributed.expert_parallel import ExpertParallel, dispatcher_of, shard_experts
from dsv41.engine.async_engine import AsyncEngine
from dsv41.engine.config import EngineConfig
from dsv41.engine.handoff import KVHandoff
from dsv41.engine.llm_engine import LLMEngine

log = logging.getLogger("dsv41.distributed")


def layout_groups(parallel: ParallelConfig) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(this rank's tensor-parallel group, its expert-parallel group). Global rank r is tensor-parallel rank
    r % T of data-parallel engine r // T; engine d's TP group is ranks d*T .. d*T+T-1 and the expert-parallel
    group of TP rank t is the ranks t, t+T, t+2T, ... (one per engine: the ranks of an engine hold the same
    hidden states, so each TP rank runs its own EP all-to-all with its peers of the other engines). With T = 1
    both are None (the whole world). Every rank creates every group, in the same order (torch.distributed
    requires it)."""
    t = parallel.tensor_parallel_size
    if t == 1:
        return None, None
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != parallel.world_size:
        raise ValueError(
            f"{world} processes, but --data-parallel-size {parallel.data_parallel_size} x "
            f"--tensor-parallel-size {t} needs {parallel.world_size}"
        )
    tp_group = ep_group = None
    for d in range(parallel.data_parallel_size):
        g = dist.new_group(list(range(d * t, (d + 1) * t)))
        if rank // t == d:
            tp_group = g
    if parallel.expert_parallel:
        for i in range(t):
            g = dist.new_group(list(range(i, world, t)))
            if rank % t == i:
                ep_group = g
    return tp_group, ep_group


def build_rank_engine(
    model: str,
    engine_config: EngineConfig | None,
    seed: int,
    parallel: ParallelConfig,
    group: dist.ProcessGroup | None = None,
) -> LLMEngine:
    """This rank's engine: the model built as `build_engine` builds it (every rank draws the same random
    weights from `seed`), its experts sharded over its expert-parallel group when expert parallelism is on
    and its attention heads over its tensor-parallel group (`layout_groups`), its Engram table rows over the
    expert-parallel group (or the world without expert parallelism) when `parallel.engram_sharded`, in host
    memory with `engram_memory="host"` (dsv41.distributed.engram_parallel); from a checkpoint folder a rank
    then reads only its own experts', heads' and Engram rows' slices (`load_shard`). `group`: the
    expert-parallel group when T = 1 (default: the world)."""
    import functools
    import os

    from dsv41.distributed.engram_parallel import engram_tables, install_engram
    from dsv41.distributed.sharded_load import load_shard
    from dsv41.distributed.tensor_parallel import TensorParallel, install_gather, shard_attention_heads
    from dsv41.engine.build import build_model

    tp_group, ep_group = layout_groups(parallel)
    if parallel.tensor_parallel_size == 1:
        ep_group = group
    tp = TensorParallel(tp_group) if parallel.tensor_parallel_size > 1 else None
    ep = (dist.get_rank(ep_group), dist.get_world_size(ep_group)) if parallel.expert_parallel else (0, 1)
    # Engram rows are sharded over the group of the MoE rounds (they share them), else over the whole world
    engram_group = ep_group if parallel.expert_parallel else (group if tp is None else None)
    engram = (dist.get_rank(engram_group), dist.get_world_size(engram_group)) if parallel.engram_sharded else (0, 1)
    load = None
    sharded = (parallel.expert_parallel or tp is not None or engram[1] > 1) and os.path.isdir(model)
    if sharded:  # read only this rank's experts, heads and Engram rows from the files
        load = functools.partial(
            load_shard,
            expert_rank=ep[0],
            expert_world=ep[1],
            tp_rank=tp.rank if tp else 0,
            tp_world=tp.world if tp else 1,
            engram_rank=engram[0],
            engram_world=engram[1],
        )
    net, tokenizer, name = build_model(model, seed, load=load)
    net.eval()
    if parallel.expert_parallel:
        shard_experts(net, ep_group)
    if engram_tables(net) and (engram[1] > 1 or parallel.engram_memory == "host"):
        rounds = (dispatcher_of(net) or ExpertParallel(engram_group)) if engram[1] > 1 else None
        install_engram(net, rounds, parallel.engram_memory)
    if tp is not None:
        if sharded:
            install_gather(net, tp)  # the loader kept only this rank's slices
        else:
            shard_attention_heads(net, tp_group)
    # the engine's own generator draws the tokens of requests without a seed: one stream per engine, so two
    # engines given the same unseeded request at once do not sample the same tokens; the TP ranks of one
    # engine draw the same stream (they must pick the same tokens)
    engine_rank = dist.get_rank() // parallel.tensor_parallel_size if tp is not None else dist.get_rank(group)
    return LLMEngine(net, tokenizer, engine_config, model_name=name, seed=seed + engine_rank)


class RankEngine:
    """One rank's part of a round (every rank, rank 0 included, runs `round`)."""

    def __init__(self, engine: LLMEngine, group: dist.ProcessGroup | None = None, sends_handoffs: bool = True):
        self.engine = engine
        self.group = group
        # the front keeps each engine's first TP rank's outputs: the other TP ranks send no hand-off bytes
        self.sends_handoffs = sends_handoffs
        self.rank = dist.get_rank(group)
        self.experts: ExpertParallel | None = dispatcher_of(engine.model)

    def _numerics(self):
        """The numerics the runner's forwards use: end_step computes other ranks' rows and must give the
        bits their own forward would."""
        return self.engine.runner.numerics()

    def round(self, message: dict) -> dict:
        engine = self.engine
        rejected, failed = [], []  # (request id, why): bad input (the client's 400) / this rank's failure
        for command in message["commands"]:
            if command[0] == "add":
                # as AsyncEngine.generate queues it: ("add", id, prompt, params, images[, hand-off arguments])
                _, request_id, prompt, params, images, *handoff = command
                try:
                    engine.add_request(request_id, prompt, params, images, **_handoff_kwargs(handoff))
                except ValueError as exc:  # a HandoffError too: nothing imported
                    rejected.append((request_id, str(exc)))
            elif command[0] == "abort":
                engine.abort_request(command[1])
        outputs = []
        if message["step"]:
            if engine.has_unfinished():
                try:
                    outputs = engine.step()
                except Exception as exc:  # noqa: BLE001
                    # as AsyncEngine: the engine isolates a failing request itself; what still gets here is a
                    # bookkeeping bug, and must not hang every client (nor leave this rank's round half done)
                    log.exception("rank %d: engine step failed", self.rank)
                    for request_id in list(engine.requests):
                        engine.abort_request(request_id)
                        failed.append((request_id, f"engine step failed on rank {self.rank}: {exc}"))
                    outputs = []
            if self.experts is not None:
                with self._numerics(), torch.inference_mode():
                    self.experts.end_step()
        for out in outputs:  # a prefill worker's hand-off goes to the front in its checksummed wire format
            if out.handoff is not None:
                out.handoff = out.handoff.to_bytes() if self.sends_handoffs else None
        metrics = engine.metrics()
        served = self.experts.served if self.experts is not None else {}
        metrics["dp_served_moe_rounds_total"] = served.get("moe", 0)
        metrics["dp_served_engram_rounds_total"] = served.get("engram", 0)
        return {
            "outputs": outputs,
            "rejected": rejected,
            "failed": failed,
            "unfinished": engine.has_unfinished(),
            "metrics": metrics,
        }

    def serve_forever(self) -> None:
        """A rank other than 0: take part in rounds until rank 0 says stop."""
        if self.rank == 0:
            raise RuntimeError("rank 0 leads the rounds (DataParallelFront); serve_forever is for the others")
        while True:
            box = [None]
            dist.scatter_object_list(box, None, src=0, group=self.group)
            message = box[0]
            if message["stop"]:
                return
            dist.gather_object(self.round(message), None, dst=0, group=self.group)


def _handoff_kwargs(extra: list) -> dict:
    """An add command's disaggregation arguments (AsyncEngine.generate's), with a hand-off that travelled as
    bytes (`_wire`) parsed again: every checksum is verified on the rank that imports it."""
    kwargs = dict(extra[0]) if extra else {}
    if isinstance(kwargs.get("handoff"), (bytes, bytearray)):
        kwargs["handoff"] = KVHandoff.from_bytes(kwargs["handoff"])
    return kwargs


def _wire(command: tuple) -> tuple:
    """An add command as it crosses the process group: a KV hand-off as its checksummed bytes (the format the
    router moves; torch's pickling of the parsed tensors is not a stable format across builds, and the bytes
    let the receiving rank verify what it imports)."""
    if command[0] == "add" and len(command) > 5 and isinstance(command[5].get("handoff"), KVHandoff):
        return (*command[:5], dict(command[5], handoff=command[5]["handoff"].to_bytes()))
    return command


# metrics that are ratios or rates of the summed counters: recomputed after summing, not summed
_RATIOS = {
    "kv_usage": ("kv_blocks_used", "kv_blocks_total"),
    "prefix_cache_hit_rate": ("prefix_cache_hit_tokens", "prefix_cache_queried_tokens"),
}


def combine_metrics(per_rank: list[dict]) -> dict:
    """The group's engine metrics: counts summed over the ranks, ratios recomputed from the sums, other
    non-additive figures (per-token bytes, acceptance rates) averaged over the ranks; and each rank's own
    waiting/running/finished counts as rank<r>_* keys."""
    out: dict = {}
    for key in per_rank[0]:
        values = [m[key] for m in per_rank if isinstance(m.get(key), (int, float))]
        if not values:
            continue
        if key in _RATIOS:
            num, den = _RATIOS[key]
            total = sum(m[den] for m in per_rank)
            out[key] = sum(m[num] for m in per_rank) / total if total else 0.0
        elif key.endswith(("_per_token", "_rate", "_per_step")) or "_rate_position_" in key:
            out[key] = sum(values) / len(values)
        else:
            out[key] = sum(values)
    for r, m in enumerate(per_rank):
        out[f"dp_rank{r}_waiting"] = m["waiting"]
        out[f"dp_rank{r}_running"] = m["running"]
        out[f"dp_rank{r}_requests_finished_total"] = m["requests_finished_total"]
    return out


class DataParallelFront(AsyncEngine):
    """Rank 0's `AsyncEngine`: the server's interface (generate, abort, metrics, is_alive) over the whole
    group. Its engine thread leads the rounds; `engine` is rank 0's own `LLMEngine` (the tokenizer and model
    facts the server reads are the same on every rank)."""

    def __init__(self, rank: RankEngine, parallel: ParallelConfig, max_waiting: int = 64):
        super().__init__(rank.engine, max_waiting=max_waiting)
        if rank.rank != 0:
            raise ValueError("the front runs on rank 0")
        self.rank0 = rank
        self.group = rank.group
        # tensor parallelism: the T ranks of an engine get the same commands and give the same outputs
        self.tp = parallel.tensor_parallel_size
        self.world = dist.get_world_size(self.group) // self.tp  # engines (data-parallel ranks)
        self.parallel = parallel
        self.max_running = self.world * rank.engine.config.max_num_seqs
        self._owner: dict[str, int] = {}  # request id -> the rank serving it
        self._outstanding = [0] * self.world
        # a conversation's next turn to the rank that holds its earlier turns (dsv41.distributed.affinity); in
        # blocks of 16 tokens, finer than the pool's blocks: the prefix cache's snapshots also serve a prompt
        # whose shared start ends inside a block
        self.affinity = PrefixAffinity(AffinityConfig(chunk=16))
        self._assigned = [0] * self.world
        self._busy = False  # some rank had work at the end of the last round
        self._failure: BaseException | None = None
        self._metrics = combine_metrics([self._metrics])  # rank 0's until the first round reports every rank's
        self._stopped = False

    async def generate(self, request_id, prompt_token_ids, params, images=None, **disaggregation):
        """As `AsyncEngine.generate`; `disaggregation` (a prefill or decode worker's hand-off export or import,
        dsv41.engine.handoff) travels with the add command to the rank that `_place` picks: that rank's
        engine computes the prompt and exports its hand-off, or imports one into its own pool (on every TP
        rank of that engine)."""
        if self._failure is not None:
            raise RuntimeError(f"the data-parallel engine group has failed: {self._failure}")
        async for out in super().generate(request_id, prompt_token_ids, params, images, **disaggregation):
            yield out

    def metrics(self) -> dict:
        m = super().metrics()
        for r in range(self.world):
            m[f"dp_rank{r}_requests_assigned_total"] = self._assigned[r]
        m["dp_prefix_placements_total"] = self.affinity.cache_choices  # placed by a rank's record of the prompt
        return m

    def _place(self, command: tuple) -> int:
        """The rank whose prefix cache most likely holds the start of this prompt (`PrefixAffinity` over its
        16-token blocks: the rank that was sent the longest start of it, unless it is busier than the
        others by `balance_abs`), else the one with the fewest outstanding requests. Ties go to the rank given
        the fewest requests so far, then the lowest: requests that arrive one after another (each done before
        the next) take turns over the ranks instead of all landing on rank 0. A request that arrives with a KV
        hand-off reads no prefix cache: fewest outstanding only."""
        request_id, prompt = command[1], command[2]
        extra = command[5] if len(command) > 5 else {}
        load = dict(enumerate(self._outstanding))
        turns = sorted(range(self.world), key=lambda r: (self._assigned[r], r))  # preference order for ties
        if extra.get("handoff") is not None:
            rank = min(turns, key=lambda r: self._outstanding[r])  # min keeps the first of equals
        else:
            rank = self.affinity.choose(turns, self.affinity.keys(prompt), load)
        self._owner[request_id] = rank
        self._outstanding[rank] += 1
        self._assigned[rank] += 1
        return rank

    def _done(self, request_id: str) -> None:
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self._outstanding[rank] -= 1

    def _loop(self) -> None:
        try:
            while not self._stopped:
                self._one_round()
        except BaseException as exc:  # noqa: BLE001 - a rank died or a collective failed: fail every client
            log.exception("the data-parallel engine group failed")
            self._failure = exc
            error = f"the data-parallel engine group failed: {exc}"
            with self._lock:
                streams = list(self._streams)
            for request_id in streams:
                self._deliver(request_id, RuntimeError(error))
            # until shutdown, fail what still arrives (a request that got past `generate`'s check just before
            # the failure), so no client waits on a group that will never answer; is_alive() is False now
            while not self._stop.is_set():
                try:
                    command = self._commands.get(timeout=1.0)
                except queue.Empty:
                    continue
                if command[0] == "add":
                    self._deliver(command[1], RuntimeError(error))

    def is_alive(self) -> bool:
        return super().is_alive() and self._failure is None

    def _one_round(self) -> None:
        stop = self._stop.is_set()
        commands: list = []
        if not stop:
            try:
                if self._busy:
                    commands.append(self._commands.get_nowait())
                else:  # nobody has work: sleep here until a request (or the heartbeat) comes
                    commands.append(self._commands.get(timeout=self.parallel.heartbeat_s))
                while True:
                    commands.append(self._commands.get_nowait())
            except queue.Empty:
                pass
        per_rank: list[list] = [[] for _ in range(self.world)]
        adds = 0
        for command in commands:
            if command[0] == "add":
                per_rank[self._place(command)].append(_wire(command))
                adds += 1
            elif command[0] == "abort" and command[1] in self._owner:
                per_rank[self._owner[command[1]]].append(command)
        stop = stop or self._stop.is_set()
        step = not stop and (self._busy or any(per_rank))
        messages = [{"commands": c, "step": step, "stop": stop} for c in per_rank for _ in range(self.tp)]
        box = [None]
        dist.scatter_object_list(box, messages, src=0, group=self.group)
        if stop:
            self._stopped = True
            return
        replies: list = [None] * (self.world * self.tp)
        mine = self.rank0.round(box[0])
        dist.gather_object(mine, replies, dst=0, group=self.group)
        replies = engine_replies(replies, self.tp)
        for reply in replies:
            for request_id, message in reply["rejected"]:
                self._done(request_id)
                self._deliver(request_id, ValueError(message))
            for request_id, message in reply["failed"]:
                self._done(request_id)
                self._deliver(request_id, RuntimeError(message))
            for out in reply["outputs"]:
                if isinstance(out.handoff, bytes):  # exported by that rank (RankEngine.round)
                    out.handoff = KVHandoff.from_bytes(out.handoff)
                if out.finished:
                    self._done(out.request_id)
                self._deliver(out.request_id, out)
        self._busy = any(reply["unfinished"] for reply in replies)
        with self._lock:  # hand the requests from "pending" to the ranks' "waiting" in one move
            self._pending -= adds
            self._metrics = combine_metrics([reply["metrics"] for reply in replies])


def engine_replies(replies: list, tp: int) -> list:
    """One reply per engine from the replies of all D x T ranks: each engine's first TP rank's, after checking
    that its other TP ranks produced the same tokens (they run the same batch on identical inputs; a
    difference means they diverged, and the group stops rather than serve either)."""
    if tp == 1:
        return replies
    for d in range(len(replies) // tp):
        lead = replies[d * tp]
        tokens = [(o.request_id, o.new_token_ids, o.finished) for o in lead["outputs"]]
        for r in range(d * tp + 1, (d + 1) * tp):
            if [(o.request_id, o.new_token_ids, o.finished) for o in replies[r]["outputs"]] != tokens:
                raise RuntimeError(f"tensor-parallel rank {r} produced other tokens than rank {d * tp} of its engine")
    return replies[::tp]


def init_group(rank: int, world: int, init_method: str, timeout_s: float = 1800.0) -> None:
    """Join the gloo group (CPU transport; NCCL is for a GPU run, not built yet)."""
    from datetime import timedelta

    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def worker_main(
    rank: int,
    world: int,
    init_method: str,
    model: str,
    engine_config: EngineConfig | None,
    seed: int,
    parallel: ParallelConfig,
    threads: int | None = None,
) -> None:
    """The process of a rank other than 0 (spawned by `dsv41 serve`, or started by torchrun)."""
    import signal

    # Ctrl-C reaches the whole process group; rank 0 stops the workers (a stop round), so they ignore it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if threads:
        torch.set_num_threads(threads)
    if not dist.is_initialized():
        init_group(rank, world, init_method)
    try:
        engine = build_rank_engine(model, engine_config, seed, parallel)
        dist.barrier()  # ready: rank 0 starts serving once every rank has built its engine
        RankEngine(engine, sends_handoffs=rank % parallel.tensor_parallel_size == 0).serve_forever()
    finally:
        dist.destroy_process_group()
