"""`arctic-rl bench server`: round-trip latency of an empty call, loopback payload throughput, and
the server's overhead on a realistic `fwd_bwd` request.

The server runs in its own process, as in deployment. Latency: medians of
GET /v1/health and of an empty wire-format POST. Throughput: a float32 tensor
payload POSTed to /v1/echo, which reads the body and decodes it (zero-copy) as
every route does. The client streams the body as the client library does
(header, then the tensor's own memory); `encode_s` is the time to lay it out.

`--fwd-bwd`: 64 sequences x 4,096 tokens (1,024 prompt, 3,072 response, with
advantages, behaviour log-probs and a loss mask), given as Python lists and
as numpy arrays (as an adapter hands over its tensors), to a backend whose
`fwd_bwd` only turns each sequence's fields into tensors (what the engine's
batching does first). The same call in process and through a loopback
server on a thread of this process; the difference is the server's overhead
(client validation and encoding, transfer, decoding, parsing, response).
"""

from __future__ import annotations

import abc
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


def fwd_bwd_overhead(sequences: int, prompt_len: int, response_len: int, repeats: int) -> dict:
    import torch

    from arctic_rl_bench.measure import median_seconds
    from arctic_rl_core.api import TrainingAPI
    from arctic_rl_core.client import ArcticRLClient
    from arctic_rl_core.engines.distributed import free_loopback_port
    from arctic_rl_core.server.app import ServerSettings
    from arctic_rl_core.server.run import ServerThread
    from arctic_rl_core.types import FwdBwdResult, Sequence

    class TensorizingBackend(TrainingAPI):
        """`fwd_bwd` parses its sequences and makes the tensors the engine's batching starts from; nothing else."""

        def fwd_bwd(self, sequences, loss, **options):
            seqs = [s if isinstance(s, Sequence) else Sequence.model_validate(s) for s in sequences]
            tokens = 0
            for s in seqs:
                tokens += torch.as_tensor(np.concatenate([np.asarray(s.prompt_ids), np.asarray(s.response_ids)])).numel()
                for name in ("advantages", "behaviour_logprobs", "loss_mask"):
                    torch.as_tensor(np.asarray(getattr(s, name), dtype=np.float32))
            fields = {"loss": 0.0, "metrics": {}, "num_tokens": tokens, "num_sequences": len(seqs), "weight_version": 0}
            if "computed_tokens" in FwdBwdResult.model_fields:  # so the same script measures older versions
                fields["computed_tokens"] = tokens
            return FwdBwdResult(**fields)

    def unused(self, *args, **kwargs):
        raise NotImplementedError("this benchmark's backend serves fwd_bwd only")

    for name in TensorizingBackend.__abstractmethods__ - {"fwd_bwd"}:
        setattr(TensorizingBackend, name, unused)
    abc.update_abstractmethods(TensorizingBackend)
    backend = TensorizingBackend()
    rng = np.random.default_rng(0)
    arrays = [{"prompt_ids": rng.integers(0, 150_000, prompt_len),
               "response_ids": rng.integers(0, 150_000, response_len),
               "group_id": i // 8,
               "advantages": np.full(response_len, rng.standard_normal(), dtype=np.float32),
               "behaviour_logprobs": -rng.random(response_len, dtype=np.float32),
               "loss_mask": np.ones(response_len, dtype=np.float32)} for i in range(sequences)]
    lists = [{k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in seq.items()} for seq in arrays]
    try:
        Sequence.model_validate(arrays[0])
        inputs = {"lists": lists, "arrays": arrays}
    except ValueError:  # versions before the types took arrays
        inputs = {"lists": lists}
    out = {"sequences": sequences, "tokens_per_sequence": prompt_len + response_len, "repeats": repeats}
    settings = ServerSettings(port=free_loopback_port(), max_request_bytes=2**31)
    with ServerThread(settings, config=None, backend_factory=lambda config: backend) as url:
        client = ArcticRLClient(url, retries=0)
        client.initialize({"model_path": "unused"})
        for kind, batch in inputs.items():
            result = client.fwd_bwd(batch, "grpo")
            assert result.num_tokens == sequences * (prompt_len + response_len)
            in_process_s, in_process_all = median_seconds(lambda: backend.fwd_bwd(batch, "grpo"), repeats)
            http_s, http_all = median_seconds(lambda: client.fwd_bwd(batch, "grpo"), repeats)
            out[kind] = {"in_process_s": in_process_s, "http_s": http_s, "overhead_s": http_s - in_process_s,
                         "raw_s": {"in_process": in_process_all, "http": http_all}}
        client.close()
    return out


def add_arguments(p) -> None:
    p.add_argument("--payload-mib", type=int, default=256)
    p.add_argument("--latency-calls", type=int, default=500)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--fwd-bwd", action="store_true",
                   help="instead: the server's overhead on a fwd_bwd of 64 sequences x 4,096 tokens")


def main(args) -> int:
    if args.fwd_bwd:
        result = fwd_bwd_overhead(64, 1024, 3072, args.repeats)
        if args.json:
            print(json.dumps(result))
        else:
            for kind in ("lists", "arrays"):
                r = result[kind]
                print(f"fwd_bwd of {result['sequences']} x {result['tokens_per_sequence']} tokens as {kind}: in process "
                      f"{r['in_process_s']:.3f} s, over HTTP {r['http_s']:.3f} s, "
                      f"server overhead {r['overhead_s']:.3f} s (medians of {result['repeats']})")
        return 0
    result = run(args.payload_mib, args.latency_calls, args.repeats)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"empty call: {result['empty_call_ms']:.2f} ms (health GET {result['health_ms']:.2f} ms)")
        print(f"{args.payload_mib} MiB payload: {result['payload_gb_per_s']:.2f} GB/s "
              f"({result['payload_with_encode_gb_per_s']:.2f} GB/s with client-side encoding)")
    return 0
