"""How many of the long-answer lessons a trained target reproduces (session 17's tries,
BENCHMARKS.md): greedy answers to every essay question about every topic (26 rows, max_tokens
256, each compared with the start of lessons.essay) and to every reference question (39 rows,
compared with lessons.reference_answer), and the weather question about every lesson city (a
well-formed get_weather call naming that city).

    python scripts/probe_demo_lessons.py MODEL_FOLDER
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import batchrun  # noqa: E402, F401  (BLAS routing before MLX)
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine.request import EngineConfig, SamplingParams  # noqa: E402
from batchrun.models import build, lessons, load_model, train  # noqa: E402


def main() -> None:
    lm = load_model(sys.argv[1])
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(prefix_cache=False), lm.context_length)
    for task in lessons.ESSAY_TASKS:
        rows = [[{"role": "user", "content": task.format(t=t)}] for t in build.TOPICS]
        outs = engine.generate(rows, SamplingParams(max_tokens=256))
        wrong = [t for t, o in zip(build.TOPICS, outs, strict=True)
                 if not lessons.essay(t).startswith(o.text)]
        print(f"{task!r}: {len(build.TOPICS) - len(wrong)} of {len(build.TOPICS)} essays right; "
              f"wrong: {wrong}")
    rows, answers = [], []
    for t in build.TOPICS:
        for task in lessons.REFERENCE_TASKS:
            rows.append([{"role": "system", "content": lessons.reference_text(t)},
                         {"role": "user", "content": task.format(t=t)}])
            answers.append(lessons.reference_answer(task, t))
    outs = engine.generate(rows, SamplingParams(max_tokens=128))
    copied = sum(o.text.strip() == a for o, a in zip(outs, answers, strict=True))
    print(f"references copied: {copied} of {len(rows)}")
    right = train.weather_calls_known(engine)
    wrong = [city for city in lessons.CITIES if city not in right]
    print(f"weather tool calls naming the city asked: {len(lessons.CITIES) - len(wrong)} of "
          f"{len(lessons.CITIES)}; wrong: {wrong}")


if __name__ == "__main__":
    main()
