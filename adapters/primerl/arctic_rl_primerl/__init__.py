"""PrimeRL adapter: prime-rl 0.8.0's own orchestrator trains through Arctic RL, unmodified.

`arctic-rl-primerl-trainer` takes the place of prime-rl's trainer at the two boundaries the
orchestrator has with it: the micro-batches it sends (ZMQ or files) and the `STABLE` markers
it waits for. The orchestrator samples from the Arctic RL server's routes. See docs/primerl.md.
"""
