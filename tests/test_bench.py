"""`batchrun bench`: the same rows through each system, figures side by side."""

import orjson
from click.testing import CliRunner

from batchrun.bench import make_workload
from batchrun.cli import cli


def test_bench_runs_every_system_on_the_same_rows(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(cli, [
        "bench", "--workload", "labeling", "--rows", "6", "--max-tokens", "4",
        "--max-concurrency", "4", "--systems", "sequential,batch_generate,batchrun,prefix",
        "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = orjson.loads(out.read_bytes())
    systems = [r["system"] for r in data["results"]]
    assert systems == ["mlx-lm stream_generate (sequential)", "mlx-lm batch_generate",
                       "batchrun engine", "batchrun + prefix cache (cold)",
                       "batchrun + prefix cache (warm)"]
    # Greedy everywhere: every system generates the same number of tokens for the same rows.
    assert len({r["completion_tokens"] for r in data["results"]}) == 1
    assert "vs batch_generate" in result.output and "BLAS" in result.output


def test_workloads_have_the_documented_shapes(demo):
    mixed = make_workload(demo.tokenizer, "mixed", 50, 64)
    assert all(8 <= len(p) <= 1500 for p in mixed.prompts)
    assert all(16 <= n <= 256 for n in mixed.max_tokens) and len(set(mixed.max_tokens)) > 1
    short = make_workload(demo.tokenizer, "short", 20, 64)
    assert all(16 <= len(p) <= 32 for p in short.prompts) and set(short.max_tokens) == {64}
    labeling = make_workload(demo.tokenizer, "labeling", 10, 8)
    assert all(p[:1000] == labeling.prompts[0][:1000] for p in labeling.prompts)
    assert len({tuple(p) for p in labeling.prompts}) == 10
