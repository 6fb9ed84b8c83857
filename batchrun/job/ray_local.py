"""The local Ray cluster a job starts for `--ray local`, and what a killed driver left of one.

Invariant: while a cluster of ours may be running, `<job-dir>/ray.json` names its private temp
folder; the record is removed only after the cluster is stopped and every process tied to that
folder is gone. So a record found at start is a killed driver's: its leftovers are killed and its
folder removed before the new cluster starts.

Ray's head processes die with a killed driver (it starts them with PR_SET_PDEATHSIG), but its
agents and workers outlive it (the agents by ~90 s here), holding memory and CPU. A process is
taken as the session's only by proof: its command line names the session folder and Ray's own
files, or (a Ray process that renamed itself `ray::...`) it holds a file open in that folder; and
it started after the record was written, under this user. A private folder per run also keeps the
cluster off Ray's shared /tmp/ray (no `ray_current_cluster` file for others to trip on), and
`address="local"` never reads one: a stale file there cannot redirect or fail our start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import orjson
import ray

from batchrun.io.files import write_atomic

log = logging.getLogger("batchrun")
RECORD = "ray.json"
PREFIX = "batchrun-ray-"
REAP_WAIT_S = 5.0


class LocalCluster:
    """A Ray head started in this process for one job, stopped with `stop()` on every exit."""

    def __init__(self, job_dir: Path):
        self.job_dir = Path(job_dir)
        self.temp_dir: Path | None = None

    def start(self, num_cpus: int) -> None:
        """Record a new private temp folder in the job folder, then start Ray in it; `reap`
        the job folder first."""
        # Ray's own base (short: its socket paths must fit in 107 bytes), not the job folder.
        base = os.environ.get("RAY_TMPDIR") or "/tmp"
        self.temp_dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))
        write_atomic(self.job_dir / RECORD, orjson.dumps({
            "temp_dir": str(self.temp_dir), "host": socket.gethostname(),
            "driver_pid": os.getpid(), "started": time.time()}))
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 num_cpus=num_cpus, _temp_dir=str(self.temp_dir),
                 _node_ip_address="127.0.0.1")  # loopback where Ray allows it (notes/ray.md)

    def stop(self) -> None:
        """Shut the cluster down, kill anything of it that outlived that, drop the record."""
        try:
            ray.shutdown()
        finally:
            reap(self.job_dir)


def reap(job_dir: Path) -> int:
    """Kill the processes of the cluster `<job-dir>/ray.json` records, remove its folder and the
    record; the number killed. The caller holds the job lock: the recording driver is gone."""
    path = Path(job_dir) / RECORD
    try:
        record = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return 0
    except (OSError, orjson.JSONDecodeError) as e:
        log.warning("%s is unreadable (%s); ignoring it", path, e)
        record = None
    temp_dir = _our_temp_dir(record)
    killed = 0
    if temp_dir is not None:
        procs = session_processes(temp_dir, float(record.get("started", 0)))
        import psutil

        for p in procs:
            with contextlib.suppress(psutil.Error):  # gone already, or not ours to kill after all
                p.kill()
        _, alive = psutil.wait_procs(procs, timeout=REAP_WAIT_S)
        killed = len(procs) - len(alive)
        for p in alive:
            log.warning("Ray process %d of %s did not exit when killed", p.pid, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    path.unlink(missing_ok=True)
    return killed


def _our_temp_dir(record) -> Path | None:
    """The record's temp folder if it is one this host's batchrun made for this user."""
    if not isinstance(record, dict) or record.get("host") != socket.gethostname():
        return None
    value = record.get("temp_dir")
    if not isinstance(value, str) or not isinstance(record.get("started"), int | float):
        return None
    folder = Path(value)
    if not folder.is_absolute() or not folder.name.startswith(PREFIX) or ".." in folder.parts:
        return None
    try:
        st = folder.lstat()
    except OSError:
        return None
    if not folder.is_dir() or folder.is_symlink() or st.st_uid != os.getuid():
        return None
    return folder


def session_processes(temp_dir: Path, since: float) -> list:
    """This user's processes of the Ray session kept in `temp_dir` (psutil.Process objects)."""
    import psutil  # vendored by Ray: importable once ray is

    ray_root = os.path.dirname(ray.__file__)
    marker = str(temp_dir) + os.sep
    uid, me = os.getuid(), os.getpid()
    found = []
    for p in psutil.process_iter(["uids", "cmdline", "create_time"]):
        info = p.info
        if p.pid == me or info["uids"] is None or info["uids"].real != uid:
            continue
        if (info["create_time"] or 0) < since - 1:  # older than the session: not ours
            continue
        args = " ".join(info["cmdline"] or ())
        if args.startswith("ray::"):  # renamed: its arguments are gone; its open files are not
            mine = _holds_file_in(p, marker)
        else:
            mine = marker in args and ray_root in args
        if mine:
            found.append(p)
    return found


def _holds_file_in(p, marker: str) -> bool:
    import psutil

    try:
        return any(f.path.startswith(marker) for f in p.open_files())
    except (psutil.Error, OSError):
        return False
