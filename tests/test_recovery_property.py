"""Property: whatever moment a job is killed at, and whatever is then done to state.json and the
files (cut, torn, edited), resuming never skips a row and never writes one twice: the finished
job's files are exactly those of an uninterrupted run."""

import tempfile
from pathlib import Path

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchrun.io.jsonl import read_jsonl
from batchrun.job.recovery import recover
from batchrun.job.rows import row_id
from batchrun.job.sink import OrderedSink, commit, make_durable
from batchrun.job.state import JobState


class Out:  # the token counts a sink reads from an engine output
    def __init__(self, i: int):
        self.prompt_tokens, self.cached_tokens, self.completion_tokens = 10 + i, i % 3, 1 + i % 5


def record(i: int) -> tuple[bytes, bool]:
    """Row i's line: every fifth row is an error, every other one OpenAI-shaped (no index: its
    input line inside `error`), and every third result is OpenAI-shaped."""
    if i % 10 == 9:
        return orjson.dumps({"id": f"e{i}", "custom_id": f"r{i}", "response": None,
                             "error": {"code": "x", "message": "m", "param": None,
                                       "line": i + 1}}) + b"\n", True
    if i % 5 == 4:
        return orjson.dumps({"custom_id": f"r{i}", "index": i, "line": i + 1,
                             "error": {"code": "x", "message": "m"}}) + b"\n", True
    out = Out(i)
    if i % 3 == 0:
        usage = {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}
        return orjson.dumps({"id": f"b{i}", "custom_id": f"r{i}", "response": {
            "status_code": 200, "body": {"choices": [], "usage": usage}}, "error": None}) \
            + b"\n", False
    return orjson.dumps({"custom_id": f"r{i}", "index": i, "text": f"t{i}", "usage": {
        "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens}}) + b"\n", False


def put(sink: OrderedSink, i: int) -> None:
    line, is_error = record(i)
    sink.put(i, line, is_error, () if is_error else [Out(i)])


def resume(job: Path, state: JobState, input_path: Path):
    return recover(state, read_jsonl(input_path), lambda raw: row_id(raw.value, raw.index, None),
                   lambda raw: None)


def finish(job: Path, state: JobState, input_path: Path, n: int):
    """Resume and compute every row that has no record (in a scrambled order)."""
    found = resume(job, state, input_path)
    sink = OrderedSink(state.results_path, state.errors_path, state.spill_path, found.progress,
                       found.spilled)
    todo = [i for i in range(found.progress.next_index, n) if i not in found.spilled]
    for i in todo[::2] + todo[1::2]:
        put(sink, i)
    progress = commit(sink, state)
    sink.close()
    return found, progress


EDITS = ("none", "state_next_up", "state_next_down", "state_bytes_up", "state_garbage",
         "state_missing", "cut_results", "cut_errors", "cut_spill", "torn_results",
         "torn_spill", "garbage_spill_line", "results_missing", "spill_from_another_job")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 30), data=st.data())
def test_resume_after_any_kill_and_edit_gives_the_uninterrupted_files(n, data):
    order = data.draw(st.permutations(range(n)), label="completion order")
    killed_after = data.draw(st.integers(0, n), label="rows finished before the kill")
    # After each row: no commit, a commit, or the start of a background commit (snapshot now,
    # disk work and settling at the next commit point, while rows go on being written).
    commits = data.draw(st.lists(st.sampled_from(("none", "commit", "begin")), min_size=n,
                                 max_size=n), label="commit after")
    in_flight_at_kill = data.draw(st.sampled_from(("lost", "durable", "settled")),
                                  label="a background commit at the kill")
    edit = data.draw(st.sampled_from(EDITS), label="edit")
    amount = data.draw(st.integers(1, 400), label="edit amount")
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp)
        input_path = job / "in.jsonl"
        input_path.write_bytes(b"".join(orjson.dumps({"custom_id": f"r{i}"}) + b"\n"
                                        for i in range(n)))
        # The uninterrupted run's files.
        ref = JobState(job / "ref", job / "ref" / "r.jsonl", job / "ref" / "e.jsonl")
        (job / "ref").mkdir()
        finish(job / "ref", ref, input_path, n)
        expected = (ref.results_path.read_bytes(), ref.errors_path.read_bytes())

        # A run killed after `killed_after` rows: what was written since the last commit is
        # on disk too (the OS had it), but state.json does not cover it.
        (job / "job").mkdir()
        state = JobState(job / "job", job / "job" / "r.jsonl", job / "job" / "e.jsonl")
        sink = OrderedSink(state.results_path, state.errors_path, state.spill_path,
                           resume(job, state, input_path).progress)
        pending = None
        for step, i in enumerate(order[:killed_after]):
            put(sink, i)
            if pending is not None and commits[step] != "none":
                make_durable(sink, state, pending)
                sink.settle(pending)
                pending = None
            if commits[step] == "commit":
                commit(sink, state)
            elif commits[step] == "begin":
                pending = sink.flush()
        if pending is not None and in_flight_at_kill != "lost":
            make_durable(sink, state, pending)
            if in_flight_at_kill == "settled":
                sink.settle(pending)
        sink.sync()
        sink.close()
        tamper(state, edit, amount)

        found, final = finish(job, state, input_path, n)
        if edit == "none" and (killed_after == 0 or commits[killed_after - 1] == "commit"):
            # Killed right after a commit: the files are what state.json says, so the resume
            # finds nothing to warn about (the spill may still hold rows written in order since).
            assert found.problems == []
        assert (state.results_path.read_bytes(), state.errors_path.read_bytes()) == expected
        assert final.next_index == n and final.rows_done + final.rows_failed == n
        assert final.spill_bytes == 0 and state.spill_path.read_bytes() == b""
        # The recovered counts are exactly the records the files hold.
        p = found.progress
        assert p.rows_done + p.rows_failed == p.next_index + len(found.spilled)
        # Once resumed, state.json and the files agree: a second check finds nothing.
        again = resume(job, state, input_path)
        assert again.problems == [] and again.progress == final


def tamper(state: JobState, edit: str, amount: int) -> None:
    def cut(path: Path, n: int) -> None:
        if path.exists():
            path.write_bytes(path.read_bytes()[: max(0, path.stat().st_size - n)])

    def edit_state(key: str, delta: int) -> None:
        if state.state_path.exists():
            saved = orjson.loads(state.state_path.read_bytes())
            saved[key] = max(0, saved[key] + delta)
            state.state_path.write_bytes(orjson.dumps(saved))

    if edit == "state_next_up":
        edit_state("next_index", amount % 50)
    elif edit == "state_next_down":
        edit_state("next_index", -(amount % 50))
    elif edit == "state_bytes_up":
        edit_state("results_bytes", amount)
    elif edit == "state_garbage":
        state.state_path.write_bytes(b'{"next_index": ' + str(amount).encode())
    elif edit == "state_missing":
        state.state_path.unlink(missing_ok=True)
    elif edit == "cut_results":
        cut(state.results_path, amount)
    elif edit == "cut_errors":
        cut(state.errors_path, amount)
    elif edit == "cut_spill":
        cut(state.spill_path, amount)
    elif edit == "torn_results":
        with open(state.results_path, "ab") as f:
            f.write(b'{"custom_id": "r')
    elif edit == "torn_spill":
        with open(state.spill_path, "ab") as f:
            f.write(b'{"index": 3, "err')
    elif edit == "garbage_spill_line":
        data = state.spill_path.read_bytes() if state.spill_path.exists() else b""
        state.spill_path.write_bytes(b"not json\n" + data)
    elif edit == "results_missing":
        state.results_path.unlink(missing_ok=True)
    elif edit == "spill_from_another_job":
        line, _ = record(0)
        other = orjson.dumps({"index": amount % 7, "error": False, "tokens": [1, 1, 1],
                              "line": line.decode().replace('"r0"', '"zz"')}) + b"\n"
        with open(state.spill_path, "ab") as f:
            f.write(other)
        edit_state("spill_bytes", len(other))
