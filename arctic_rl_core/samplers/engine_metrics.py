"""The engines' own Prometheus metrics, as `vllm serve`'s `/metrics` exposes them.

vLLM's engine records its `vllm:*` families (requests running and waiting, KV cache usage, `cache_config_info`,
token counters, latency histograms) into this process's Prometheus registry when its stats are on. Schedulers
that size their concurrency by an inference server's load (prime-rl's orchestrator) read exactly these names.
Every engine calls itself engine 0; a pool of replicas labels each replica's samples with its own index, as the
engines of one vLLM server are told apart.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "vllm:"


class _Families:
    """A registry's `collect`, over families already collected (what `generate_latest` writes out)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def vllm_exposition() -> str:
    """This process's `vllm:*` families in Prometheus' text format (empty where no engine recorded any)."""
    return generate_latest(_Families([f for f in REGISTRY.collect() if f.name.startswith(PREFIX)])).decode()


def _merged(expositions: list[tuple[str, Callable[[dict], dict]]]) -> str:
    """One exposition of several, each (text, its samples' labels -> their new labels), families of one name
    merged."""
    merged: dict[str, Metric] = {}
    for text, relabel in expositions:
        for family in text_string_to_metric_families(text):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            into.samples.extend(s._replace(labels=relabel(s.labels)) for s in family.samples)
    return generate_latest(_Families(list(merged.values()))).decode()


def relabelled(expositions: dict[str, str]) -> str:
    """One exposition of several engines' (by engine label): each sample's `engine` label set to its engine's."""
    return _merged([(text, lambda labels, engine=engine: {**labels, "engine": engine})
                    for engine, text in expositions.items()])


def served_as(exposition: str, model_name: str) -> str:
    """The samples' `model_name` label as the server names the model (`--served-model-name`), as `vllm serve`'s
    are; vLLM's engine labels them with the path it loaded."""
    return _merged([(exposition, lambda labels: {**labels, "model_name": model_name} if "model_name" in labels
                     else labels)])
