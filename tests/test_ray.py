"""`batchrun run --ray`: a job sharded over Ray actors keeps the single machine's guarantees.

The tests start (and stop) their own local Ray cluster, bound to 127.0.0.1 with a small object
store and no token auth; two CPU actors."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import ray
from click.testing import CliRunner

from batchrun.cli import cli
from batchrun.engine.request import EngineConfig, SamplingParams
from batchrun.job.distributed import RayJobRunner, RayOptions
from batchrun.job.rows import RowOptions
from batchrun.job.runner import JobSpec
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


def test_a_killed_driver_resumes_with_every_row_exactly_once(tmp_path):
    rows = rows_file(tmp_path / "rows.jsonl", 400)
    job = tmp_path / "job"
    cmd = [sys.executable, "-m", "batchrun", "run", str(rows), "--job-dir", str(job),
           "--quiet", "--ray", "local", "--ray-actors", "2", "--ray-num-cpus", "0.5",
           "--max-concurrency", "8"]
    env = {**os.environ, **LOOPBACK_ENV}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    results = job / "results.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if results.exists() and len(results.read_bytes().splitlines()) >= 40:
            break
        if proc.poll() is not None:
            pytest.fail(f"the run ended before it could be killed: {proc.stderr.read()}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the cluster it started
    proc.wait()
    done_before = len(results.read_bytes().splitlines())
    assert 0 < done_before < 398
    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    indexes = [r["index"] for r in jsonl(results)] + [e["index"] for e in jsonl(
        job / "errors.jsonl")]
    assert sorted(indexes) == list(range(400))  # exactly once, none lost
    assert [r["index"] for r in jsonl(results)] == sorted(r["index"] for r in jsonl(results))
    report = orjson.loads((job / "report.json").read_bytes())
    assert len(report["runs"]) == 2 and report["runs"][-1]["status"] == "completed"


def test_ray_flag_without_ray_installed_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    rows = rows_file(tmp_path / "rows.jsonl", 12)
    result = CliRunner().invoke(cli, ["run", str(rows), "--ray", "local", "--quiet"])
    assert result.exit_code == 1
    assert "pip install 'batchrun[ray]'" in result.output
