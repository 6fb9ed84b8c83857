"""Issue 18's probe: a draft distilled from the trained target's own greedy answers, to see
whether the draft then guesses the target's long answers (the `long` workload) more often.

    python scripts/probe_distill_draft.py N LENGTH STEPS SHARE OUT
    python scripts/bench_speculate.py OUT_DIR --workloads few,long --other-draft OUT

N chat prompts of lessons.examples (seed 7, not the sample questions), each answered by the
target for exactly LENGTH tokens, greedy; the demo draft (sample_data/demo-draft) then trains
STEPS more steps on those answers mixed with its own lessons (SHARE: the distilled answers'
share of the examples) and is written to OUT (the draft's tokenizer and configuration).
"""

import json
import random
import shutil
import sys
import time
from pathlib import Path

import batchrun  # noqa: F401  (BLAS routing before MLX)
from batchrun.engine.engine import Engine
from batchrun.engine.request import EngineConfig, SamplingParams
from batchrun.models import DEMO_DRAFT_MODEL, DEMO_MODEL, lessons, load_model
from batchrun.models import train as T


def main() -> None:
    n, length, steps, share = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                               float(sys.argv[4]))
    out = Path(sys.argv[5])
    start = time.time()
    chats = [c[:-1] for c, tools in lessons.examples(7, 4 * n)
             if isinstance(c, list) and tools is None][:n]
    target = load_model(str(DEMO_MODEL))
    engine = Engine(target.model, target.tokenizer,
                    EngineConfig(max_concurrency=256, prefix_cache=False), target.context_length)
    outs = engine.generate(chats, SamplingParams(max_tokens=length, min_tokens=length))
    data = []
    for chat, o in zip(chats, outs, strict=True):
        head = list(target.tokenizer.apply_chat_template(chat, add_generation_prompt=True))
        if len(head) + len(o.token_ids) <= T.MAX_LENGTH:
            data.append((head + list(o.token_ids), [0] * len(head) + [1] * len(o.token_ids)))
    print(f"{len(data)} answers distilled in {time.time() - start:.1f} s", flush=True)
    from transformers import PreTrainedTokenizerFast

    own = T.encode_examples(PreTrainedTokenizerFast.from_pretrained(str(DEMO_DRAFT_MODEL)),
                            lessons.examples(0, 20000))
    extra = int(len(data) * (1 - share) / share) if share < 1 else 0
    mixed = data + random.Random(0).sample(own, min(extra, len(own)))
    draft = load_model(str(DEMO_DRAFT_MODEL)).model
    T.train(draft, mixed, steps, 0)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(DEMO_DRAFT_MODEL, out)
    T.write_model(out, draft, json.loads((DEMO_DRAFT_MODEL / "config.json").read_text()))
    print(f"written to {out} after {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
