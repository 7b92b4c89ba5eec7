import torch

from dsv41.config import flash, tiny
from dsv41.model.engram import EngramLayout, NgramHasher, hash_multipliers, is_prime


def test_prime_layout_reproduces_table_sizes():
    assert EngramLayout.from_config(tiny()).table_rows() == (660, 864)
    layout = EngramLayout.from_config(flash())
    assert layout.table_rows() == (384006168, 384016682)  # spec §5: the sum of the 24 primes per layer
    primes = [p for layer in layout.primes for order in layer for p in order]
    assert len(set(primes)) == 48 and all(p > 15999999 for p in primes)


def test_is_prime_against_sieve():
    n = 5000
    sieve = [True] * n
    sieve[0] = sieve[1] = False
    for i in range(2, n):
        if sieve[i]:
            for j in range(i * i, n, i):
                sieve[j] = False
    assert [is_prime(i) for i in range(n)] == sieve


def test_multipliers_are_odd_and_bounded():
    m = hash_multipliers((1, 14), 4, 99092)
    assert m.shape == (2, 4) and (m % 2 == 1).all()
    assert (m < torch.iinfo(torch.int64).max // 99092).all()


def _hash(hasher, ids):
    history = torch.zeros(ids.size(0), ids.size(1), dtype=torch.int64)
    return hasher(ids, 0, history)


def test_hash_at_p_depends_exactly_on_tokens_p_minus_3_to_p():
    cfg = tiny()
    hasher = NgramHasher(cfg, EngramLayout.from_config(cfg))
    ids = torch.randint(3, 1024, (1, 30), generator=torch.Generator().manual_seed(0))
    base = _hash(hasher, ids)
    for t in (0, 7, 20, 29):
        changed = ids.clone()
        changed[0, t] = (changed[0, t] + 1) % 1024  # the stub map is id % 512: a change of 1 changes it
        moved = (_hash(hasher, changed) != base).any(-1).any(-1)[0]
        expect = torch.zeros(30, dtype=torch.bool)
        expect[t : t + 4] = True
        assert torch.equal(moved, expect), t


def test_hash_matches_a_direct_formulation():
    cfg = tiny()
    layout = EngramLayout.from_config(cfg)
    hasher = NgramHasher(cfg, layout)
    ids = torch.randint(3, 1024, (1, 9), generator=torch.Generator().manual_seed(1))
    got = _hash(hasher, ids)
    mult = hash_multipliers(layout.layer_ids, 4, 512).tolist()
    comp = [i % 512 for i in ids[0].tolist()]
    pad = cfg.engram_pad_id % 512
    for p in range(9):
        ctx = [comp[p - s] if p - s >= 0 else pad for s in range(4)]
        for li, layer in enumerate(layout.primes):
            col, offset = 0, 0
            for order, heads in enumerate(layer):
                h = 0
                for s in range(order + 2):
                    h ^= ctx[s] * mult[li][s]
                for prime in heads:
                    assert got[0, p, li, col].item() == h % prime + offset
                    offset += prime
                    col += 1
