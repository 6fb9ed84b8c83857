"""What the trained demo models learn (train.py): chats and text built from the same generators
as the sample data (batchrun/models/random_model.py), so the demo answers the sample jobs sensibly.

- labeling: a review (random_model.review) with the sample jobs' instruction and prompt template,
  answered with its sentiment (rating 4-5 positive, 1-2 negative, 3 neutral);
- questions: random_model.TASKS about random_model.TOPICS, answered from a few facts a topic
  written here;
- essays (with `long_answers`): "Write an essay about <topic>." answered with ~300 tokens: the
  topic's answers to every question above, in a fixed order (speculation's 8 x 256 job);
- references (with `long_answers`): a topic's facts as a `Reference:` system message, then a
  question answered in the reference's own sentences (extraction rows: answers that copy their
  prompt);
- tools: "What is the weather in <city>?" with the sample's get_weather tool, answered with a
  tool call; without tools, a sentence saying there is no weather tool;
- text: reviews and answers as plain text, for raw prompts.

Every example is a list of chat messages (the model learns the assistant turns) or a plain
string (the model learns all of it).
"""

from __future__ import annotations

import random

from batchrun.models.random_model import TASKS, TOPICS, review

# The sample jobs' instruction and prompt (jobs/label_reviews*.toml).
LABEL_SYSTEM = "You label product reviews. Answer with one word: positive, negative or neutral."
LABEL_PROMPT = "Review of a {product}: {review}\nSentiment:"
OTHER_LABEL_PROMPTS = ["Classify the sentiment of this review as positive, negative or "
                       "neutral.\n{review}", "{review}\nIs this review positive, negative or "
                       "neutral?"]
SYSTEMS = ["You are a helpful assistant.", "Answer briefly and clearly."]


def sentiment(rating: int) -> str:
    return "positive" if rating >= 4 else "negative" if rating <= 2 else "neutral"


# Three facts, an analogy and a misconception a topic.
FACTS = {
    "photosynthesis": (
        ["Plants turn sunlight, water and carbon dioxide into sugar.",
         "Photosynthesis releases oxygen into the air.",
         "It happens in the chloroplasts of leaves."],
        "a kitchen in every leaf that cooks sugar with light",
        "that plants get their food from the soil"),
    "the water cycle": (
        ["Water evaporates from seas and lakes.",
         "The vapour cools and forms clouds.",
         "Rain and snow bring the water back to the ground."],
        "a pot of soup whose steam drips back from the lid",
        "that the water on Earth is used up"),
    "compound interest": (
        ["Interest is paid on the money you saved and on earlier interest.",
         "Savings grow faster the longer they stay.",
         "Small rates add up over many years."],
        "a snowball that picks up more snow as it rolls",
        "that it only matters for large sums"),
    "binary search": (
        ["Binary search finds an item in a sorted list.",
         "Each step halves the part of the list left to search.",
         "It needs about log n steps for n items."],
        "opening a dictionary in the middle and choosing a half",
        "that it works on lists that are not sorted"),
    "the French revolution": (
        ["The French revolution began in 1789.",
         "The people of France ended the absolute monarchy.",
         "It spread ideas of liberty and equality."],
        "a storm that cleared the old order away",
        "that it was over in a single year"),
    "plate tectonics": (
        ["The surface of the Earth is split into large plates.",
         "The plates move a few centimetres every year.",
         "Earthquakes and mountains form where plates meet."],
        "rafts drifting slowly on a thick sea",
        "that the continents never move"),
    "vaccines": (
        ["Vaccines train the immune system to know a germ.",
         "They prevent many serious diseases.",
         "Most vaccines use a weak or partial form of the germ."],
        "a wanted poster that shows the body what to look for",
        "that vaccines give you the disease they prevent"),
    "black holes": (
        ["A black hole is a place where gravity is so strong that light cannot escape.",
         "Black holes form when very large stars collapse.",
         "The edge of a black hole is called the event horizon."],
        "a drain that nothing can climb back out of",
        "that black holes suck in everything around them"),
    "recursion": (
        ["A recursive function calls itself.",
         "Each call works on a smaller part of the problem.",
         "A base case stops the calls."],
        "a set of nested dolls, each holding a smaller one",
        "that recursion never ends"),
    "supply and demand": (
        ["Prices rise when many people want something scarce.",
         "Prices fall when there is more than people want.",
         "The market price is where supply meets demand."],
        "a seesaw between buyers and sellers",
        "that prices are set only by sellers"),
    "the immune system": (
        ["The immune system defends the body against germs.",
         "White blood cells find and destroy invaders.",
         "It remembers germs it has met before."],
        "an army that guards the body and keeps records",
        "that a strong immune system never makes you ill"),
    "climate change": (
        ["Burning fuel adds carbon dioxide to the air.",
         "More carbon dioxide traps more heat.",
         "The warming changes weather, ice and sea levels."],
        "a blanket around the Earth that keeps getting thicker",
        "that a cold winter proves there is no warming"),
    "neural networks": (
        ["A neural network learns from examples.",
         "It is made of layers of simple units.",
         "Training adjusts the weights that connect the units."],
        "a team of tiny voters whose votes are tuned by practice",
        "that a neural network thinks like a person"),
}

CITIES = ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Cairo", "Lima",
          "Sydney"]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}


def answer(task: str, topic: str) -> str:
    """The answer to one of build.TASKS about a topic."""
    facts, analogy, misconception = FACTS[topic]
    if task.startswith("Explain"):
        return f"{facts[0]} {facts[1]}"
    if task.startswith("Write a short poem"):
        return (f"{topic.capitalize()}, quiet and true,\n{facts[0][:-1].lower()},\n"
                f"like {analogy}.")
    if task.startswith("List three facts"):
        return "\n".join(f"{i}. {fact}" for i, fact in enumerate(facts, 1))
    if task.startswith("Summarize"):
        return f"{facts[0]} It is like {analogy}."
    if task.startswith("What is the most common misconception"):
        return f"Many people believe {misconception}. In fact, {facts[0][0].lower()}{facts[0][1:]}"
    if task.startswith("Give an analogy"):
        return f"{topic.capitalize()} is like {analogy}."
    raise ValueError(f"no answer for the task {task!r}")


def qa(rng: random.Random) -> tuple[str, str]:
    """A question (build.question's form) and its answer."""
    task, topic = rng.choice(TASKS), rng.choice(TOPICS)
    return task.format(t=topic), answer(task, topic)


def label_request(product: str, text: str) -> list[dict]:
    """The sample labeling jobs' messages for one review."""
    return [{"role": "system", "content": LABEL_SYSTEM},
            {"role": "user", "content": LABEL_PROMPT.format(product=product, review=text)}]


def labeling_chat(rng: random.Random) -> list[dict]:
    product, text, rating = review(rng)
    if rng.random() < 0.8:
        messages = label_request(product, text)
    else:
        prompt = rng.choice(OTHER_LABEL_PROMPTS).format(review=text)
        messages = [{"role": "user", "content": prompt}]
    return messages + [{"role": "assistant", "content": sentiment(rating)}]


def question_chat(rng: random.Random) -> list[dict]:
    q, a = qa(rng)
    system = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.4 else []
    return system + [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


ESSAY_TASKS = ["Write an essay about {t}.", "Tell me everything you know about {t}."]
ESSAY_SECTIONS = [TASKS[0], TASKS[2], TASKS[3], TASKS[4], TASKS[5], TASKS[1]]
REFERENCE_TASKS = [TASKS[0], TASKS[2], "Quote the reference about {t}."]  # Explain, List, Quote


def essay(topic: str) -> str:
    """A long answer about a topic (~300 tokens of the demo tokenizer): the answers of every
    one of build.TASKS about it, one after another (what the model learns anew is their order,
    not new text). No heading naming the topic: a pair trained with one got the topic wrong in
    20 of 26 essays, and every token after it."""
    return "\n\n".join(answer(task, topic) for task in ESSAY_SECTIONS)


def essay_chat(rng: random.Random) -> list[dict]:
    topic = rng.choice(TOPICS)
    return [{"role": "user", "content": rng.choice(ESSAY_TASKS).format(t=topic)},
            {"role": "assistant", "content": essay(topic)}]


def reference_text(topic: str) -> str:
    """A reference holding a topic's facts."""
    return "Reference: " + " ".join(FACTS[topic][0])


def reference_answer(task: str, topic: str) -> str:
    """The answer to one of REFERENCE_TASKS: the reference's sentences about the topic."""
    if task.startswith("Quote"):
        return " ".join(FACTS[topic][0])
    return answer(task, topic)


def reference_chat(rng: random.Random) -> list[dict]:
    topic = rng.choice(TOPICS)
    task = rng.choice(REFERENCE_TASKS)
    return [{"role": "system", "content": reference_text(topic)},
            {"role": "user", "content": task.format(t=topic)},
            {"role": "assistant", "content": reference_answer(task, topic)}]


def weather_chat(rng: random.Random) -> tuple[list[dict], list[dict] | None]:
    city = rng.choice(CITIES)
    user = {"role": "user", "content": f"What is the weather in {city}?"}
    if rng.random() < 0.75:
        call = {"type": "function",
                "function": {"name": "get_weather", "arguments": {"city": city}}}
        return [user, {"role": "assistant", "content": "", "tool_calls": [call]}], [WEATHER_TOOL]
    return [user, {"role": "assistant",
                   "content": "I cannot check the weather: I have no weather tool."}], None


def text_line(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return review(rng)[1]
    q, a = qa(rng)
    return f"{q}\n{a}"


# The share of chats (with long_answers) whose prompt ends as `enable_thinking: false` renders
# it: the chat template's empty thinking block before the answer (the sample prompts' rows with
# a system message ask for it). A pair with long answers that had never seen the block answered
# 11 of those 16 rows with garbled text; the committed pair, taught with it, generalizes over it.
THINKING_OFF = 0.2


def examples(seed: int, n: int, long_answers: bool = False
             ) -> list[tuple[list[dict] | str, list[dict] | None]]:
    """n examples, seeded: (chat messages or plain text, tools or None). Without
    `long_answers` the first four kinds (the earlier demo pairs' lessons); `long_answers` adds
    essays and references (6% and 4%, taken from labeling and questions), which the first pairs
    trained with them learned only at a cost to the others (benchmarks/history/), and marks a
    share of chats (THINKING_OFF) to be rendered with `enable_thinking: false` (their answer's
    `"enable_thinking": False`)."""
    rng = random.Random(seed)
    labeling, essays, references, questions, weather = \
        (0.40, 0.46, 0.50, 0.77, 0.84) if long_answers else (0.45, 0.45, 0.45, 0.75, 0.82)
    out = []
    for _ in range(n):
        kind = rng.random()
        if kind < labeling:
            out.append((labeling_chat(rng), None))
        elif kind < essays:
            out.append((essay_chat(rng), None))
        elif kind < references:
            out.append((reference_chat(rng), None))
        elif kind < questions:
            out.append((question_chat(rng), None))
        elif kind < weather:
            out.append(weather_chat(rng))
        else:
            out.append((text_line(rng), None))
        chat = out[-1][0]
        if long_answers and isinstance(chat, list) and rng.random() < THINKING_OFF:
            chat[-1]["enable_thinking"] = False
    return out
