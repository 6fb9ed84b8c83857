"""Where a `batchrun run` spends its first seconds: the command line's arguments, run with
timestamps (seconds since the job loop started) printed to stderr for each feeder take,
engine step, prefill call (rows, longest prompt), disk-cache read, shared-prefix build, a
cold prefix's computation and tail computation, the warm-up and the attention kernels'
compilation (a wait for the one started ahead, NVRTC's, the first-use check); and the
process's phases (imports, model loading, engine start, job preparation, the job loop, exit)
in seconds since the process started.

    python scripts/trace_job.py run ROWS.jsonl --model PATH --job-dir DIR [--cache-dir DIR] ...

Also when the feeder's threads finished building the first and the last row. With
TRACE_NO_WARM_UP=1 the engine's warm-up is skipped (to measure what it costs or saves); with
TRACE_PROFILE=PATH the job loop runs under cProfile and its statistics go to PATH; with
TRACE_BUILD_WORKERS=N the feeder builds rows on N threads; with TRACE_SWITCH_INTERVAL=S the
interpreter hands the GIL between threads every S seconds (sys.setswitchinterval).
"""

import time

PROCESS_START = time.perf_counter()

# isort: split
import atexit  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import batchrun  # noqa: E402, F401  (BLAS routing before MLX)
from batchrun.engine.load import keep_torch_out  # noqa: E402

if "--model" in sys.argv:  # as the command line does, before this script imports mlx-lm
    keep_torch_out(sys.argv[sys.argv.index("--model") + 1])
from batchrun.cache import disk  # noqa: E402
from batchrun.cli import entry  # noqa: E402
from batchrun.engine import engine  # noqa: E402
from batchrun.engine.backends import batch, text  # noqa: E402
from batchrun.engine.kernels import (  # noqa: E402
    decode_attention,
    nvrtc,
    prefix_attention,
    shared_prefix,
)
from batchrun.job import feeder, runner  # noqa: E402

generate = importlib.import_module("mlx_lm.generate")
T0 = [time.perf_counter()]
IN_LOOP = [False]


def process_mark(what: str) -> None:
    print(f"[process {time.perf_counter() - PROCESS_START:7.3f}s] {what}", file=sys.stderr,
          flush=True)


def phase(owner, name):
    """The call's start and length in seconds since the process started."""
    real = getattr(owner, name)

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            process_mark(f"{owner.__name__}.{name} from {start - PROCESS_START:.3f}s took "
                         f"{time.perf_counter() - start:.3f}s")

    setattr(owner, name, wrapper)


def traced(owner, name, describe=lambda args, result: ""):
    real = getattr(owner, name)

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = real(*args, **kwargs)
        end = time.perf_counter()
        print(f"{start - T0[0]:8.3f} {end - start:7.3f}s {owner.__name__}.{name} "
              f"{describe(args, result)}", file=sys.stderr, flush=True)
        return result

    setattr(owner, name, wrapper)


def loop_started(real):
    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        T0[0] = time.perf_counter()
        IN_LOOP[0] = True
        try:
            return real(*args, **kwargs)
        finally:
            IN_LOOP[0] = False
    return wrapper


runner.JobRunner._run = loop_started(runner.JobRunner._run)
process_mark("imports done")
atexit.register(process_mark, "exit handlers (after this: the interpreter's and MLX's teardown)")
phase(engine.Engine, "_load_model")
phase(engine.Engine, "__init__")
phase(runner.JobRunner, "prepare")
phase(runner.JobRunner, "_run")
phase(runner.JobRunner, "run")
traced(feeder.Feeder, "take", lambda a, r: f"{len(r)} rows")
traced(engine.Engine, "step", lambda a, r: f"running {len(a[0].scheduler.running)} "
       f"waiting {a[0].num_waiting} finished {len(r)}")
traced(disk.DiskCache, "load_many", lambda a, r: f"{len(a[1])} keys")
# A block file's read and check (on the reader threads) and its arrays made (on the loop's).
traced(disk.DiskCache, "_read", lambda a, r: type(r).__name__)
traced(disk.DiskCache, "_decode")
traced(engine.Engine, "read_ahead", lambda a, r: f"{len(a[1])} tokens")
traced(disk.DiskCache, "read_ahead",
       lambda a, r: f"{len(a[1])} keys, {len(a[0]._ahead)} reads started")
traced(shared_prefix.SharedPrefix, "from_blocks", lambda a, r: f"{r.length} tokens")
traced(text.TextBackend, "_extend", lambda a, r: f"{len(a[2])} tail tokens")
traced(text.TextBackend, "compute_prefix", lambda a, r: f"{a[2]} prefix tokens")
traced(text.TextBackend, "next", lambda a, r: f"prompt work {r[0]}, {len(r[1])} tokens")
traced(engine.Engine, "warm_up")
traced(nvrtc, "wait_ahead")
for kernel in (decode_attention, prefix_attention):
    traced(kernel, "_compiled")
    traced(kernel, "_verify")
traced(generate.PromptProcessingBatch, "prompt",
       lambda a, r: f"{len(a[1])} rows, longest {max(map(len, a[1]), default=0)} tokens")
# A wave's change in a job of several waves (the running batch's step, finished rows leaving,
# new rows made into a batch, split off and joined): what the gap before a wave's prefill is.
traced(generate.GenerationBatch, "next", lambda a, r: f"{len(a[0])} rows")
traced(generate.GenerationBatch, "extend", lambda a, r: f"{len(a[1])} rows joining")
traced(generate.GenerationBatch, "filter", lambda a, r: f"{len(a[1])} rows kept")
traced(generate.PromptProcessingBatch, "split", lambda a, r: f"{len(a[1])} rows")
traced(generate.PromptProcessingBatch, "extend")
traced(generate.BatchGenerator, "_make_batch", lambda a, r: f"{a[1]} rows")
# A wave's first decode step: mlx-lm's own (a new GenerationBatch runs one on creation), then
# batchrun's.
traced(generate.GenerationBatch, "__init__", lambda a, r: f"{len(a[0].uids)} rows")
traced(batch.LeanGenerationBatch, "_step", lambda a, r: f"{len(a[0].uids)} rows")
traced(batch.LeanGenerationBatch, "extend", lambda a, r: f"{len(a[1].uids)} rows joining")
if hasattr(batch.LeanGenerationBatch, "fresh"):  # freshly prefilled rows, made lean directly
    traced(batch.LeanGenerationBatch, "fresh", lambda a, r: f"{len(a[1])} rows")


def profiled(real, path: str):
    """The job loop under cProfile, its statistics written to `path` (pstats)."""
    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        import cProfile

        profile = cProfile.Profile()
        try:
            return profile.runcall(real, *args, **kwargs)
        finally:
            profile.dump_stats(path)
    return wrapper

BUILT: list[float] = []


def build_timed(real):
    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        result = real(*args, **kwargs)
        BUILT.append(time.perf_counter() - T0[0])
        return result
    return wrapper


def report_built() -> None:
    if BUILT:
        print(f"rows built by the feeder: {len(BUILT)}, the first at {min(BUILT):.3f}s, the "
              f"last at {max(BUILT):.3f}s", file=sys.stderr, flush=True)


GC: dict[int, list[float]] = {}  # generation -> the job loop's collections' seconds
_gc_start = [0.0]


def gc_timed(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    elif IN_LOOP[0]:
        GC.setdefault(info["generation"], []).append(time.perf_counter() - _gc_start[0])


def report_gc() -> None:
    for generation, times in sorted(GC.items()):
        print(f"garbage collections of generation {generation}: {len(times)}, "
              f"{sum(times):.3f}s in all, the longest {max(times):.3f}s", file=sys.stderr,
              flush=True)


gc.callbacks.append(gc_timed)
atexit.register(report_gc)
runner.JobRunner._build_task = build_timed(runner.JobRunner._build_task)
atexit.register(report_built)
if os.environ.get("TRACE_PROFILE"):
    runner.JobRunner._run = profiled(runner.JobRunner._run, os.environ["TRACE_PROFILE"])
if os.environ.get("TRACE_BUILD_WORKERS"):
    runner.BUILD_WORKERS = int(os.environ["TRACE_BUILD_WORKERS"])
if os.environ.get("TRACE_SWITCH_INTERVAL"):  # the interpreter's GIL switch interval, s
    sys.setswitchinterval(float(os.environ["TRACE_SWITCH_INTERVAL"]))
if os.environ.get("TRACE_NO_WARM_UP") == "1":
    engine.Engine.warm_up = lambda self, cpu_too=False: None

if __name__ == "__main__":
    sys.argv = ["batchrun", *sys.argv[1:]]
    entry()
