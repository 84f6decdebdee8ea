"""A pool's /metrics: each replica's vLLM families (every engine calls itself engine 0), relabelled by replica and
merged into one exposition that Prometheus' own parser reads back."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from arctic_rl_core.samplers.engine_metrics import relabelled, served_as


def _engine_exposition(running: int, tokens: int, latencies: list[float], blocks: int) -> str:
    """What one vLLM engine's process exposes (its families as vLLM declares them, engine label 0)."""
    registry = CollectorRegistry()
    labels = {"model_name": "tiny", "engine": "0"}
    Gauge("vllm:num_requests_running", "running", list(labels), registry=registry).labels(**labels).set(running)
    Counter("vllm:generation_tokens", "tokens", list(labels), registry=registry).labels(**labels).inc(tokens)
    histogram = Histogram("vllm:e2e_request_latency_seconds", "latency", list(labels), buckets=(0.5, 2.0),
                          registry=registry).labels(**labels)
    for latency in latencies:
        histogram.observe(latency)
    info = {"engine": "0", "block_size": "16", "num_gpu_blocks": str(blocks)}
    Gauge("vllm:cache_config_info", "cache config", list(info), registry=registry).labels(**info).set(1)
    return generate_latest(registry).decode()


def test_replicas_metrics_are_one_exposition_with_an_engine_label_each():
    merged = relabelled({"0": _engine_exposition(3, 40, [0.1, 1.0], 100),
                         "1": _engine_exposition(5, 70, [3.0], 200)})
    families = list(text_string_to_metric_families(merged))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # one family per name, both engines' samples in it
    by_name = {f.name: f for f in families}

    def value(family, engine, sample_name=None, **labels):
        [v] = [s.value for s in by_name[family].samples if s.labels.get("engine") == engine
               and (sample_name is None or s.name == sample_name)
               and all(s.labels.get(k) == v for k, v in labels.items())]
        return v

    assert [value("vllm:num_requests_running", e) for e in "01"] == [3, 5]
    assert [value("vllm:generation_tokens", e, "vllm:generation_tokens_total") for e in "01"] == [40, 70]
    latency = "vllm:e2e_request_latency_seconds"
    assert [value(latency, "0", latency + "_bucket", le=le) for le in ("0.5", "2.0", "+Inf")] == [1, 2, 2]
    assert [value(latency, "1", latency + "_bucket", le=le) for le in ("0.5", "2.0", "+Inf")] == [0, 0, 1]
    assert value(latency, "1", latency + "_sum") == 3.0
    config = {s.labels["engine"]: s.labels for s in by_name["vllm:cache_config_info"].samples}
    assert config["0"]["num_gpu_blocks"] == "100" and config["1"]["num_gpu_blocks"] == "200"
    assert {s.labels.get("model_name") for f in families for s in f.samples
            if f.name != "vllm:cache_config_info"} == {"tiny"}  # other labels kept


def test_no_engine_metrics_is_an_empty_exposition():
    assert relabelled({}) == "" and relabelled({"0": ""}) == ""


def test_samples_name_the_model_as_the_server_serves_it():
    """vLLM's engine labels its samples with the path it loaded; `vllm serve` with `--served-model-name` labels them
    with that name, and so does ours. A family without a model label keeps its own labels."""
    served = served_as(_engine_exposition(3, 40, [0.1], 100).replace('model_name="tiny"', 'model_name="/models/x"'),
                       "policy")
    families = {f.name: f for f in text_string_to_metric_families(served)}
    assert {s.labels["model_name"] for name, f in families.items() if name != "vllm:cache_config_info"
            for s in f.samples} == {"policy"}
    assert all("model_name" not in s.labels for s in families["vllm:cache_config_info"].samples)
    assert [s.value for s in families["vllm:num_requests_running"].samples] == [3]
