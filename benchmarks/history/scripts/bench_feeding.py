"""How long the job's feeder takes to build labeling rows (chat template + tokenization), with
the shared-start tokenization cache (engine/tokens.py) and without it, side by side.

    python scripts/bench_feeding.py [--rows 512] [--instruction 1000] [--model PATH]
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_labeling import write_rows  # noqa: E402

from batchrun.engine.prompt import PromptBuilder  # noqa: E402
from batchrun.io.readers import read_rows  # noqa: E402
from batchrun.job.rows import RowOptions, build_task  # noqa: E402
from batchrun.models import load_model  # noqa: E402


def build_all(path: Path, prompts: PromptBuilder) -> float:
    start = time.perf_counter()
    for raw in read_rows(path, 0):
        build_task(raw.value, raw.index, raw.line, prompts, RowOptions())
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--instruction", type=int, default=1000, help="instruction words")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    lm = load_model(args.model)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "rows.jsonl"
        write_rows(path, args.rows, args.instruction)
        plain = PromptBuilder(lm.tokenizer)
        plain._chat_tokens.on = False
        without = build_all(path, plain)
        cached = build_all(path, PromptBuilder(lm.tokenizer))
    print(f"{args.rows} rows, ~{args.instruction}-word instruction: whole-text tokenization "
          f"{without:.3f} s, shared starts tokenized once {cached:.3f} s "
          f"({without / cached:.1f}x)")


if __name__ == "__main__":
    main()
