"""The sampler's snapshots (`tinker/snapshots.py`): a sample of a snapshot the sampler does not hold waits for the
samples in flight on the one it holds, then loads its own; samples take the sampler in order of arrival."""

from __future__ import annotations

import asyncio
import time

import pytest

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.tinker.snapshots import BASE, SamplerHold


class Sampler:
    """A stand-in for the backend: loads count as weight versions, and each sample records what it ran on."""

    def __init__(self, hold: SamplerHold):
        self.hold = hold
        self.weight_version = 0
        self.loads: list[str] = []
        self.holding = "base-folder"

    def load_sampler_weights(self, folder: str) -> int:
        assert self.hold.in_flight == 0, "a load while samples run on the weights it replaces"
        time.sleep(0.01)
        self.loads.append(folder)
        self.holding = folder
        self.weight_version += 1
        return self.weight_version


async def sample(hold: SamplerHold, api: Sampler, key: str, log: list, seconds: float = 0.02):
    async with hold.holding(api, key, f"{key}-folder") as version:
        log.append(("start", key, api.holding, version))
        await asyncio.sleep(seconds)
        assert api.holding == f"{key}-folder" and api.weight_version == version  # nothing replaced them meanwhile
        log.append(("end", key))


def test_each_sample_runs_on_its_own_snapshot_and_arrivals_are_served_in_order():
    async def main():
        hold = SamplerHold()
        api = Sampler(hold)
        log: list = []
        # Two samples of the base (held), then one of A, then another of the base: the late base sample waits
        # behind A's, which waits for the first two to end.
        first = [asyncio.create_task(sample(hold, api, BASE, log, 0.05)) for _ in range(2)]
        await asyncio.sleep(0.01)
        a = asyncio.create_task(sample(hold, api, "a", log))
        await asyncio.sleep(0.001)
        late = asyncio.create_task(sample(hold, api, BASE, log))
        await asyncio.gather(*first, a, late)
        return api, log

    api, log = asyncio.run(main())
    starts = [entry[1] for entry in log if entry[0] == "start"]
    assert starts == [BASE, BASE, "a", BASE]
    assert api.loads == ["a-folder", "base-folder"]
    # The base's first samples ended before A's began, and A's before the late one's.
    assert log.index(("end", BASE)) < log.index(next(e for e in log if e[:2] == ("start", "a")))


def test_a_sync_of_the_training_api_makes_the_held_snapshot_load_again():
    async def main():
        hold = SamplerHold()
        api = Sampler(hold)
        log: list = []
        await sample(hold, api, "a", log)
        api.weight_version += 1  # another set of weights, synced around the snapshots
        api.holding = "synced"
        await sample(hold, api, "a", log)
        return api

    assert asyncio.run(main()).loads == ["a-folder", "a-folder"]


def test_weights_no_longer_kept_are_refused_by_field_and_release_the_queue():
    async def main():
        hold = SamplerHold()
        api = Sampler(hold)
        with pytest.raises(InvalidRequest) as refused:
            async with hold.holding(api, "gone", None):
                pass
        assert refused.value.field == "sampling_session_id"
        await sample(hold, api, BASE, [])  # nothing is left waiting on the refused one
        assert not hold.waiting and hold.in_flight == 0

    asyncio.run(main())
