"""The KV pool and its leases (engine/kv/pool.py): first fit, ranges merged when given back, a stale lease refused,
a lease larger than the budget refused with the budget to raise, and a tensor that grows with use, the leases' KV
kept."""

from __future__ import annotations

import pytest
import torch

from engine.kv import KVPool, PoolFull, StaleLease, lease_tokens

TOKEN_BYTES = 2 * 2 * 2 * 4 * 4  # layers, k and v, kv heads, head dim, fp32


def pool(tokens: int) -> KVPool:
    return KVPool(2, 2, 4, torch.float32, "cpu", tokens * TOKEN_BYTES)


def test_leases_are_first_fit_and_ranges_given_back_merge():
    p = pool(100)
    a, b, c = p.lease(30), p.lease(30), p.lease(30)
    assert (a.start, b.start, c.start) == (0, 30, 60) and p.lease(20) is None  # 10 left
    b.release()
    assert p.lease(40) is None  # 30 + 10 free, apart
    c.release()
    d = p.lease(70)  # b's, c's and the rest, merged
    assert d.start == 30 and p.stats()["used_tokens"] == 100 and p.peak_tokens == 100
    a.release()
    d.release()
    assert p.lease(100).start == 0


def test_a_released_lease_is_stale_and_one_past_the_budget_says_what_to_raise():
    p = pool(50)
    lease = p.lease(10)
    lease.release()
    lease.release()  # twice: harmless
    for use in (lambda: lease.lengths, lambda: lease.write(torch.zeros(2, 2, 2, 1, 4)), lambda: lease.cache(),
                lambda: lease.advance(1)):
        with pytest.raises(StaleLease, match="used after its release"):
            use()
    with pytest.raises(PoolFull, match="raise --kv-budget-mb"):
        p.lease(51)
    assert lease_tokens(10, 5) == 16  # the one capacity rule: prompt, one per decode step, one spare


def test_the_tensor_grows_with_use_and_keeps_every_leases_kv():
    p = pool(10_000)
    first = p.lease(100)
    assert p.data.shape[4] == 256  # the first size: not the budget's
    kv = torch.randn(2, 2, 2, 100, 4)
    first.write(kv)
    second = p.lease(300)  # past the tensor's end: it doubles, or more
    assert p.data.shape[4] >= 400 and second.start == 100
    assert torch.equal(first.kv(), kv)  # moved with the tensor
    second.write(torch.ones(2, 2, 2, 7, 4))
    assert torch.equal(second.kv(), torch.ones(2, 2, 2, 7, 4)) and torch.equal(first.kv(), kv)
