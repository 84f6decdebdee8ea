"""Receiving the orchestrator's batches on the transport its config selects (`rollout_transport`).

- ZMQ (prime-rl's default): the orchestrator publishes each step's `list[MicroBatch]` for rank r on a
  PUB socket at `tcp://host:port` under the topic `data_rank|r|`, and sends nothing until every rank
  has pushed a READY message (its rank) to `port + 1`. A SUB socket cannot see what was published
  before its subscription reached the publisher, so READY goes only once the SUB connection's handshake
  is done (the subscription travels with it), whichever of the two processes started first.
- Filesystem: `{output_dir}/rollouts/step_{n}/rank_{r}.bin`, written as `.tmp` and renamed.

Steps count from 1, as prime-rl's trainer counts them. Waiting polls so that a stop request is
seen within a poll interval.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from arctic_rl_primerl.batches import MicroBatch, decode

POLL_S = 0.5


class Receiver:
    def receive(self, step: int, stopping: Callable[[], bool]) -> list[MicroBatch] | None:
        """Step `step`'s micro-batches for this rank, or None once `stopping()` is true."""
        raise NotImplementedError

    def close(self) -> None:
        pass


SUBSCRIPTION_SETTLE_S = 0.2
"""After the SUB handshake, time for the publisher to register the subscription before READY lets it send."""


class ZMQReceiver(Receiver):
    def __init__(self, host: str, port: int, hwm: int, rank: int = 0):
        import zmq

        self._zmq = zmq
        self.rank = rank
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.RCVHWM, hwm)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"data_rank|%d|" % rank)
        self.socket.connect(f"tcp://{host}:{port}")
        self.ready = self.context.socket(zmq.PUSH)
        self.ready.setsockopt(zmq.SNDHWM, hwm)
        self.ready.connect(f"tcp://{host}:{port + 1}")
        self.announced = False

    def _announce(self, stopping: Callable[[], bool]) -> bool:
        """READY once subscribed: the publisher has seen the SUB connection's handshake."""
        from zmq.utils.monitor import recv_monitor_message

        while not stopping():
            if self.monitor.poll(int(POLL_S * 1000)):
                if recv_monitor_message(self.monitor)["event"] == self._zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    time.sleep(SUBSCRIPTION_SETTLE_S)
                    self.ready.send(str(self.rank).encode())
                    self.announced = True
                    return True
        return False

    def receive(self, step: int, stopping: Callable[[], bool]) -> list[MicroBatch] | None:
        if not self.announced and not self._announce(stopping):
            return None
        while not stopping():
            if self.socket.poll(int(POLL_S * 1000)):
                _, payload = self.socket.recv_multipart(copy=False)
                return decode(payload.buffer)
        return None

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)
        self.ready.close(linger=0)
        self.context.term()


class FileSystemReceiver(Receiver):
    def __init__(self, output_dir: Path, rank: int = 0):
        self.rollouts = Path(output_dir) / "rollouts"
        self.rank = rank

    def path(self, step: int) -> Path:
        return self.rollouts / f"step_{step}" / f"rank_{self.rank}.bin"

    def receive(self, step: int, stopping: Callable[[], bool]) -> list[MicroBatch] | None:
        path = self.path(step)
        while not path.exists():
            if stopping():
                return None
            time.sleep(POLL_S)
        return decode(path.read_bytes())


def receiver_for(transport, output_dir: Path) -> Receiver:
    """The receiver for prime-rl's `rollout_transport` config (`ZMQTransportConfig` or `FileSystemTransportConfig`)."""
    if transport.type == "zmq":
        return ZMQReceiver(transport.host, transport.port, transport.hwm)
    if transport.type == "filesystem":
        return FileSystemReceiver(output_dir)
    raise ValueError(f"rollout_transport.type {transport.type!r} is not one prime-rl 0.8.0 has")
