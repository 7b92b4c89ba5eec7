"""Muon.split_work: ranks share the Newton-Schulz work and must apply exactly the single-process update
(two gloo processes; training.md §1.1 "Distributed", §9)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv41.optim import Muon
from dsv41.optim.muon import owner_map

SHAPES = [(32, 48), (48, 32), (64, 64), (2, 16, 24), (32, 24), (8, 8)]


def make(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(3)]
    groups = [{"params": params[:4]}, {"params": params[4:], "heads": 2}]
    return params, grads, groups


def run_steps(rank=None, world=None):
    params, grads, groups = make()
    opt = Muon(groups, lr=0.02, weight_decay=0.1)
    if world:
        opt.split_work(rank, world)
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr.clone()
        opt.step()
    return [p.detach().clone() for p in params]


def _worker(rank, world, store_path, out_path, single_path):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: no dependence on the host name's address
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        torch.save(run_steps(rank, world), f"{out_path}.{rank}")
        dist.barrier()  # no rank tears gloo down while the other still has traffic in flight
    finally:
        dist.destroy_process_group()
    if rank == 0:
        # the single-process reference, in a fresh process too (this one, its group gone) with the workers'
        # thread count and torch settings, so the GEMM reduction order is the same and bit equality is a fair
        # demand
        torch.save(run_steps(), single_path)


def test_owner_map_balances_and_covers_every_parameter():
    params, _, groups = make()
    opt = Muon(groups)  # fills in the group defaults (heads, head_dim)
    owners = owner_map(opt.param_groups, 2)
    assert set(owners) == {id(p) for p in params} and set(owners.values()) == {0, 1}
    assert owner_map(opt.param_groups, 2) == owners  # deterministic
    assert set(owner_map(opt.param_groups, 1).values()) == {0}


@pytest.mark.skipif(not dist.is_gloo_available(), reason="gloo is not available")
def test_two_ranks_apply_the_single_process_update(tmp_path):
    world = 2
    args = (world, str(tmp_path / "store"), str(tmp_path / "out"), str(tmp_path / "single"))
    mp.spawn(_worker, args=args, nprocs=world, join=True)
    expected = torch.load(str(tmp_path / "single"))
    for rank in range(world):
        got = torch.load(f"{tmp_path / 'out'}.{rank}")
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
