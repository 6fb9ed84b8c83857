"""`batchrun run --ray`: a job sharded over Ray actors keeps the single machine's guarantees.

The tests start (and stop) their own local Ray cluster, bound to 127.0.0.1 with a small object
store and no token auth; two CPU actors."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import pytest
import ray
from click.testing import CliRunner

from batchrun.cli import cli
from batchrun.engine.config import EngineConfig
from batchrun.engine.types import SamplingParams
from batchrun.job import ray_local
from batchrun.job.distributed import RayJobRunner
from batchrun.job.options import RayOptions
from batchrun.job.rows import RowOptions
from batchrun.job.spec import JobSpec
from batchrun.models import model_fingerprint, resolve

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="module")
def cluster():
    saved = {k: os.environ.get(k) for k in LOOPBACK_ENV}
    os.environ.update(LOOPBACK_ENV)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 2**20, _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def jsonl(path):
    return [orjson.loads(x) for x in Path(path).read_bytes().splitlines() if x.strip()]


def rows_file(path: Path, n: int) -> Path:
    lines = []
    for i in range(n):
        row = {"custom_id": f"r{i}", "prompt": f"Row {i}: the kettle is {'sturdy' * (i % 3)}.",
               "max_tokens": 3 + i % 4}
        lines.append(orjson.dumps(row))
    lines[5] = b'{"custom_id": "broken", "prompt": '  # invalid JSON: an error record
    lines[9] = orjson.dumps({"custom_id": "r1", "prompt": "a duplicate id"})
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_two_actors_give_the_single_process_output(cluster, tmp_path):
    rows = rows_file(tmp_path / "rows.jsonl", 70)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    for args in (["--job-dir", single], ["--job-dir", sharded, "--ray", "local",
                                         "--ray-actors", "2", "--ray-num-cpus", "0.5"]):
        result = CliRunner().invoke(cli, ["run", str(rows), "--quiet", *map(str, args)])
        assert result.exit_code == 0, result.output
    assert (sharded / "results.jsonl").read_bytes() == (single / "results.jsonl").read_bytes()
    assert (sharded / "errors.jsonl").read_bytes() == (single / "errors.jsonl").read_bytes()
    report = orjson.loads((sharded / "report.json").read_bytes())
    assert (report["rows_done"], report["rows_failed"]) == (68, 2)
    workers = report["workers"]
    assert len(workers) == 2 and all(w["slices"] > 0 for w in workers)
    assert sum(w["rows"] for w in workers) == 69  # the duplicate id is caught by the driver
    assert report["completion_tokens"] == sum(
        r["usage"]["completion_tokens"] for r in jsonl(sharded / "results.jsonl"))


def spec_for(rows: Path, job: Path) -> JobSpec:
    return JobSpec(rows, job, job / "results.jsonl", None,
                   RowOptions(SamplingParams(max_tokens=4)), quiet=True)


def test_a_killed_actor_has_its_slice_retried_and_every_row_is_done_once(cluster, tmp_path):
    rows = rows_file(tmp_path / "rows.jsonl", 120)
    killed = []

    def kill_one(runner, actors):
        if not killed:  # after the first slice comes back, kill the other actor mid-slice
            victim = next(w.actor for w in runner.workers if w.slices == 0)
            ray.kill(actors[victim])
            killed.append(victim)

    path = resolve(None)
    runner = RayJobRunner(spec_for(rows, tmp_path / "job"), None, "demo", path,
                          model_fingerprint(path), EngineConfig(max_concurrency=8), "ray",
                          RayOptions("local", actors=2, num_cpus=0.5, slice_rows=8),
                          on_result=kill_one)
    report = runner.run()
    assert killed
    indexes = [r["index"] for r in jsonl(tmp_path / "job" / "results.jsonl")]
    indexes += [e["index"] for e in jsonl(tmp_path / "job" / "errors.jsonl")]
    assert sorted(indexes) == list(range(120))
    dead = report["workers"][killed[0]]
    assert not dead["alive"] and dead["failed_slices"] >= 1
    assert report["workers"][1 - killed[0]]["rows"] >= 100  # the survivor did the rest


def deep_row(depth: int) -> bytes:
    """A valid row nested `depth` lists deep (orjson parses up to 1024)."""
    return b'{"custom_id": "deep", "prompt": "hi", "meta": ' + b"[" * depth + b"]" * depth + b"}"


def test_a_row_too_deep_to_send_to_a_worker_is_that_rows_error(cluster, tmp_path):
    rows = rows_file(tmp_path / "rows.jsonl", 20)
    lines = rows.read_bytes().splitlines()
    lines[3] = deep_row(600)
    rows.write_bytes(b"\n".join(lines) + b"\n")
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    for args in (["--job-dir", single], ["--job-dir", sharded, "--ray", "local",
                                         "--ray-actors", "2", "--ray-num-cpus", "0.5",
                                         "--ray-slice-rows", "8"]):
        result = CliRunner().invoke(cli, ["run", str(rows), "--quiet", *map(str, args)])
        assert result.exit_code == 0, result.output
    # Past the nesting limit the row is its own error, alike on one machine and on Ray (which
    # could not have pickled it to an actor); its slice's other rows run.
    for job in (single, sharded):
        errors = {e["index"]: e for e in jsonl(job / "errors.jsonl")}
        assert sorted(errors) == [3, 5, 9]  # the deep row, the broken line, the duplicate id
        assert errors[3]["custom_id"] == "deep" and errors[3]["line"] == 4
        assert errors[3]["error"]["code"] == "too_deep"
        done = [r["index"] for r in jsonl(job / "results.jsonl")]
        assert done == [i for i in range(20) if i not in (3, 5, 9)]


def descendants(pid: int) -> dict[int, float]:
    """The processes below `pid` now: pid -> start time (a pid may be reused later)."""
    import psutil

    try:
        return {p.pid: p.create_time() for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return {}


def still_running(procs: dict[int, float]) -> list[int]:
    import psutil

    alive = []
    for pid, started in procs.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.Error:
            pass
    return alive


def described(pids: list[int]) -> list[str]:
    import psutil

    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:120]}")
        except psutil.Error:
            out.append(f"{pid}: gone")
    return out


def run_until(cmd, env, results: Path, new_lines: int, sig: int | None, group: bool = False,
              ready=lambda: True):
    """Run the driver; once `new_lines` more results exist and `ready()`, send it `sig` (to its
    process group if `group`, as Ctrl-C in a terminal does). Returns (exit code, every process
    it started)."""
    before = len(results.read_bytes().splitlines()) if results.exists() else 0
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    started: dict[int, float] = {}
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline:
        started.update(descendants(proc.pid))
        if sig is not None and results.exists() \
                and len(results.read_bytes().splitlines()) >= before + new_lines and ready():
            break
        time.sleep(0.2)
    started.update(descendants(proc.pid))
    if sig is not None:
        assert proc.poll() is None, f"the run ended before the signal: {proc.stderr.read()}"
        (os.killpg if group else os.kill)(proc.pid, sig)
    code = proc.wait(timeout=180)
    assert code != 1, proc.stderr.read()
    return code, started


def test_a_local_cluster_ends_with_its_driver_and_a_killed_drivers_leftovers_are_reaped(
        tmp_path):
    n = 600  # enough work that each stop lands mid-run (finished rows land in big jumps)
    rows = rows_file(tmp_path / "rows.jsonl", n)
    job = tmp_path / "job"
    results = job / "results.jsonl"
    # Ray's temp base (short: socket paths), holding a stale address file the start must ignore.
    base = Path(tempfile.mkdtemp(prefix="br", dir="/tmp"))
    (base / "ray").mkdir()
    (base / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
    env = {**os.environ, **LOOPBACK_ENV, "RAY_TMPDIR": str(base)}
    cmd = [sys.executable, "-m", "batchrun", "run", str(rows), "--job-dir", str(job),
           "--quiet", "--ray", "local", "--ray-actors", "2", "--ray-num-cpus", "0.5",
           "--max-concurrency", "8", "--ray-slice-rows", "8"]
    killed: dict[int, float] = {}
    try:
        for sig, group in ((signal.SIGINT, True), (signal.SIGTERM, False)):
            code, started = run_until(cmd, env, results, 8, sig, group)
            assert code == 128 + sig  # stopped, progress saved (130, 143)
            assert len(started) >= 5  # the cluster: gcs, raylet, agents, workers...
            assert described(still_running(started)) == [], sig
            assert not (job / "ray.json").exists()
        def committed_once() -> bool:  # rows written are not yet committed; a commit is
            try:                           # what records the run (busy machines commit late)
                runs = orjson.loads((job / "report.json").read_bytes())["runs"]
            except (OSError, ValueError, KeyError):
                return False
            return len(runs) == 3

        code, killed = run_until(cmd, env, results, 8, signal.SIGKILL, ready=committed_once)
        assert code == -signal.SIGKILL
        done_before = len(results.read_bytes().splitlines())
        assert 0 < done_before < n - 2
        left = still_running(killed)  # Ray's agents and workers outlive a killed driver
        assert left
        record = orjson.loads((job / "ray.json").read_bytes())
        assert Path(record["temp_dir"]).parent == base
        code, started = run_until(cmd, env, results, 0, None)  # the resume runs to the end
        assert code == 0
        assert described(still_running(killed)) == []
        assert described(still_running(started)) == []
        assert not (job / "ray.json").exists() and list(base.glob(ray_local.PREFIX + "*")) == []
    finally:
        for pid in still_running(killed):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)
    indexes = [r["index"] for r in jsonl(results)] + [e["index"] for e in jsonl(
        job / "errors.jsonl")]
    assert sorted(indexes) == list(range(n))  # exactly once, none lost
    assert [r["index"] for r in jsonl(results)] == sorted(r["index"] for r in jsonl(results))
    report = orjson.loads((job / "report.json").read_bytes())
    # The killed run's last commit said "running"; the others ended as they were stopped.
    assert [r["status"] for r in report["runs"]] == ["interrupted", "interrupted", "running",
                                                     "completed"]


def sleeper(*args: str, title: str | None = None, holding: Path | None = None):
    """A stand-in process: these arguments, optionally renamed like a Ray worker and holding a
    file open."""
    code = ["import sys, time"]
    if holding is not None:
        code.append(f"f = open({str(holding)!r}, 'w')")
    if title is not None:
        code.append(f"import ray._raylet; ray._raylet.setproctitle({title!r})")
    code.append("print('ready', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", "; ".join(code), *args],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_reaping_kills_the_recorded_sessions_processes_and_nothing_else(tmp_path):
    ray_root = os.path.dirname(ray.__file__)
    session = Path(tempfile.mkdtemp(prefix=ray_local.PREFIX, dir="/tmp"))
    other = Path(tempfile.mkdtemp(prefix=ray_local.PREFIX, dir="/tmp"))
    logs = session / "session_1" / "logs"
    logs.mkdir(parents=True)
    older = sleeper(f"--logs-dir={logs}", ray_root)  # like ours, but from before the record
    time.sleep(1.5)
    recorded = time.time()  # the session's processes start after its record is written
    procs = {
        "head": sleeper(f"--logs-dir={logs}", f"{ray_root}/autoscaler/monitor.py"),
        "worker": sleeper(title="ray::SliceWorker", holding=logs / "worker.out"),
        "tail": sleeper(str(logs / "raylet.out")),  # names the folder, but is not Ray
        "other worker": sleeper(title="ray::SliceWorker", holding=other / "worker.out"),
        "other head": sleeper(f"--logs-dir={other}/logs", ray_root),
    }
    record = {"temp_dir": str(session), "host": socket.gethostname(), "driver_pid": 1,
              "started": recorded}
    try:
        for bad in ({**record, "host": "elsewhere"}, {**record, "temp_dir": str(tmp_path)},
                    {**record, "temp_dir": f"{other}/../{session.name}"}, ["not", "a record"]):
            (tmp_path / "ray.json").write_bytes(orjson.dumps(bad))
            assert ray_local.reap(tmp_path) == 0  # not provably ours: nothing touched
            assert session.exists() and not (tmp_path / "ray.json").exists()
        (tmp_path / "ray.json").write_bytes(orjson.dumps(record))
        assert ray_local.reap(tmp_path) == 2
        assert [name for name, p in procs.items() if p.poll() is not None] == ["head", "worker"]
        assert older.poll() is None
        assert not session.exists() and other.exists() and not (tmp_path / "ray.json").exists()
        assert ray_local.reap(tmp_path) == 0  # no record: nothing to do
    finally:
        for p in [older, *procs.values()]:
            p.kill()
            p.wait()
        shutil.rmtree(session, ignore_errors=True)
        shutil.rmtree(other, ignore_errors=True)


def test_ray_flag_without_ray_installed_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    rows = rows_file(tmp_path / "rows.jsonl", 12)
    result = CliRunner().invoke(cli, ["run", str(rows), "--ray", "local", "--quiet"])
    assert result.exit_code == 1
    assert "pip install -e '.[ray]'" in result.output  # as the README says
    assert "--model" not in result.output  # no unrelated hint


def test_a_fault_building_a_workers_row_fails_its_slice_instead_of_hanging(monkeypatch):
    """The actor's body, in this process: an unexpected error while its engine thread builds a
    row reaches the waiting call (and so the driver) at once; it does not leave it waiting."""
    import pickle

    from batchrun.io.jsonl import RawRow
    from batchrun.job.distributed import SliceWorker

    worker = SliceWorker(None, EngineConfig(max_concurrency=4), RowOptions(), "demo", 0, False)

    def broken(raw):
        raise RuntimeError("row building broke")

    monkeypatch.setattr(worker, "_build_task", broken)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="row building broke"):
        worker.run_slice(pickle.dumps([RawRow(0, 1, {"prompt": "hi"})]))
    assert time.monotonic() - started < 30
