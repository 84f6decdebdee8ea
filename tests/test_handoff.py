"""Tokens handed from the engine's thread to the event loop: all of them, in order, with a wake-up per burst."""

import asyncio
import threading

from arctic_rl_core.serving.handoff import Handoff


def _counting(handoff: Handoff) -> list[int]:
    """Counts the loop's wake-ups (deliveries) in the list's one item."""
    wakeups, deliver = [0], handoff._deliver

    def counted():
        wakeups[0] += 1
        deliver()

    handoff._deliver = counted
    return wakeups


def test_items_from_another_thread_arrive_in_order():
    """An engine thread running free beside the loop (how many wake-ups then is the scheduler's to decide)."""
    async def main():
        handoff = Handoff(asyncio.get_running_loop())
        queues = [asyncio.Queue() for _ in range(32)]

        def engine_steps():  # 50 steps, each a token for every stream, then each stream's end
            for step in range(50):
                for q in queues:
                    handoff.put(q, step)
            for q in queues:
                handoff.put(q, None)

        thread = threading.Thread(target=engine_steps)
        thread.start()
        got = []
        for q in queues:
            items = []
            while (item := await q.get()) is not None:
                items.append(item)
            got.append(items)
        thread.join()
        return got

    assert asyncio.run(main()) == [list(range(50))] * 32


def test_a_burst_put_while_the_loop_is_busy_wakes_it_once():
    """Each step's 32 tokens are put while the loop is busy (here: blocked until the engine thread is done putting
    them), as when it is serving other requests: one wake-up delivers the step, where one per item would be 32."""
    async def main():
        handoff = Handoff(asyncio.get_running_loop())
        wakeups = _counting(handoff)
        queues = [asyncio.Queue() for _ in range(32)]
        go, put = threading.Event(), threading.Event()

        def engine_steps():
            for step in [*range(50), None]:
                go.wait()
                go.clear()
                for q in queues:
                    handoff.put(q, step)
                put.set()

        thread = threading.Thread(target=engine_steps)
        thread.start()
        got = [[] for _ in queues]
        for step in [*range(50), None]:
            go.set()
            assert put.wait(60)  # the loop blocked: nothing it was told of runs until the burst is in
            put.clear()
            for items, q in zip(got, queues):
                items.append(await q.get())
        thread.join()
        return got, wakeups[0]

    got, wakeups = asyncio.run(main())
    assert got == [[*range(50), None]] * 32
    assert wakeups == 51
