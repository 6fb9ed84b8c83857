"""The trained demo pair's lessons and trainer (tools/demo_models/lessons.py, train.py)."""

import random
import re

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from batchrun.models import random_model
from tools.demo_models import lessons, train


def test_every_sample_question_has_an_answer_and_every_review_its_sentiment():
    for task in random_model.TASKS:
        for topic in random_model.TOPICS:
            assert lessons.answer(task, topic).strip()
    rng = random.Random(3)
    for _ in range(200):
        chat = lessons.labeling_chat(rng)
        review = chat[-2]["content"]
        label = chat[-1]["content"]
        if "Some days I like it" in review:
            assert label == "neutral"
        elif any(f" {word} " in f" {review.replace('.', ' ')} " for word in random_model.BAD):
            assert label in ("negative", "neutral")
        assert label in ("positive", "negative", "neutral")
    assert lessons.examples(7, 50) == lessons.examples(7, 50)


def test_essays_are_long_and_reference_answers_copy_the_references_sentences(tokenizer):
    """Speculation's benchmarks lean on both: the 8-row job's essays run past 256 tokens (the
    topic's answers, in order), and an extraction row's answer is the reference's own
    sentences."""
    tok, _ = tokenizer
    for topic in random_model.TOPICS:
        text = lessons.essay(topic)
        assert len(tok.encode(text)) > 256
        assert all(lessons.answer(task, topic) in text for task in random_model.TASKS)
    rng = random.Random(5)
    for _ in range(100):
        system, user, reply = lessons.reference_chat(rng)
        topic = next(t for t in random_model.TOPICS for task in lessons.REFERENCE_TASKS
                     if task.format(t=t) == user["content"])
        unnumbered = re.sub(r"^\d+\. ", "", reply["content"], flags=re.M)
        sentences = re.split(r"(?<=\.)\s+", unnumbered)
        assert system["content"] == lessons.reference_text(topic)
        assert sentences and all(s in lessons.FACTS[topic][0] for s in sentences)

    def asks(chat, tasks):
        return isinstance(chat, list) and any(chat[-2]["content"] == task.format(t=t)
                                              for task in tasks for t in random_model.TOPICS)

    for long_answers in (False, True):  # without --long-answers, neither
        chats = [c for c, _ in lessons.examples(3, 400, long_answers)]
        assert any(asks(c, lessons.ESSAY_TASKS) for c in chats) is long_answers
        assert any(c[0]["content"].startswith("Reference: ") for c in chats
                   if isinstance(c, list)) is long_answers


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tok")
    random_model.model_folder(out, train.SHAPES["draft"], 0, "demo-draft")
    return PreTrainedTokenizerFast.from_pretrained(str(out)), out


def test_a_chat_teaches_only_its_answer_and_text_all_of_itself(tokenizer):
    tok, _ = tokenizer
    chat = [{"role": "system", "content": lessons.LABEL_SYSTEM},
            {"role": "user", "content": "Review of a tent: it is noisy.\nSentiment:"},
            {"role": "assistant", "content": "negative"}]
    ((ids, mask), (text_ids, text_mask)) = train.encode_examples(
        tok, [(chat, None), ("Plain text.", None)])
    taught = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert taught == "negative<|im_end|>"
    assert tok.decode(ids).startswith("<|im_start|>system\n" + lessons.LABEL_SYSTEM)
    assert all(text_mask) and tok.decode(text_ids) == "Plain text.<|endoftext|>"


def test_long_answer_lessons_teach_the_answer_after_an_empty_thinking_block(tokenizer):
    """`enable_thinking: false` puts an empty thinking block before the answer (the sample
    prompts' rows with a system message ask for it): a share of the long-answer lessons'
    chats is rendered so, the answer taught after it, and the committed recipe has none."""
    tok, _ = tokenizer
    chats = [c for c, _ in lessons.examples(3, 400, long_answers=True) if isinstance(c, list)]
    off = [c for c in chats if c[-1].get("enable_thinking") is False]
    assert 0 < len(off) < len(chats) / 2
    assert not any(isinstance(c, list) and "enable_thinking" in c[-1]
                   for c, _ in lessons.examples(3, 400))
    chat = next(c for c in off if c[-1]["content"])
    ((ids, mask),) = train.encode_examples(tok, [(chat, None)])
    answer = chat[-1]["content"]
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" + answer
                                    + "<|im_end|>")
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == answer + "<|im_end|>"


def test_training_is_deterministic_from_its_seed_and_lowers_the_loss(tokenizer, monkeypatch):
    tok, folder = tokenizer
    import json

    config = json.loads((folder / "config.json").read_text())
    data = train.encode_examples(tok, lessons.examples(0, 200))
    monkeypatch.setattr(train, "BATCH", 4)
    runs = []
    for _ in range(2):
        mx.random.seed(0)
        model = train.make_model(config)
        first = train.train(model, data, 1, 0, log_every=1)
        mx.random.seed(0)
        model = train.make_model(config)
        last = train.train(model, data, 12, 0, log_every=12)
        runs.append((first, last, [v.tolist() for _, v in tree_flatten(model.parameters())[:3]]))
    assert runs[0] == runs[1]
    assert runs[0][1] < runs[0][0]


def test_the_trained_demo_labels_the_sample_reviews_and_calls_the_sample_tool(
        tmp_path, trained):
    """What the README says of the default demo model, through `batchrun run`."""
    import orjson
    from click.testing import CliRunner

    from batchrun.cli import cli
    from batchrun.models import REPO_ROOT

    out = tmp_path / "labels.jsonl"
    result = CliRunner().invoke(cli, ["run", str(REPO_ROOT / "jobs" / "label_reviews_choices.toml"),
                                      "--job-dir", str(tmp_path / "job"), "--output", str(out),
                                      "--quiet"])
    assert result.exit_code == 0, result.output
    ratings = {r["id"]: r["rating"] for r in map(
        orjson.loads, (REPO_ROOT / "sample_data" / "reviews.jsonl").read_bytes().splitlines())}
    labels = {r["custom_id"]: r["text"] for r in map(orjson.loads, out.read_bytes().splitlines())}
    agree = sum(labels[i] == lessons.sentiment(rating) for i, rating in ratings.items())
    commonest = max(list(map(lessons.sentiment, ratings.values())).count(s)
                    for s in ("positive", "negative", "neutral"))
    assert len(labels) == 200 and agree >= 190 and commonest <= 80  # far above the baseline
    # the job file names the right answers' column: the report says how many labels agree
    expected = {r["custom_id"]: r["expected"] for r in map(orjson.loads,
                                                           out.read_bytes().splitlines())}
    assert expected == {i: lessons.sentiment(rating) for i, rating in ratings.items()}
    report = orjson.loads((tmp_path / "job" / "report.json").read_bytes())["expected"]
    assert (report["column"], report["rows"], report["agreeing_rows"]) == \
        ("sentiment", 200, agree)
    assert report["accuracy"] == round(agree / 200, 4)
    assert f"{agree} of 200 results are the expected answer (sentiment)" in result.output

    rows = tmp_path / "weather.jsonl"
    rows.write_bytes(orjson.dumps({"messages": [{"role": "user", "content":
                                                 "What is the weather in Oslo?"}],
                                   "tools": [lessons.WEATHER_TOOL], "max_tokens": 32}) + b"\n")
    result = CliRunner().invoke(cli, ["run", str(rows), "--job-dir", str(tmp_path / "w"),
                                      "--quiet"])
    assert result.exit_code == 0, result.output
    record = orjson.loads((tmp_path / "w" / "results.jsonl").read_bytes())
    assert record["tool_calls"] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]


def test_the_trained_demo_answers_the_sample_questions_with_its_lessons(tmp_path, trained):
    """The quick-start job's question rows (README: it "answers the sample questions"): the
    answer the lessons teach, or its start where max_tokens cut it. A retrain that garbles
    them fails here (one tried in session 12 got 34 of 48; the committed pair 48)."""
    import orjson
    from click.testing import CliRunner

    from batchrun.cli import cli
    from batchrun.models import REPO_ROOT

    prompts = REPO_ROOT / "sample_data" / "prompts.jsonl"
    result = CliRunner().invoke(cli, ["run", str(prompts), "--job-dir", str(tmp_path / "job"),
                                      "--quiet", "--no-prefix-cache"])
    assert result.exit_code == 0, result.output
    texts = {r["custom_id"]: r["text"].strip() for r in map(
        orjson.loads, (tmp_path / "job" / "results.jsonl").read_bytes().splitlines())}
    asked = {task.format(t=topic): lessons.answer(task, topic)
             for task in random_model.TASKS for topic in random_model.TOPICS}
    rows = [orjson.loads(line) for line in prompts.read_bytes().splitlines()]
    right = total = 0
    for row in rows:
        messages = row.get("messages") or [{"role": "user", "content": row.get("prompt")}]
        answer = asked.get(next(m["content"] for m in reversed(messages)
                                if m["role"] == "user"))
        if answer is None:  # the weather and plain-text rows
            continue
        total += 1
        text = texts[row["custom_id"]]
        right += bool(text) and answer.startswith(text) or text.startswith(answer)
    assert total == 48 and right >= 44, right



def test_a_pair_trained_from_any_seed_writes_the_demo_models_token_ids(tmp_path, monkeypatch):
    """The seed draws the weights and the lessons; the tokenizer is the random-weight demo
    model's whatever the seed, so every demo model (and a draft of any) writes the same ids."""
    import json

    from batchrun.models import RANDOM_DEMO_MODEL

    monkeypatch.setattr(train, "BATCH", 2)
    monkeypatch.setattr(train, "labeling_accuracy", lambda folder: 0.0)  # not this test's
    train.train_pair(tmp_path / "target", tmp_path / "draft", 1, 3, examples=40,
                     target_shape=random_model.Shape(64, 1, 96, 4, 2))
    for role in ("target", "draft"):
        assert (tmp_path / role / "tokenizer.json").read_bytes() == \
            (RANDOM_DEMO_MODEL / "tokenizer.json").read_bytes()
        config = json.loads((tmp_path / role / "config.json").read_text())
        assert config["batchrun_training"]["seed"] == config["batchrun_seed"] == 3
    # --target-shape: the target of that shape, the draft as ever
    config = json.loads((tmp_path / "target" / "config.json").read_text())
    assert [config[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                "num_attention_heads", "num_key_value_heads")] == [64, 1, 96, 4, 2]
    draft = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert draft["hidden_size"] == train.SHAPES["draft"].hidden_size


@pytest.mark.parametrize("shape", ["256,4,640,8", "256,4,640,7,1", "256,4,640,8,3", "a,b,c,d,e",
                                   "256,0,640,8,2"])
def test_a_target_shape_that_cannot_be_built_is_a_usage_error(shape, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        train.main([str(tmp_path / "t"), str(tmp_path / "d"), "--target-shape", shape])
    assert stop.value.code == 2
    assert "--target-shape: five positive integers" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_the_trained_demo_writes_its_essays_and_quotes_its_references(trained):
    """What speculation's benchmarks rely on (README, speculative decoding): asked for an essay,
    the trained demo writes the lessons' essay past 256 tokens, and asked about a reference,
    it answers with the reference's own sentences. A retrain that forgets them fails here (the
    committed pair: 26 of 26 essays, 39 of 39 references; the same recipe from seed 5 got 6
    essays)."""
    from batchrun.engine.config import EngineConfig
    from batchrun.engine.engine import Engine

    engine = Engine(trained.model, trained.tokenizer, EngineConfig(prefix_cache=False),
                    trained.context_length)
    essays, topics, quoted, asked = train.long_answers_known(engine)
    assert topics == 26 and essays >= 13, essays
    assert asked == 39 and quoted >= 36, quoted


def test_an_output_that_is_not_a_folder_is_a_usage_error_before_any_training(tmp_path, capsys):
    taken = tmp_path / "a-file"
    taken.write_text("kept")
    for argv in ([str(taken), str(tmp_path / "d")], [str(tmp_path / "t"), str(taken)]):
        with pytest.raises(SystemExit) as stop:
            train.main(argv + ["--steps", "1"])
        assert stop.value.code == 2
        assert f"{taken}: exists and is not a folder" in capsys.readouterr().err
    assert taken.read_text() == "kept" and not (tmp_path / "t").exists()
