"""`arctic-rl bench frameworks`: each framework alone, and the same framework through Arctic RL with ZoRRo off and
on, on one GRPO workload (workload.py), the columns alternating round by round.

A column is one run of the framework's own documented GRPO entry point, in that column's environment, for S
steps; its runner (`<framework>_runner.py`, run by path with that environment's interpreter) prints the
framework's own per-step timings, loss, gradient norm and reward as JSON. Through Arctic RL each run gets a
fresh `arctic-rl serve` whose job matches the framework's settings, ZoRRo as the column says; alone, nothing of
Arctic RL is imported, and the patches that let the framework run on a CPU are listed (alone_patches.py).

`--placement disaggregated` gives generation and training cores of their own, as a framework's own deployment gives
its inference and its trainer GPUs of their own (`core_split`): the server's sampler runs in its own process
(`sampler.placement: subprocess`), and it and the framework's rollout processes are held to one half of the cores,
the server's trainer to the other. `shared` (the default) leaves every process on every core, and the sampler where
the job's default puts it.

Reported per framework, shape and column: medians of steps 2 and later (the first warms engines up) per phase,
over all rounds; each phase's ratio alone / ZoRRo off and off / on, beside ZoRRo's dedup bound for the shape;
the first step's loss and gradient norm per column; the reward per step. Not run in CI (minutes per run).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from arctic_rl_bench.frameworks.workload import MODEL, SHAPES, shape_json

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
COLUMNS = ("alone", "zorro-off", "zorro-on")
PLACEMENTS = ("shared", "disaggregated")


@dataclass(frozen=True)
class Framework:
    name: str
    phases: tuple[str, ...]
    """The framework's own per-step timings the runner reports, in step order; `step` is the whole step."""
    update_phases: tuple[str, ...]
    """Those ZoRRo shortens (log-probs and the update): their sum is held against the dedup bound."""
    runner: str | None = None
    arctic_env: str | None = None
    """A script (from the repository root) that builds the framework's environment with the adapter and prints its
    interpreter's path."""
    alone_env: str | None = None
    """The same for the framework with its own engines and nothing of Arctic RL."""
    job: dict = field(default_factory=dict)
    """The server's job beside the model and ZoRRo: what matches the framework's own settings."""
    alone_not_run: str | None = None
    """Why the framework cannot run alone here."""
    modes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per mode, the framework's settings every column runs with: `sync`, its synchronous trainer (generate, then
    train); `async`, its own asynchronous one (generation runs on while it trains)."""
    mode_not_run: dict[str, str] = field(default_factory=dict)
    """Why the framework has no such mode."""
    dtypes: tuple[str, ...] = ("float32",)
    """The training dtypes its runner's alone column is set up for (its `--dtype`); through Arctic RL the job's
    engine computes in the same one. Generation stays fp32 in every column."""
    placements: tuple[str, ...] = ("shared",)
    """How its runner can place the framework's processes (PLACEMENTS): `disaggregated` needs a runner that holds
    its rollout processes to generation's cores (`--rollout-cpus`) and its trainer process to the trainer's."""
    diagnostics: tuple[str, ...] = ()
    """Diagnostic patches its runner's alone column takes (`--alone-diagnostic`): the framework with a CPU fallback
    replaced by what its GPU path computes, to measure that fallback's cost. A run with one is not the framework alone."""


FRAMEWORKS = {
    "verl": Framework(
        "verl", ("gen", "old_log_prob", "update_actor", "update_weights", "step"), ("old_log_prob", "update_actor"),
        runner="verl_runner.py", arctic_env="benchmarks/arctic_rl_bench/frameworks/envs/verl_arctic.sh",
        alone_env="benchmarks/arctic_rl_bench/frameworks/envs/verl_alone.sh",
        # verl's optimizer defaults (AdamW, weight decay 0.01, clip 1.0): the adapter refuses a job that differs.
        job={"engine": {"zero_stage": 0, "learning_rate": 1e-5, "weight_decay": 0.01},
             "sampler": {"name": "vllm", "kv_cache_mb": 512, "max_model_len": MODEL["max_positions"]}},
        # verl's v1 trainer, colocated: generation of the next batch (a partial rollout across the weight update) while
        # the actor trains; verl's own staleness bound (8 versions) is never reached at one step ahead.
        modes={"sync": (), "async": ("trainer.v1.trainer_mode=colocate_async",)},
        dtypes=("float32", "bfloat16"), diagnostics=("D1", "D2")),
    "skyrl": Framework(
        "skyrl", ("gen", "old_log_prob", "update_actor", "update_weights", "step"), ("old_log_prob", "update_actor"),
        runner="skyrl_runner.py", arctic_env="benchmarks/arctic_rl_bench/frameworks/envs/skyrl_arctic.sh",
        alone_env="benchmarks/arctic_rl_bench/frameworks/envs/skyrl_alone.sh",
        # SkyRL's optimizer defaults, which its adapter checks the job against.
        job={"engine": {"zero_stage": 0, "learning_rate": 1e-5, "weight_decay": 0.01, "betas": [0.9, 0.999],
                        "grad_clip": 1.0},
             "sampler": {"name": "vllm", "kv_cache_mb": 512, "max_model_len": MODEL["max_positions"]}},
        # SkyRL's fully async trainer: one step of staleness, as verl's and prime-rl's; it requires a loss anchored
        # on the sampler's log-probs (no old policy is kept), so the async columns train CISPO against the rollout.
        modes={"sync": (), "async": ("trainer.fully_async.enabled=true", "trainer.fully_async.max_staleness_steps=1",
                                     "trainer.fully_async.num_parallel_generation_workers=8", "generator.batched=false",
                                     "trainer.algorithm.policy_loss_type=cispo",
                                     "trainer.algorithm.cispo.cispo_anchor=rollout")},
        dtypes=("float32", "bfloat16")),
    "primerl": Framework(
        # The trainer's phases (prime-rl's orchestrator generates ahead of it; `wait` is what it did not hide).
        "primerl", ("wait", "update_actor", "update_weights", "step"), ("update_actor",),
        runner="primerl_runner.py", arctic_env="benchmarks/arctic_rl_bench/frameworks/envs/primerl_arctic.sh",
        # prime-rl's optimizer defaults (AdamW, weight decay 0.01, betas 0.9/0.999, clip 1.0), which its adapter
        # checks the job against.
        job={"engine": {"zero_stage": 0, "learning_rate": 1e-5, "weight_decay": 0.01, "betas": [0.9, 0.999],
                        "grad_clip": 1.0},
             "sampler": {"name": "vllm", "kv_cache_mb": 512, "max_model_len": MODEL["max_positions"]}},
        alone_not_run="prime-rl 0.8's trainer has no CPU path: its attention is flash-attn's varlen kernel only "
                      "(models/layers/attn.py; packed rows need it) and its step places tensors on 'cuda' in about 20 "
                      "places (rl/train.py, trainer/utils.py, model.py), with Muon imported from the git-only dion",
        # The orchestrator generates the next step's rollouts while the trainer trains, one step stale at most.
        modes={"async": ("max_off_policy_steps=1",)},
        # prime-rl's own deployment: inference servers and the trainer on GPUs of their own.
        placements=("shared", "disaggregated"),
        mode_not_run={"sync": "prime-rl 0.8's orchestrator has no synchronous mode: at max_off_policy_steps = 0 it "
                              "still generates while the trainer trains and drops what each update makes stale "
                              "(measured here: steps of 22.9 s ZoRRo off and 15.0 s on, against 13.1 and 9.2 s at 1)"}),
}


def environment(script: str) -> str:
    """The interpreter of the environment `script` builds (once; later calls reuse it)."""
    out = subprocess.run(["bash", script], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{script} failed:\n{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1]


def job(framework: Framework, model: str, zorro: bool, dtype: str, placement: str = "shared") -> dict:
    """The server's job for a column through Arctic RL: the engine trains in `dtype`; the sampler generates in fp32,
    as every column's vLLM does, where the job's default puts it (`shared`), or in a process of its own
    (`disaggregated`, held to its cores)."""
    spec = {**framework.job, "model_path": model, "zorro": {"enable": zorro}}
    spec["engine"] = {**spec.get("engine", {}), "dtype": dtype}
    spec["sampler"] = {**spec.get("sampler", {}), "dtype": "float32",
                       **({"placement": "subprocess"} if placement == "disaggregated" else {})}
    return spec


@dataclass(frozen=True)
class CoreSplit:
    trainer: tuple[int, ...]
    rollout: tuple[int, ...]
    """Generation's: the sampler's processes and the framework's rollout processes."""

    def server_env(self) -> dict[str, str]:
        """The server's trainer computes on as many threads as it has cores; vLLM binds its worker's threads to
        generation's cores itself (its `VLLM_CPU_OMP_THREADS_BIND`)."""
        return {"OMP_NUM_THREADS": str(len(self.trainer)), "VLLM_CPU_OMP_THREADS_BIND": cpu_list(self.rollout)}


def core_split(cpus) -> CoreSplit:
    """`--placement disaggregated` on a CPU host: generation on the lower half of the cores this process may use,
    the trainer on the rest (vLLM's own binding takes the lowest cores first)."""
    cpus = sorted(cpus)
    if len(cpus) < 2:
        raise ValueError(f"--placement disaggregated: needs 2 cores or more, this process may use {len(cpus)}")
    half = len(cpus) // 2
    return CoreSplit(trainer=tuple(cpus[half:]), rollout=tuple(cpus[:half]))


def cpu_list(cpus) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def process_cores(process) -> list[int]:
    """The cores any of a process's threads may run on (a psutil.Process)."""
    cores: set[int] = set()
    for thread in process.threads():
        try:
            cores |= os.sched_getaffinity(thread.id)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return sorted(cores)


def hold_threads(process, cpus) -> None:
    """Every thread of `process` to `cpus`: the threads it starts later inherit them from their starter."""
    for thread in process.threads():
        try:
            os.sched_setaffinity(thread.id, cpus)
        except ProcessLookupError:
            pass


def pin_server(pid: int, split: CoreSplit) -> dict[str, list[int]]:
    """A loaded server's own threads (the trainer's, with the routes') to the trainer's cores, and every process
    below it (vLLM's engine core and workers) to generation's, but one vLLM already bound within them, whose
    per-thread binding stays. Returns each process's cores as read back, by pid and name."""
    import psutil

    server = psutil.Process(pid)
    hold_threads(server, split.trainer)
    for child in server.children(recursive=True):
        if not set(process_cores(child)) <= set(split.rollout):
            hold_threads(child, split.rollout)
    return {f"{p.pid} {p.name()}": process_cores(p) for p in [server, *server.children(recursive=True)]}


@contextmanager
def arctic_server(spec: dict, work: Path, split: CoreSplit | None = None, placed: dict | None = None):
    """`split`: the server's trainer and sampler held to their cores once it has loaded its job; what each of its
    processes was held to goes into `placed`."""
    if str(ROOT) not in sys.path:  # the compat tests' server helper, from the repository
        sys.path.insert(0, str(ROOT))
    from compat_tests.main_server import serving

    if split is None:
        env, loaded = None, None
    else:
        env, loaded = split.server_env(), lambda proc: placed.update(pin_server(proc.pid, split))
    with serving(spec, work, env=env, on_loaded=loaded, fresh=True) as url:  # as a user starts it
        yield url


def run_column(framework: Framework, column: str, shape_name: str, python: str, model: str, work: Path,
               steps: int, overrides: list[str], dtype: str = "float32", diagnostics: tuple[str, ...] = (),
               placement: str = "shared") -> dict:
    shape = shape_json(SHAPES[shape_name])
    command = [python, str(HERE / framework.runner), "--column", "alone" if column == "alone" else "arctic",
               "--shape", shape, "--model", model, "--work", str(work / "run"), "--steps", str(steps),
               "--dtype", dtype]
    command += [f"--override={o}" for o in overrides]
    if column == "alone":
        command += [f"--diagnostic={d}" for d in diagnostics]

    def go(extra: list[str]) -> dict:
        proc = subprocess.run(command + extra, capture_output=True, text=True, cwd=ROOT)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if not lines:
            return {"error": (proc.stdout + proc.stderr)[-4000:]}
        return json.loads(lines[-1])

    if column == "alone":
        return go([])
    split = core_split(os.sched_getaffinity(0)) if placement == "disaggregated" else None
    placed: dict[str, list[int]] = {}
    if split is not None:
        command += ["--trainer-cpus", cpu_list(split.trainer), "--rollout-cpus", cpu_list(split.rollout)]
    (work / "server").mkdir(parents=True)
    try:
        with arctic_server(job(framework, model, column == "zorro-on", dtype, placement), work / "server", split,
                           placed) as url:
            out = go(["--url", url])
    except RuntimeError as err:  # the server did not start: this run fails, the bench goes on
        return {"error": str(err)}
    if split is not None:
        out["placement"] = {"trainer_cpus": list(split.trainer), "rollout_cpus": list(split.rollout),
                            "server_processes": placed}
    return out


def phase_medians(runs: list[dict], phases: tuple[str, ...], key: str = "seconds") -> dict[str, float | None]:
    """Per phase, the median over every run's steps 2 and later (`key`: the framework's timings, or the backend's
    share of them)."""
    out = {}
    for phase in phases:
        values = [s[key][phase] for r in runs for s in r.get("steps", [])[1:] if phase in s.get(key, {})]
        out[phase] = statistics.median(values) if values else None
    return out


def summarise(framework: Framework, shape_name: str, runs: dict[str, list[dict]], vocab: int) -> dict:
    """`vocab`: the built model's vocabulary (for the compute bound)."""
    shape = SHAPES[shape_name]
    columns = {c: phase_medians(rs, framework.phases) for c, rs in runs.items()}
    backend = {c: phase_medians(rs, framework.phases, "backend_seconds") for c, rs in runs.items() if c != "alone"}
    summary: dict = {"shape": shape_name, **asdict(shape), "dedup_bound": shape.dedup_bound(),
                     "compute_bound": shape.compute_bound(MODEL, vocab), "seconds": columns,
                     "backend_seconds": backend,
                     "first_step": {c: {k: rs[0]["steps"][0].get(k) for k in ("pg_loss", "grad_norm")}
                                    for c, rs in runs.items() if rs and rs[0].get("steps")},
                     "reward_per_step": {c: [[s.get("reward") for s in r.get("steps", [])] for r in rs]
                                         for c, rs in runs.items()},
                     "errors": {c: [r["error"] for r in rs if "error" in r] for c, rs in runs.items()}}

    def ratio(a: str, b: str, phases) -> float | None:
        if a not in columns or b not in columns:
            return None
        num = [columns[a][p] for p in phases]
        den = [columns[b][p] for p in phases]
        return None if None in num or None in den or not sum(den) else sum(num) / sum(den)

    summary["ratios"] = {
        "alone_over_zorro_off": {p: ratio("alone", "zorro-off", (p,)) for p in framework.phases},
        "zorro_off_over_on": {p: ratio("zorro-off", "zorro-on", (p,)) for p in framework.phases},
        "zorro_off_over_on_update": ratio("zorro-off", "zorro-on", framework.update_phases),
    }
    gain = summary["ratios"]["zorro_off_over_on_update"]
    bound = shape.dedup_bound()
    summary["zorro_fraction_of_bound"] = None if gain is None else gain / bound
    summary["zorro_fraction_of_compute_bound"] = None if gain is None else gain / summary["compute_bound"]
    # Near a bound of 1x the fraction says little (no gain at all reads 1 / bound): also the share of what was to gain.
    summary["zorro_share_of_gain"] = None if gain is None else (gain - 1) / (bound - 1)
    return summary


def run(names: list[str], shapes: list[str], columns: list[str], rounds: int, steps: int,
        alone_overrides: list[str], work: Path, log=print, mode: str = "sync", dtype: str = "float32",
        diagnostics: tuple[str, ...] = (), placement: str = "shared") -> dict:
    """`diagnostics`: patches for the alone column (Framework.diagnostics); a run with any is reported as such."""
    from arctic_rl_core.models.tiny import make_tiny_model

    for name in names:
        missing = [d for d in diagnostics if d not in FRAMEWORKS[name].diagnostics]
        if missing and "alone" in columns:
            raise ValueError(f"--alone-diagnostic {', '.join(missing)}: {name}'s runner takes "
                             f"{', '.join(FRAMEWORKS[name].diagnostics) or 'none'}")
    model = str(work / "model")
    make_tiny_model(MODEL["family"], model, layers=MODEL["layers"], hidden=MODEL["hidden"], heads=MODEL["heads"],
                    kv_heads=MODEL["kv_heads"], vocab_size=MODEL["vocab_size"], max_positions=MODEL["max_positions"],
                    shape={"intermediate": MODEL["intermediate"]})
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    result = {"benchmark": "frameworks", "model": MODEL, "mode": mode, "dtype": dtype, "placement": placement,
              "rounds": rounds, "steps": steps, "alone_diagnostics": list(diagnostics), "frameworks": {}}
    for name in names:
        framework = FRAMEWORKS[name]
        entry: dict = {"alone_not_run": framework.alone_not_run} if framework.alone_not_run else {}
        result["frameworks"][name] = entry
        entry["shapes"] = {}
        if mode not in framework.modes:
            entry["mode_not_run"] = framework.mode_not_run[mode]
            continue
        if dtype not in framework.dtypes:
            entry["dtype_not_run"] = (f"its runner's alone column is set up to train in {', '.join(framework.dtypes)} "
                                      f"only")
            continue
        if placement not in framework.placements:
            entry["placement_not_run"] = (f"its runner places the framework's processes {', '.join(framework.placements)}"
                                          " only (Framework.placements)")
            continue
        entry["mode_settings"] = list(framework.modes[mode])
        wanted = [c for c in columns if not (c == "alone" and framework.alone_not_run)]
        if placement != "shared" and "alone" in wanted:  # its own engines, which no runner places
            entry.setdefault("column_not_run", {})["alone"] = f"{placement} placement is set up through Arctic RL only"
            wanted.remove("alone")
        pythons = {}
        for column in wanted:
            script = framework.alone_env if column == "alone" else framework.arctic_env
            try:
                pythons[column] = environment(script)
            except RuntimeError as err:
                entry.setdefault("column_not_run", {})[column] = str(err)
        wanted = [c for c in wanted if c in pythons]
        for shape_name in shapes:
            runs: dict[str, list[dict]] = {c: [] for c in wanted}
            for r in range(rounds):
                order = wanted if r % 2 == 0 else wanted[::-1]
                for column in order:
                    folder = work / f"{name}-{shape_name}-{column}-{r}"
                    overrides = [*framework.modes[mode], *(alone_overrides if column == "alone" else [])]
                    out = run_column(framework, column, shape_name, pythons[column], model, folder, steps, overrides,
                                     dtype, diagnostics, placement=placement)
                    runs[column].append(out)
                    seconds = phase_medians([out], framework.phases)
                    log(f"{name} {shape_name} round {r} {column}: " + (
                        "failed, " + out["error"][-600:] if "error" in out else
                        " ".join(f"{p} {v:.2f}" for p, v in seconds.items() if v is not None)))
            entry["shapes"][shape_name] = {**summarise(framework, shape_name, runs, vocab), "runs": runs}
    return result


def table(result: dict) -> str:
    lines = []
    for name, entry in result["frameworks"].items():
        for shape_name, s in entry["shapes"].items():
            columns = list(s["seconds"])
            lines.append(f"\n{name} {result.get('mode', 'sync')}, {result.get('dtype', 'float32')}, "
                         f"{result.get('placement', 'shared')} cores, {shape_name} (P={s['prompt_tokens']}, R={s['response_tokens']}, "
                         f"G={s['samples_per_prompt']}, {s['prompts_per_step']} prompts a step); dedup bound "
                         f"{s['dedup_bound']:.2f}x in positions, {s['compute_bound']:.2f}x in multiply-adds")
            if result.get("alone_diagnostics") and "alone" in columns:
                lines.append(f"alone with the diagnostic patches {', '.join(result['alone_diagnostics'])}: not "
                             f"{name} as shipped (verl_alone_patches.DIAGNOSTICS)")
            lines.append("| phase | " + " | ".join(columns) + " | alone / ZoRRo off | ZoRRo off / on |")
            lines.append("|---" * (len(columns) + 3) + "|")
            for phase in next(iter(s["seconds"].values()), {}):
                cells = [f"{s['seconds'][c][phase]:.2f}" if s["seconds"][c][phase] is not None else "-" for c in columns]
                a, b = s["ratios"]["alone_over_zorro_off"][phase], s["ratios"]["zorro_off_over_on"][phase]
                lines.append(f"| {phase} | " + " | ".join(cells) + f" | {_x(a)} | {_x(b)} |")
            for column, shares in s["backend_seconds"].items():
                lines.append(f"{column}, the backend's share (engine calls; generation: first request to last answer): "
                             + " ".join(f"{p} {v:.2f}" for p, v in shares.items() if v is not None))
            fraction, share = s["zorro_fraction_of_bound"], s["zorro_share_of_gain"]
            of_compute = s["zorro_fraction_of_compute_bound"]
            lines.append(f"ZoRRo off / on on log-probs + update: {_x(s['ratios']['zorro_off_over_on_update'])} "
                         f"({'-' if fraction is None else f'{fraction:.2f}'} of the bound, "
                         f"{'-' if of_compute is None else f'{of_compute:.2f}'} of the compute bound, "
                         f"{'-' if share is None else f'{share:.2f}'} of the gain it allows); first step: "
                         + "; ".join(f"{c} loss {v['pg_loss']} grad norm {v['grad_norm']}" for c, v in s["first_step"].items()))
        if "mode_not_run" in entry:
            lines.append(f"{name} {result.get('mode', 'sync')}: not run: {entry['mode_not_run']}")
        if "dtype_not_run" in entry:
            lines.append(f"{name} in {result.get('dtype', 'float32')}: not run: {entry['dtype_not_run']}")
        if "placement_not_run" in entry:
            lines.append(f"{name} {result.get('placement')}: not run: {entry['placement_not_run']}")
        if "alone_not_run" in entry:
            lines.append(f"{name} alone: not run: {entry['alone_not_run']}")
    return "\n".join(lines)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def plot(result: dict, path: str) -> None:
    """Seconds per step and reward per step, per framework and shape, one line per column and round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(n, sh, s) for n, e in result["frameworks"].items() for sh, s in e.get("shapes", {}).items()]
    if not panels:
        return
    fig, axes = plt.subplots(2, len(panels), figsize=(5 * len(panels), 7), squeeze=False)
    for i, (name, shape_name, s) in enumerate(panels):
        for column, runs in s["runs"].items():
            for r, out in enumerate(runs):
                steps = out.get("steps", [])
                label = f"{column} r{r}"
                axes[0][i].plot([st["step"] for st in steps], [st["seconds"].get("step") for st in steps], label=label)
                axes[1][i].plot([st["step"] for st in steps], [st.get("reward") for st in steps], label=label)
        placed = "" if result.get("placement", "shared") == "shared" else f", {result['placement']} cores"
        axes[0][i].set_title(f"{name} {result.get('mode', 'sync')}, {shape_name}{placed}")
        axes[0][i].set_ylabel("seconds per step")
        axes[1][i].set_ylabel("reward")
        axes[1][i].set_xlabel("step")
        axes[0][i].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def add_arguments(p) -> None:
    p.add_argument("--framework", action="append", choices=sorted(FRAMEWORKS), help="default: every framework")
    p.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default: every shape")
    p.add_argument("--column", action="append", choices=COLUMNS, help="default: all three")
    p.add_argument("--mode", choices=("sync", "async"), default="sync",
                   help="each framework's synchronous trainer, or its own asynchronous one (Framework.modes)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the dtype every column trains in (generation stays fp32; Framework.dtypes)")
    p.add_argument("--placement", choices=PLACEMENTS, default="shared",
                   help="every process on every core, or generation and the trainer on cores of their own "
                        "(Framework.placements)")
    p.add_argument("--rounds", type=int, default=2, help="runs per column; the order alternates")
    p.add_argument("--steps", type=int, default=6, help="steps per run; the first is left out of the medians")
    p.add_argument("--alone-override", action="append", default=[],
                   help="a setting for the alone column (the tuning tried: docs/benchmarks.md)")
    p.add_argument("--alone-diagnostic", action="append", default=[], choices=sorted({d for f in FRAMEWORKS.values()
                                                                                       for d in f.diagnostics}),
                   help="a diagnostic patch for the alone column: the framework with one CPU fallback replaced by what "
                        "its GPU path computes (Framework.diagnostics); the result is labelled, not the framework alone")
    p.add_argument("--json", help="write the whole result (every run's steps) here")
    p.add_argument("--plot", help="write seconds and reward per step here (PNG)")
    p.add_argument("--work", help="keep the runs' folders here (default: a temporary one)")


def main(args) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = run(args.framework or list(FRAMEWORKS), args.shape or list(SHAPES), args.column or list(COLUMNS),
                     args.rounds, args.steps, args.alone_override, work, mode=args.mode, dtype=args.dtype,
                     diagnostics=tuple(args.alone_diagnostic), placement=args.placement)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    print(table(result))
    return 0
