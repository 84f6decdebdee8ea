"""How a sampler pool deals a call's prompts to replicas (no Ray needed), and the backend's sampler lock."""

from __future__ import annotations

import threading
import time

import pytest

from arctic_rl_core.backend import SharedLock
from arctic_rl_core.config import BackendConfig
from arctic_rl_core.samplers.prefix_affinity import BLOCK, PrefixIndex, block_hashes
from arctic_rl_core.samplers.sampler_pool import SamplerPool, SamplerReplicaFailed, _Slot


def pool(replicas: int, queued: list[int] | None = None) -> SamplerPool:
    p = object.__new__(SamplerPool)
    p.config = BackendConfig(model_path="unused", ray={"start_timeout_s": 1})
    p._changed = threading.Condition()
    p._slots = [_Slot(i) for i in range(replicas)]
    for slot, tokens in zip(p._slots, queued or [0] * replicas):
        slot.state, slot.queued_tokens = "ready", tokens
    return p


def test_copies_of_a_prompt_form_one_unit_costed_once_for_the_prompt():
    prompts = [[1, 2, 3], [4, 5], [1, 2, 3], [6], [1, 2, 3]]
    units = SamplerPool._by_prompt(prompts, lambda ix: len(prompts[ix[0]]) + len(ix) * 2 * 10)
    assert sorted((cost, ix) for cost, ix, _ in units) == [(21, [3]), (22, [1]), (63, [0, 2, 4])]


def dealt_indexes(dealt) -> dict[int, list[list[int]]]:
    return {i: [ix for _, ix, _ in units] for i, units in dealt.items()}


def test_units_go_largest_first_to_the_replica_with_fewest_queued_tokens():
    p = pool(2, queued=[50, 0])
    dealt = p._deal([(60, [0], []), (30, [1], []), (25, [2], []), (10, [3], [])])
    # 60 -> replica 1 (0 queued); 30 -> replica 0 (50 < 60); 25 -> replica 1 (60 < 80); 10 -> replica 0 (80 < 85)
    assert dealt_indexes(dealt) == {1: [[0], [2]], 0: [[1], [3]]}
    assert [s.queued_tokens for s in p._slots] == [90, 85]


def test_a_multi_turn_episodes_next_turn_goes_to_the_replica_that_holds_its_history():
    history = list(range(100, 100 + 5 * BLOCK))  # five blocks of a first turn's prompt
    p = pool(2, queued=[10, 0])
    assert dealt_indexes(p._deal([(len(history) + 64, [0], block_hashes(history))])) == {1: [[0]]}
    p._slots[1].queued_tokens = 0  # the first turn finished; replica 0 is as idle (and first in order)
    p._slots[0].queued_tokens = 0
    next_turn = history + list(range(500, 540))  # the history, the reply and a new message
    assert dealt_indexes(p._deal([(len(next_turn) + 64, [1], block_hashes(next_turn))])) == {1: [[1]]}
    assert dealt_indexes(p._deal([(40, [2], block_hashes(list(range(7000, 7040))))])) == {0: [[2]]}  # another
    # Busier by more than the prefill it would save, the holder is passed over.
    p._slots[1].queued_tokens = p._slots[0].queued_tokens + len(next_turn) + BLOCK
    later = next_turn + list(range(600, 640))
    assert dealt_indexes(p._deal([(len(later) + 64, [3], block_hashes(later))])) == {0: [[3]]}


def test_after_a_sync_no_replica_is_taken_to_hold_a_prefix():
    prompt = list(range(3 * BLOCK))
    p = pool(2)
    [holder] = p._deal([(10, [0], block_hashes(prompt))])
    assert p._slots[holder].prefixes.cached_tokens(block_hashes(prompt)) == 3 * BLOCK
    assert p._slots[1 - holder].prefixes.cached_tokens(block_hashes(prompt)) == 0
    assert p._slots[0].prefixes.cached_tokens(block_hashes(prompt[:BLOCK] + [7] * BLOCK)) == (holder == 0) * BLOCK
    for slot in p._slots:  # what load_weights does once the replicas reset their prefix caches
        slot.prefixes.clear()
    assert all(s.prefixes.cached_tokens(block_hashes(prompt)) == 0 for s in p._slots)


def test_a_prefix_index_keeps_the_most_recently_used_blocks():
    index = PrefixIndex(capacity_blocks=4)
    a, b = block_hashes(list(range(3 * BLOCK))), block_hashes(list(range(1000, 1000 + 2 * BLOCK)))
    index.add(a)
    index.add(b)  # five blocks: a's first, the least recently used, goes
    assert index.cached_tokens(a) == 0 and index.cached_tokens(b) == 2 * BLOCK
    assert block_hashes(list(range(BLOCK - 1))) == []  # a partial block is never matched


def test_a_replica_that_is_not_ready_gets_nothing():
    p = pool(3)
    p._slots[1].state = "stale"  # alive, but a sync failed part-way
    dealt = p._deal([(5, [i], []) for i in range(6)])
    assert set(dealt) == {0, 2} and sum(len(u) for u in dealt.values()) == 6


def test_with_no_live_replica_dealing_fails_after_the_start_timeout_naming_the_replicas():
    p = pool(2)
    for slot in p._slots:
        slot.state, slot.error = "replacing", "ActorDiedError"
    with pytest.raises(SamplerReplicaFailed, match=r"no sampler replica is ready: 0: replacing \(ActorDiedError\)"):
        p._deal([(1, [0], [])])


def test_shared_lock_sharers_overlap_and_a_waiting_exclusive_holder_goes_before_new_sharers():
    lock, events = SharedLock(), []
    first_in, release_first = threading.Event(), threading.Event()

    def sharer(name, hold=None):
        with lock.shared():
            events.append(f"{name} in")
            if hold:
                first_in.set()
                hold.wait(5)
            events.append(f"{name} out")

    def exclusive():
        with lock:
            events.append("exclusive")

    a = threading.Thread(target=sharer, args=("a", release_first))
    a.start()
    first_in.wait(5)
    b = threading.Thread(target=sharer, args=("b",))
    b.start()
    b.join(5)  # a second sharer enters while the first holds the lock
    x = threading.Thread(target=exclusive)
    x.start()
    deadline = time.monotonic() + 30
    while lock._waiting == 0 and time.monotonic() < deadline:  # until the exclusive holder waits for a
        time.sleep(0.001)
    c = threading.Thread(target=sharer, args=("c",))
    c.start()
    time.sleep(0.2)  # c would be in by now if it did not wait
    assert events == ["a in", "b in", "b out"]  # the exclusive holder waits for a; c waits behind it
    release_first.set()
    for t in (a, x, c):
        t.join(5)
    assert events == ["a in", "b in", "b out", "a out", "exclusive", "c in", "c out"]
