"""Issue 5's soak benchmark: a long job SIGKILLed every ~20 s and restarted until it is done.

    python scripts/soak.py OUT_DIR [--rows 20000] [--every 20]

Checks at the end that every input row appears exactly once (results + errors, in order) and
reports each restart's peak RSS (from /proc while it runs).
"""

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path


def write_rows(path: Path, n: int) -> None:
    rng = random.Random(0)
    words = ["kettle", "sturdy", "quiet", "tent", "bright", "slow", "great", "broken", "price"]
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
            if i % 97 == 0:
                f.write("{not json\n")  # error rows must survive the kills too
                continue
            f.write(json.dumps({"custom_id": f"s{i}", "prompt": f"Row {i}: {text}",
                                "max_tokens": 1 + i % 4}) + "\n")


def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--every", type=float, default=20.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path, job = args.out / "soak.jsonl", args.out / "job"
    write_rows(path, args.rows)
    cmd = [sys.executable, "-m", "batchrun", "run", str(path), "--job-dir", str(job),
           "--quiet", "--max-concurrency", "64"]
    restarts = []
    started = time.perf_counter()
    while True:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        t0, peak = time.perf_counter(), 0
        while proc.poll() is None and time.perf_counter() - t0 < args.every:
            peak = max(peak, rss_kb(proc.pid))
            time.sleep(0.2)
        killed = proc.poll() is None
        if killed:
            peak = max(peak, rss_kb(proc.pid))
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        state = json.loads((job / "state.json").read_text()) if (job / "state.json").exists() \
            else {"next_index": 0}
        restarts.append({"killed": killed, "seconds": round(time.perf_counter() - t0, 1),
                         "peak_rss_mb": round(peak / 1024, 1),
                         "rows_committed": state["next_index"]})
        print(restarts[-1], flush=True)
        if not killed:
            if proc.returncode != 0:
                sys.exit(f"the job failed: {proc.stderr.read().decode()[-2000:]}")
            break
    results = [json.loads(x) for x in (job / "results.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (job / "errors.jsonl").read_text().splitlines()]
    indices = sorted([r["index"] for r in results] + [e["index"] for e in errors])
    exactly_once = indices == list(range(args.rows))
    in_order = [r["index"] for r in results] == sorted(r["index"] for r in results)
    summary = {"date": time.strftime("%Y-%m-%d"), "rows": args.rows, "kills": sum(
        r["killed"] for r in restarts), "wall_s": round(time.perf_counter() - started, 1),
        "results": len(results), "errors": len(errors), "exactly_once": exactly_once,
        "in_order": in_order, "restarts": restarts}
    (args.out / "soak.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "restarts"}))
    if not (exactly_once and in_order):
        sys.exit("rows lost or duplicated")


if __name__ == "__main__":
    main()
