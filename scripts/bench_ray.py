"""Issue 9's benchmark: the same job in one process and over a local Ray cluster with 1 and 2
actors, plus Ray's fixed cost (start-up time, memory of an idle cluster).

    python scripts/bench_ray.py OUT_DIR [--rows 512] [--max-tokens 16]

Each run is a fresh `batchrun run` process on the demo model (wall time includes starting
Ray, the actors and loading the model in each). Needs `pip install 'batchrun[ray]'`.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


def ray_rss_mb(driver_pid: int) -> float:
    """Resident memory of the Ray processes on this machine (not the driver's own)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == driver_pid:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            status = (entry / "status").read_text()
        except OSError:
            continue
        if b"ray" not in cmdline:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def fixed_cost() -> dict:
    import ray

    os.environ.update(LOOPBACK_ENV)
    before = ray_rss_mb(os.getpid())
    start = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    startup = time.perf_counter() - start
    time.sleep(5)  # let the helper processes settle
    idle = ray_rss_mb(os.getpid()) - before
    ray.shutdown()
    return {"startup_s": startup, "idle_cluster_rss_mb": idle}


def job(out: Path, rows: int, max_tokens: int) -> Path:
    path = out / "rows.jsonl"
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"custom_id": f"r{i}", "max_tokens": max_tokens,
                                "prompt": f"Review {i}: the kettle is sturdy and quiet."}) + "\n")
    return path


def run(rows_path: Path, job_dir: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "batchrun", "run", str(rows_path), "--job-dir", str(job_dir),
           "--quiet", "--restart", "--no-prefix-cache", *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, env={**os.environ, **LOOPBACK_ENV}, capture_output=True,
                          text=True, check=True)
    wall = time.perf_counter() - start
    report = json.loads((job_dir / "report.json").read_text())
    return {"args": extra, "wall_s": wall, "rows": report["rows_done"],
            "rows_per_s": report["rows_done"] / wall, "workers": report.get("workers"),
            "stderr_tail": done.stderr[-400:]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = job(args.out, args.rows, args.max_tokens)
    results = {"fixed": fixed_cost(), "runs": []}
    print(json.dumps(results["fixed"]), flush=True)
    configs = [("one process", []),
               ("ray, 1 actor", ["--ray", "local", "--ray-actors", "1"]),
               ("ray, 2 actors", ["--ray", "local", "--ray-actors", "2",
                                  "--ray-num-cpus", "0.5"])]
    for name, extra in configs:
        r = run(rows_path, args.out / name.replace(" ", "-").replace(",", ""), extra)
        r["name"] = name
        results["runs"].append(r)
        print(f"{name:14} {r['wall_s']:7.1f} s  {r['rows_per_s']:6.1f} rows/s", flush=True)
    (args.out / "ray.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
