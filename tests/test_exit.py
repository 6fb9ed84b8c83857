"""A finished command ends without the interpreter's teardown, and loses nothing by it: results,
the job folder and the prefix cache's blocks are all written; a thread still running keeps the
normal exit."""

import sys
import threading
import time

import orjson
import pytest

from batchrun import cli as cli_module
from tests.test_cli_contract import cli_process
from tests.test_prefix_cache import entry_files, write_rows

# batchrun's own entry point, with os._exit marked: the marker says the fast exit was taken.
MARKED = """
import os, runpy, sys
real = os._exit
def marked(code):
    sys.stderr.write("exiting at once with %d\\n" % code)
    sys.stderr.flush()
    real(code)
os._exit = marked
sys.argv = ["batchrun", *sys.argv[1:]]
runpy.run_module("batchrun", run_name="__main__")
"""


def batchrun(*args):
    return cli_process(*args, timeout=300, code=MARKED)


def test_a_finished_run_exits_at_once_and_leaves_everything_written(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", 12)
    cache = tmp_path / "cache"
    code, out, err = batchrun("run", rows, "--job-dir", tmp_path / "cold", "--cache-dir", cache,
                              "-o", "-", "--quiet")
    assert code == 0, err
    assert "exiting at once with 0" in err
    results = [orjson.loads(line) for line in out.splitlines()]
    assert [r["custom_id"] for r in results] == [f"r{i}" for i in range(12)]
    assert (tmp_path / "cold" / "results.jsonl").read_bytes() == out
    assert orjson.loads((tmp_path / "cold" / "report.json").read_bytes())["rows_done"] == 12
    # Every block the cold job stored reached the disk, with its index entry, and serves the
    # next process: the instruction's blocks are all read back.
    folder = next((cache / "prefix").iterdir())
    files = entry_files(folder)
    assert files and not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    assert set(orjson.loads((folder / "index.json").read_bytes())) == {p.stem for p in files}
    code, out_warm, err = batchrun("run", rows, "--job-dir", tmp_path / "warm", "--cache-dir",
                                   cache, "-o", "-")
    assert code == 0, err
    assert f"{len(files)} blocks from disk" in err
    assert [orjson.loads(line)["text"] for line in out_warm.splitlines()] == \
        [r["text"] for r in results]


def test_an_exit_code_is_kept_and_a_usage_error_still_says_why(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'{"prompt": "fine"}\n{"prompt": 3}\n')
    code, _, err = batchrun("run", rows, "--job-dir", tmp_path / "j", "--quiet",
                            "--fail-on-row-errors")
    assert code == 3 and "exiting at once with 3" in err
    code, _, err = batchrun("run", tmp_path / "missing.jsonl")
    assert code == 2 and "input file not found" in err


def test_the_normal_exit_on_request(tmp_path, monkeypatch):
    rows = write_rows(tmp_path / "rows.jsonl", 2)
    monkeypatch.setenv("BATCHRUN_FAST_EXIT", "0")
    code, _, err = batchrun("run", rows, "--job-dir", tmp_path / "j", "--quiet")
    assert code == 0, err
    assert "exiting at once" not in err


class Exited(Exception):
    pass


@pytest.fixture
def exits(monkeypatch):
    """os._exit recorded instead of taken, and the exit handlers recorded instead of run."""
    taken, handlers_run = [], []

    def exit_(code):
        taken.append(code)
        raise Exited

    monkeypatch.setattr(cli_module.os, "_exit", exit_)
    monkeypatch.setattr(cli_module.atexit, "_run_exitfuncs", lambda: handlers_run.append(1))
    monkeypatch.setattr(cli_module, "FAST_EXIT_WAIT_S", 0.2)
    others = [t for t in threading.enumerate() if not t.daemon and t is not
              threading.current_thread()]
    # The test process's own non-daemon threads (other tests' pools) are not this test's.
    monkeypatch.setattr(cli_module.threading, "enumerate",
                        lambda: [t for t in threading._enumerate() if t not in others])
    return taken, handlers_run


def test_a_thread_still_running_keeps_the_normal_exit(exits):
    taken, handlers_run = exits
    release = threading.Event()
    busy = threading.Thread(target=release.wait, name="still-writing")
    busy.start()
    try:
        cli_module._exit_now(0)  # returns: the interpreter's exit will wait for the thread
        assert taken == [] and handlers_run == []
    finally:
        release.set()
        busy.join()
    with pytest.raises(Exited):
        cli_module._exit_now(4)
    assert taken == [4] and handlers_run == [1]


def test_code_that_calls_main_itself_keeps_its_process(exits, tmp_path, monkeypatch):
    taken, _ = exits
    rows = write_rows(tmp_path / "rows.jsonl", 2)
    monkeypatch.setattr(sys, "argv", ["batchrun", "run", str(rows), "--job-dir",
                                      str(tmp_path / "j"), "--quiet"])
    with pytest.raises(SystemExit) as e:
        cli_module.main()
    assert e.value.code == 0 and taken == []


def test_a_profiler_or_a_tracer_gets_the_end_of_the_program(exits):
    taken, _ = exits
    for watch, watching in ((sys.setprofile, sys.getprofile), (sys.settrace, sys.gettrace)):
        before = watching()  # (a coverage tool's tracer, say)
        watch(lambda *args: None)
        try:
            cli_module._exit_now(0)
        finally:
            watch(before)
    assert taken == []


def test_a_thread_that_ends_within_the_wait_is_waited_for(exits):
    taken, _ = exits
    done = []
    ending = threading.Thread(target=lambda: (threading.Event().wait(0.05), done.append(1)))
    ending.start()
    with pytest.raises(Exited):
        cli_module._exit_now(0)
    assert done == [1] and taken == [0]


def test_a_closed_job_leaves_no_thread_of_its_own_running(tmp_path):
    import batchrun

    rows = write_rows(tmp_path / "rows.jsonl", 6)
    before = set(threading.enumerate())
    job = batchrun.Job(rows, job_dir=tmp_path / "j", cache_dir=tmp_path / "cache")
    keep = job  # held, as a caller holds it: its threads must end by close(), not by collection
    job.run()
    assert [t for t in threading.enumerate() if t not in before and not t.daemon]  # the cache's
    job.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and [t for t in threading.enumerate()
                                           if t not in before and not t.daemon]:
        time.sleep(0.01)
    assert [t.name for t in threading.enumerate() if t not in before and not t.daemon] == []
    assert keep.runner is None
    folder = next((tmp_path / "cache" / "prefix").iterdir())
    assert entry_files(folder)  # its blocks were written before it let go


def test_ctrl_c_while_the_exit_waits_leaves_the_commands_ending(exits, monkeypatch):
    taken, handlers_run = exits

    class Lingering:  # a thread that is still running when Ctrl-C comes
        daemon = False

        def join(self, timeout=None):
            raise KeyboardInterrupt

        def is_alive(self):
            return True

    monkeypatch.setattr(cli_module.threading, "enumerate", lambda: [Lingering()])
    cli_module._exit_now(1)  # returns: the normal exit goes on with the command's code
    assert taken == [] and handlers_run == []


def test_a_job_that_fails_after_its_cache_started_still_lets_go_of_its_threads(
        tmp_path, monkeypatch):
    """A job that stops on a disk error (after its prefix cache wrote blocks) closes too: no
    idle cache thread is left for the exit to wait on."""
    import errno

    from click.testing import CliRunner

    from batchrun.job.runner import JobRunner

    real = JobRunner.run

    def full_disk(self):
        real(self)
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "j"))

    monkeypatch.setattr(JobRunner, "run", full_disk)
    rows = write_rows(tmp_path / "rows.jsonl", 6)
    before = set(threading.enumerate())
    result = CliRunner().invoke(cli_module.cli, ["run", str(rows), "--job-dir",
                                                 str(tmp_path / "j"), "--cache-dir",
                                                 str(tmp_path / "cache"), "--quiet"])
    assert result.exit_code == 1 and "No space left on device" in result.output
    assert "Traceback" not in result.output
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and [t for t in threading.enumerate()
                                           if t not in before and not t.daemon]:
        time.sleep(0.01)
    assert [t.name for t in threading.enumerate() if t not in before and not t.daemon] == []
    assert entry_files(next((tmp_path / "cache" / "prefix").iterdir()))  # written first


@pytest.mark.parametrize("closed", [0, 1, 2])
def test_a_run_started_with_a_standard_stream_closed_writes_its_results_alone(tmp_path, closed):
    """`batchrun run ... <&-` (or `>&-`, `2>&-`) in a script: the model still loads (MLX took
    descriptor 0, left free, for a failed open) and nothing meant for a closed stream lands in
    a file that took its descriptor."""
    rows = write_rows(tmp_path / "rows.jsonl", 4)
    job = tmp_path / "job"
    code, _, err = cli_process("run", rows, "--job-dir", job, "--debug", timeout=300, code=(
        f"import os, runpy, sys; os.close({closed}); sys.argv = ['batchrun', *sys.argv[1:]]; "
        "runpy.run_module('batchrun', run_name='__main__')"))
    assert code == 0, err[-2000:]
    results = [orjson.loads(line) for line in (job / "results.jsonl").read_bytes().splitlines()]
    assert [r["custom_id"] for r in results] == [f"r{i}" for i in range(4)]
    for name in ("errors.jsonl", "state.json", "report.json"):
        text = (job / name).read_bytes()
        assert b"rows:" not in text and b"DEBUG" not in text and b"model:" not in text
