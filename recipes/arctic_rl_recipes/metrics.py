"""Where a run's metrics go: a JSONL file, TensorBoard, and a PNG plot at the end."""

from __future__ import annotations

import json
import os
from typing import Any

PHASES = ("generate", "reward", "log_probs", "fwd_bwd", "step", "rollout_wait", "sync")
"""Seconds of a GRPO step, in the order they run. `generate`: waiting for this step's rollouts; `rollout_wait`
(pipelined, on a sampler that cannot take weights under a rollout in flight): waiting for it before the sync."""


class MetricsLog:
    """One JSON object per row in `metrics.jsonl`; every numeric field also goes to TensorBoard."""

    def __init__(self, output_dir: str, *, resume_after_step: int | None = None):
        from tensorboard.summary import Writer

        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.tensorboard_dir = os.path.join(output_dir, "tensorboard")
        kept = []
        if resume_after_step is not None and os.path.exists(self.path):
            # Rows written after the checkpoint we resume from describe steps that will run again.
            kept = [row for row in self.rows() if row.get("step", 0) <= resume_after_step]
        with open(self.path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in kept)
        self._file = open(self.path, "a")
        self._tb = Writer(self.tensorboard_dir)

    def rows(self) -> list[dict[str, Any]]:
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        step = int(row.get("step", 0))
        prefix = row.get("kind", "train")
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                self._tb.add_scalar(f"{prefix}/{key}", float(value), step=step)
        self._tb.flush()

    def close(self) -> None:
        self._file.close()
        self._tb.close()


def plot_run(rows: list[dict[str, Any]], path: str) -> str:
    """Reward and accuracy (train and held-out) over steps, and seconds per phase per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    if train:
        steps = [r["step"] for r in train]
        top.plot(steps, [r["reward"] for r in train], label="train reward")
        top.plot(steps, [r["accuracy"] for r in train], label="train accuracy", alpha=0.6)
    if evals:
        top.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-", label="held-out accuracy")
    top.set_ylabel("reward / accuracy")
    top.set_ylim(-0.02, 1.02)
    top.legend(loc="upper left")
    if train:
        bottom_acc = [0.0] * len(train)
        for phase in PHASES:
            values = [r.get(f"time/{phase}", 0.0) for r in train]
            bottom.bar(steps, values, bottom=bottom_acc, label=phase.replace("_", " "), width=0.9)
            bottom_acc = [a + v for a, v in zip(bottom_acc, values)]
    bottom.set_xlabel("GRPO step")
    bottom.set_ylabel("seconds")
    bottom.legend(loc="upper left", ncols=3, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
