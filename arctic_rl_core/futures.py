"""Every training-API call as a `concurrent.futures.Future`.

Training calls (the table's ordered calls) keep their order on one worker; reads run
alongside on others, so `generate` for the next batch overlaps `fwd_bwd` on
this one. Works for any `TrainingAPI`, in process or over HTTP;
`asyncio.wrap_future` makes each future awaitable.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from arctic_rl_core.calls import CALLS


class ApiFutures:
    def __init__(self, api, read_workers: int = 4):
        self._api = api
        self._ordered = ThreadPoolExecutor(1, thread_name_prefix="arctic-rl-ordered")
        self._reads = ThreadPoolExecutor(read_workers, thread_name_prefix="arctic-rl-read")

    def __getattr__(self, name: str) -> Callable[..., Future]:
        call = CALLS.get(name)
        if call is None or call.attribute:
            raise AttributeError(f"{name!r} is not a training-API call")
        executor = self._ordered if call.ordered else self._reads
        method = getattr(self._api, name)

        def submit(*args: Any, **kwargs: Any) -> Future:
            return executor.submit(method, *args, **kwargs)

        return submit

    def shutdown(self, wait: bool = True) -> None:
        self._ordered.shutdown(wait=wait)
        self._reads.shutdown(wait=wait)
