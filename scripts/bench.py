"""batchrun's benchmark harness: one workload's runs on one device, variants interleaved, after a
throwaway run, everything under OUT with the date, commit and device it ran on.

    python scripts/bench.py WORKLOAD OUT [--device cpu|gpu] [--model PATH] [--reps N]
        [--repeat N] [--rows N] [--systems A,B] [--workloads A,B] [--cold]
        [--variant NAME:VAR=VALUE[,VAR=VALUE]]... [--against PATCH] [--no-throwaway] [-- ARGS]

Workloads (the scripts beside this one do the measuring; ARGS after `--` go to them):
  speculation     bench_speculate.py: essays and extract (--reps, 15 by default), then tail and
                  full (15 each): the four figures of BENCHMARKS.md, "Speculative decoding"
  labeling        warm 512-row labeling jobs under a ~1.5k-token instruction, 8 new tokens, each
                  a fresh traced `batchrun run` (trace_job.py) on one prefix-cache folder;
                  --cold gives every job an empty one ("Labeling throughput")
  labeling-peers  bench_labeling.py: whole processes, batchrun cold and warm against the
                  hand-cached mlx-lm peer and plain batch_generate ("Labeling throughput")
  decode          bench_decode_job.py: the 1,024-row decode job as `batchrun run` with default
                  flags against batch_generate in its own process ("Decode throughput")
  decode-peers    bench_gpu.py: batch_generate and transformers in one process, at their best
                  batch ("Decode throughput")
  kernels         check_decode_kernel.py and check_prefix_kernel.py --quick: correctness
                  against the references and ms a layer ("Shared-prefix attention")
  sweep           sweep_flags.py: default flags against others, labeling and decode jobs
  engine          `batchrun bench` on the demo and 150m shapes, short and mixed512 prompts:
                  sequential mlx-lm, batch_generate, batchrun ("CPU ratios")
  tests           the speculation tests (tests/test_speculate.py) on this device

--device: gpu when nvidia-smi is found. On a GPU the model is the 1B Llama shape in bf16 with
random weights, built at /tmp/l1b when absent; on the CPU the demo model. The speculation
workload always uses the trained demo pair in sample_data.

A/B runs: each --variant runs with its environment settings; --against PATCH adds a `before`
variant run in a copy of this tree with PATCH (a diff of batchrun/, e.g. `git diff A B --
batchrun`) taken back out. Variants alternate, --repeat times each (labeling jobs: --reps
each), and the job walls' medians are printed at the end. Results: OUT/VARIANT-I/ per run,
OUT/runs.jsonl (a line a run: command, settings, exit status, seconds, a labeling job's
report) and OUT/meta.json (date, commit, device, the command line).

On the lent GPU, after the set-up line of shared/gpu/README.md:
    python3 scripts/bench.py speculation $OUT
    python3 scripts/bench.py labeling $OUT --variant nographs:MLX_USE_CUDA_GRAPHS=0
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
GPU_MODEL = Path("/tmp/l1b")
SWEEP_FLAGS = {
    "labeling": ["", "--max-concurrency 256", "--max-concurrency 2048",
                 "--prefill-batch-size 64", "--prefill-batch-size 512"],
    "decode": ["", "--max-concurrency 512", "--max-concurrency 2048",
               "--prefill-batch-size 64", "--prefill-batch-size 256"],
}
WORKLOADS = ("speculation", "labeling", "labeling-peers", "decode", "decode-peers", "kernels",
             "sweep", "engine", "tests")


def script(name: str) -> str:
    return f"scripts/{name}"


def commands(a: argparse.Namespace, out: Path) -> list[list[str]]:
    """The commands of one run of the workload, writing under `out` (run from a tree's root)."""
    gpu = a.device == "gpu"
    w, extra = a.workload, a.extra
    if w == "speculation":
        first = [PY, script("bench_speculate.py"), str(out / "spec"), "--reps", str(a.reps or 15),
                 "--workloads", a.workloads or "essays,extract", *extra]
        if a.workloads:
            return [first]
        return [first, [PY, script("bench_speculate.py"), str(out / "tail"),
                        "--workloads", "tail:15,full:15", *extra]]
    if w == "labeling":
        cache = out / "cache" if a.cold else a.out / "cache"
        return [[PY, script("trace_job.py"), "run", str(a.out / "rows.jsonl"), "--quiet",
                 "--max-tokens", "8" if gpu else "4", "--model", a.model,
                 "--job-dir", str(out / "job"), "--cache-dir", str(cache), *extra]]
    if w == "labeling-peers":
        sizes = ["--instruction", "1000", "--max-tokens", "8", "--concurrency", "512"]
        sizes = sizes if gpu else []  # the CPU: the script's own (120 rows, 1,300 words, 4)
        return [[PY, script("bench_labeling.py"), str(out), "--model", a.model,
                 "--rows", str(a.rows or (512 if gpu else 120)), *sizes,
                 "--systems", a.systems or "batchrun,peer,batch_generate", *extra]]
    if w == "decode":
        return [[PY, script("bench_decode_job.py"), str(out), "--model", a.model,
                 "--rows", str(a.rows or 1024), "--concurrency", "1024",
                 "--systems", a.systems or "batchrun,batchrun,batch_generate", *extra]]
    if w == "decode-peers":
        return [[PY, script("bench_gpu.py"), str(out), "--rows", str(a.rows or 1024),
                 "--concurrency", "1024", "--systems", a.systems or "batch_generate,hf", *extra]]
    if w == "kernels":
        return [[PY, script("check_decode_kernel.py"), str(out / "decode"), "--quick", *extra],
                [PY, script("check_prefix_kernel.py"), str(out / "prefix"), "--quick", *extra]]
    if w == "sweep":
        rows = {"labeling": ["--rows", "512", "--instruction", "1000", "--max-tokens", "8"]
                if gpu else [], "decode": ["--rows", "1024", "--max-tokens", "256"]}
        kinds = ("labeling", "decode") if gpu else ("labeling",)  # on the CPU: its own flag sets
        return [[PY, script("sweep_flags.py"), str(out / kind), "--model", a.model,
                 "--workload", kind, "--reps", str(a.reps or 2), *rows[kind],
                 *(["--flags", *SWEEP_FLAGS[kind]] if gpu else []), *extra]
                for kind in kinds]
    if w == "engine":
        return [[PY, "-m", "batchrun", "bench", "--shape", shape, "--workload", load,
                 "--rows", str(a.rows or 64), "--max-tokens", "64", "--max-concurrency", "64",
                 "--systems", a.systems or "sequential,batch_generate,batchrun",
                 "--json", str(out / f"engine-{shape}-{load}.json"), *extra]
                for shape in ("demo", "150m") for load in ("short", "mixed512")]
    return [[PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_speculate.py",
             *extra]]


def throwaway(a: argparse.Namespace, tree: Path, env: dict) -> None:
    """A first run that meets the workload's shapes (a machine's first process compiles
    kernels) and, for labeling, fills the shared prefix cache."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-throwaway-"))
    if a.workload == "speculation":
        cmd = [PY, script("bench_speculate.py"), str(scratch), "--reps", "1",
               "--workloads", "essays"]
    elif a.workload == "labeling":
        cmd = commands(a, scratch)[0]
        cmd[cmd.index("--cache-dir") + 1] = str(a.out / "cache")
    elif a.workload == "decode":
        cmd = [PY, script("bench_decode_job.py"), str(scratch), "--model", a.model,
               "--rows", str(a.rows or 1024), "--systems", "batchrun"]
    else:
        return
    subprocess.run(cmd, cwd=tree, env=env, capture_output=True)
    shutil.rmtree(scratch, ignore_errors=True)


def variants(a: argparse.Namespace) -> list[tuple[str, dict, Path]]:
    """(name, environment settings, tree to run in) for every variant, in turn order."""
    found = []
    for spec in a.variant or ["default:"]:
        name, _, settings = spec.partition(":")
        env = dict(s.split("=", 1) for s in settings.split(",") if s)
        found.append((name, env, ROOT))
    if a.against:
        before = Path(tempfile.mkdtemp(prefix="bench-before-"))
        for part in ("batchrun", "scripts", "sample_data", "tests", "pyproject.toml"):
            src = ROOT / part
            copy = shutil.copytree if src.is_dir() else shutil.copy2
            copy(src, before / part)
        with open(a.against) as patch:
            subprocess.run(["patch", "-s", "-R", "-p1"], cwd=before, stdin=patch, check=True)
        found.insert(0, ("before", {}, before))
    return found


def describe_device(device: str) -> str:
    if device == "gpu":
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                 "--format=csv,noheader"]
        gpus = subprocess.run(query, capture_output=True, text=True).stdout.strip()
        return f"{gpus}; {os.cpu_count()} CPU cores"
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else model
    return f"{model}, {os.cpu_count()} cores, {platform.system()}"


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout
    except FileNotFoundError:  # the lent GPU has no git, nor the tree's .git: BENCH_COMMIT
        return ""


def meta(a: argparse.Namespace) -> dict:
    commit = git("rev-parse", "--short", "HEAD").strip() or os.environ.get("BENCH_COMMIT",
                                                                           "unknown")
    dirty = git("status", "--porcelain", "--", "batchrun", "scripts").strip()
    return {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit + (" (with local changes)" if dirty else ""),
            "device": describe_device(a.device), "python": platform.python_version(),
            "command": " ".join(sys.argv)}


def job_report(out: Path) -> dict:
    """A labeling job's figures from its report, if it wrote one."""
    report = out / "job" / "report.json"
    if not report.exists():
        return {}
    run = json.loads(report.read_text())["runs"][-1]
    return {"job_wall_s": run["wall_s"], "rows_per_s": round(run["rows_done"] / run["wall_s"]),
            "peak_gib": round(run.get("peak_memory_bytes", 0) / 2**30, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=WORKLOADS)
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", choices=("cpu", "gpu"))
    ap.add_argument("--model", help="the model folder (default: per device, see above)")
    ap.add_argument("--reps", type=int, help="repetitions inside a run, or labeling jobs")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each variant, alternating")
    ap.add_argument("--rows", type=int)
    ap.add_argument("--systems", help="the workload script's systems")
    ap.add_argument("--workloads", help="bench_speculate.py's workloads (speculation)")
    ap.add_argument("--cold", action="store_true", help="labeling: an empty cache each job")
    ap.add_argument("--variant", action="append", help="NAME:VAR=VALUE[,VAR=VALUE]")
    ap.add_argument("--against", type=Path, help="a patch of batchrun/ to run without, too")
    ap.add_argument("--no-throwaway", action="store_true")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    a.extra = argv[cut + 1:]  # the workload script's own flags
    a.device = a.device or ("gpu" if shutil.which("nvidia-smi") else "cpu")
    a.model = a.model or str(GPU_MODEL if a.device == "gpu"
                             else ROOT / "sample_data" / "demo-model")
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "meta.json").write_text(json.dumps(meta(a), indent=2) + "\n")
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if a.workload in ("labeling", "labeling-peers", "decode", "sweep") and a.device == "gpu" \
            and not (Path(a.model) / "config.json").exists():
        subprocess.run([PY, "-m", "tools.demo_models.build", a.model, "--shape", "llama-1b"],
                       cwd=ROOT, check=True, capture_output=True)
    if a.workload == "labeling":
        rows = 512 if a.device == "gpu" else 120
        subprocess.run([PY, "-c", "import sys; sys.path.insert(0, 'scripts'); "
                        "from pathlib import Path; from bench_labeling import write_rows; "
                        f"write_rows(Path('{a.out / 'rows.jsonl'}'), {a.rows or rows}, 1000)"],
                       cwd=ROOT, check=True)
    runs = variants(a)
    if not a.no_throwaway:
        for _, env, tree in runs:
            throwaway(a, tree, {**base_env, **env})
    repeat = (a.reps or 4) if a.workload == "labeling" else a.repeat
    walls: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    with open(a.out / "runs.jsonl", "a") as log:
        for i in range(1, repeat + 1):
            for name, env, tree in runs:
                out = a.out / f"{name}-{i}"
                out.mkdir(exist_ok=True)
                for cmd in commands(a, out):
                    start = time.perf_counter()
                    with open(out / "output.txt", "a") as printed:
                        rc = subprocess.run(cmd, cwd=tree, env={**base_env, **env},
                                            stdout=printed, stderr=subprocess.STDOUT).returncode
                    line = {"variant": name, "run": i, "env": env, "command": " ".join(cmd),
                            **({"tree": str(tree)} if tree != ROOT else {}),
                            "rc": rc, "seconds": round(time.perf_counter() - start, 3),
                            **job_report(out)}
                    log.write(json.dumps(line) + "\n")
                    log.flush()
                    if "job_wall_s" in line:
                        walls[name].append(line["job_wall_s"])
                    print(json.dumps(line), flush=True)
                (out / "job" / "results.jsonl").unlink(missing_ok=True)  # rows' text: not needed
    for name, values in walls.items():
        if values:
            print(f"{name}: job walls {' / '.join(f'{v:.3f}' for v in values)} s, "
                  f"median {statistics.median(values):.3f} s")


if __name__ == "__main__":
    main()
