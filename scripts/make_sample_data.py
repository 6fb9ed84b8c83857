"""Write the bundled sample data (deterministic): prompts.jsonl and reviews.jsonl.

    python scripts/make_sample_data.py
"""

import json
import random
from pathlib import Path

from batchrun.models.build import question, review

OUT = Path(__file__).resolve().parents[1] / "sample_data"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}


def prompts(rng: random.Random, n: int = 64) -> list[dict]:
    rows = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            row = {"prompt": question(rng)}
        elif kind == 1:
            row = {"messages": [{"role": "user", "content": question(rng)}]}
        elif kind == 2:
            row = {"messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": question(rng)}],
                "chat_template_kwargs": {"enable_thinking": False}}
        else:
            row = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                   "tools": [WEATHER_TOOL], "temperature": 0.8, "seed": i}
        row = {"custom_id": f"q{i:03d}", **row, "max_tokens": rng.choice([16, 32, 48, 64])}
        rows.append(row)
    return rows


def reviews(rng: random.Random, n: int = 200) -> list[dict]:
    out = []
    for i in range(n):
        product, text, rating = review(rng)
        out.append({"id": f"rev-{i:04d}", "product": product, "review": text, "rating": rating})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


if __name__ == "__main__":
    write_jsonl(OUT / "prompts.jsonl", prompts(random.Random(1)))
    write_jsonl(OUT / "reviews.jsonl", reviews(random.Random(2)))
    print(OUT)
