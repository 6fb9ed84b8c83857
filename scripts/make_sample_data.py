"""Write the bundled sample data (deterministic): prompts.jsonl and reviews.jsonl.

    python scripts/make_sample_data.py
"""

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchrun.models.random_model import question, review  # noqa: E402
from tools.demo_models.lessons import WEATHER_TOOL, sentiment  # noqa: E402

OUT = ROOT / "sample_data"


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
        out.append({"id": f"rev-{i:04d}", "product": product, "review": text, "rating": rating,
                    "sentiment": sentiment(rating)})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def write_reviews_parquet(path: Path, rows: list[dict]) -> None:
    """The reviews with typed columns: a labeling job's typical input."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(3)
    table = pa.table({
        "id": [r["id"] for r in rows],
        "product": [r["product"] for r in rows],
        "review": [r["review"] for r in rows],
        "rating": pa.array([r["rating"] for r in rows], pa.int8()),
        "sentiment": [r["sentiment"] for r in rows],
        "verified": [rng.random() < 0.8 for _ in rows],
        "price": [round(rng.uniform(5, 300), 2) for _ in rows],
        "tags": [rng.sample(["gift", "sale", "return", "repeat"], rng.randint(0, 2))
                 for _ in rows],
    })
    pq.write_table(table, path)


if __name__ == "__main__":
    write_jsonl(OUT / "prompts.jsonl", prompts(random.Random(1)))
    review_rows = reviews(random.Random(2))
    write_jsonl(OUT / "reviews.jsonl", review_rows)
    write_reviews_parquet(OUT / "reviews.parquet", review_rows)
    print(OUT)
