"""`arctic-rl bench server`: round-trip latency of an empty call and loopback payload throughput.

The server runs in its own process, as in deployment. Latency: medians of
GET /v1/health and of an empty wire-format POST. Throughput: a float32 tensor
payload POSTed to /v1/echo, which reads the body and decodes it (zero-copy) as
every route does. The client streams the body as the client library does
(header, then the tensor's own memory); `encode_s` is the time to lay it out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np


def run(payload_mib: int, latency_calls: int, repeats: int) -> dict:
    import httpx

    from arctic_rl_core import wire
    from arctic_rl_bench.measure import median_seconds
    from arctic_rl_core.client import ArcticRLClient
    from arctic_rl_core.engines.distributed import free_loopback_port

    port = free_loopback_port()
    cli = os.path.join(os.path.dirname(sys.executable), "arctic-rl")
    server = subprocess.Popen([cli, "serve", "--port", str(port), "--max-request-mb", str(payload_mib * 2 + 64)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        client = ArcticRLClient(f"http://127.0.0.1:{port}", retries=20, backoff_s=0.1)
        client.health()
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=None)
        empty = wire.encode({})
        def post(body):
            headers = {"Content-Type": wire.MEDIA_TYPE, "Content-Length": str(len(body))}
            response = http.post("/v1/echo", content=body, headers=headers)
            response.raise_for_status()
            return response

        health_s, _ = median_seconds(lambda: http.get("/v1/health").raise_for_status(), latency_calls, warmup=20)
        empty_s, _ = median_seconds(lambda: post(empty), latency_calls, warmup=20)
        tensor = np.random.default_rng(0).standard_normal(payload_mib * 2**20 // 4, dtype=np.float32)
        t0 = time.perf_counter()
        body = wire.encode_parts({"x": tensor})
        encode_s = time.perf_counter() - t0
        assert post(body).json()["bytes"] == len(body)
        send_s, all_s = median_seconds(lambda: post(body), repeats, warmup=1)
        gb = len(body) / 1e9
        client.shutdown()
        server.wait(timeout=30)
    finally:
        server.kill()
    return {
        "benchmark": "server",
        "health_ms": health_s * 1e3,
        "empty_call_ms": empty_s * 1e3,
        "latency_calls": latency_calls,
        "payload_mib": payload_mib,
        "payload_s": send_s,
        "payload_gb_per_s": gb / send_s,
        "encode_s": encode_s,
        "payload_with_encode_gb_per_s": gb / (send_s + encode_s),
        "raw_payload_s": all_s,
    }


def add_arguments(p) -> None:
    p.add_argument("--payload-mib", type=int, default=256)
    p.add_argument("--latency-calls", type=int, default=500)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    result = run(args.payload_mib, args.latency_calls, args.repeats)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"empty call: {result['empty_call_ms']:.2f} ms (health GET {result['health_ms']:.2f} ms)")
        print(f"{args.payload_mib} MiB payload: {result['payload_gb_per_s']:.2f} GB/s "
              f"({result['payload_with_encode_gb_per_s']:.2f} GB/s with client-side encoding)")
    return 0
