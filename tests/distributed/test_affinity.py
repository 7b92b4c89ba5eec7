"""Prefix-cache-aware placement (dsv41.distributed.affinity): a prompt goes to the worker that was sent the
longest start of it when that covers enough of the prompt and the worker is not much busier than the
others; otherwise to the least loaded one."""

import pytest

from dsv41.distributed.affinity import AffinityConfig, PrefixAffinity, block_keys


def test_block_keys_are_chained_over_full_blocks():
    a, b = block_keys(list(range(40)), 16), block_keys(list(range(32)) + [99] * 8, 16)
    assert len(a) == 2 and a == b  # the partial third block is not keyed
    assert block_keys([5] + list(range(1, 32)), 16)[1] != a[1]  # block 1's key depends on block 0
    assert block_keys("x" * 63, 32) == block_keys("x" * 64, 32)[:1] and len(block_keys("x" * 64, 32)) == 2


def test_a_conversation_follows_its_worker():
    aff = PrefixAffinity(AffinityConfig(chunk=4, threshold=0.3, balance_abs=2))
    load = {"w0": 0, "w1": 0}
    turn1 = "system: be brief|user: hello there|"
    assert aff.choose(["w0", "w1"], aff.keys(turn1), load) == "w0"  # nothing recorded: least loaded, first
    load["w0"] = 1  # w0 is busier now, yet the next turn still goes there: it holds the prefix
    turn2 = turn1 + "assistant: hi|user: how are you?|"
    assert aff.choose(["w0", "w1"], aff.keys(turn2), load) == "w0"
    assert aff.choose(["w0", "w1"], aff.keys("something else entirely"), load) == "w1"  # least loaded
    assert (aff.cache_choices, aff.balance_choices) == (1, 2)
    # too little of the prompt matched (under the threshold): by load
    assert aff.choose(["w0", "w1"], aff.keys(turn1[:8] + "z" * 100), {"w0": 1, "w1": 0}) == "w1"
    # a match, but its worker is busier than balance_abs allows: by load
    assert aff.choose(["w0", "w1"], aff.keys(turn2), {"w0": 3, "w1": 0}) == "w1"
    # only live workers are candidates; a forgotten (restarted) worker has no record
    assert aff.choose(["w1"], aff.keys(turn1), load) == "w1"
    aff.forget("w1")
    aff.forget("w0")
    assert aff.matched("w0", aff.keys(turn2)) == 0


def test_records_are_bounded():
    aff = PrefixAffinity(AffinityConfig(chunk=1, max_blocks=10))
    aff.record("w", aff.keys("abcdefghijklmnopqrstuvwxyz"))
    assert aff.matched("w", aff.keys("abc")) == 0  # the oldest keys were dropped
    assert len(aff._seen["w"]) == 10
    with pytest.raises(ValueError, match="bad prefix affinity"):
        AffinityConfig(threshold=2.0).validate()
