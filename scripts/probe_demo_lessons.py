"""How many of the long-answer lessons a trained target reproduces (session 17's tries,
BENCHMARKS.md): greedy answers to every essay question about every topic (26 rows, max_tokens
256, each compared with the start of lessons.essay) and to every reference question (39 rows,
compared with lessons.reference_answer), and the weather question about every lesson city (a
well-formed get_weather call naming that city).

    python scripts/probe_demo_lessons.py MODEL_FOLDER
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import batchrun  # noqa: E402, F401  (BLAS routing before MLX)
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine.reasoning import parse_tool_calls  # noqa: E402
from batchrun.engine.request import EngineConfig, SamplingParams  # noqa: E402
from batchrun.models import build, lessons, load_model  # noqa: E402


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
    tools = [lessons.WEATHER_TOOL]
    ids = [engine.add_request(messages=[{"role": "user",
                                         "content": f"What is the weather in {city}?"}],
                              tools=tools, params=SamplingParams(max_tokens=32))
           for city in lessons.CITIES]
    outs = {o.request_id: o for o in engine.run()}
    wrong = []
    for request, city in zip(ids, lessons.CITIES, strict=True):
        _, calls = parse_tool_calls(outs[request].text, engine.markup, tools)
        if [(c.name, json.loads(c.arguments)) for c in calls] != [("get_weather",
                                                                   {"city": city})]:
            wrong.append(city)
    print(f"weather tool calls naming the city asked: {len(lessons.CITIES) - len(wrong)} of "
          f"{len(lessons.CITIES)}; wrong: {wrong}")


if __name__ == "__main__":
    main()
