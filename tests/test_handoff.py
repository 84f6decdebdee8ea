"""Tokens handed from the engine's thread to the event loop: all of them, in order, with a wake-up per burst."""

import asyncio
import threading

from arctic_rl_core.serving.handoff import Handoff


def test_items_from_another_thread_arrive_in_order_and_a_burst_wakes_the_loop_once():
    async def main():
        loop = asyncio.get_running_loop()
        handoff = Handoff(loop)
        wakeups = 0
        deliver = handoff._deliver

        def counted():
            nonlocal wakeups
            wakeups += 1
            deliver()

        handoff._deliver = counted
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
        return got, wakeups

    got, wakeups = asyncio.run(main())
    assert got == [list(range(50))] * 32
    assert 1 <= wakeups <= 51 * 32 // 8  # bursts shared a wake-up (one per item would be 1,632)
