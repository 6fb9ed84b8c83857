"""Reference tokens and log-probabilities of a GGUF model, computed by llama.cpp itself
(llama-cpp-python), for tests/test_gguf.py: each prompt's token ids, then greedy generation
with the top log-probabilities at every generated position.

    pip install llama-cpp-python numpy   # builds llama.cpp (minutes)
    python tools/reference/llamacpp_reference.py MODEL.gguf OUT.json

Prompts are rendered with the model's own chat template (by transformers, as batchrun renders
them) and stored as text, so both sides tokenize the same text.
"""

import json
import sys

import numpy as np
from llama_cpp import Llama

QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colors.",
    "Review: The robot vacuum broke after three days. Total waste of money.\n"
    "Is this review positive or negative?",
    "Translate 'good morning' into Spanish.",
    "What is 12 plus 7?",
]
PLAIN = ["The quick brown fox", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
NEW_TOKENS = 24
TOP = 5


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def main(model: str, out: str) -> None:
    llm = Llama(model_path=model, n_ctx=1024, logits_all=True, verbose=False, seed=0,
                n_threads=2)
    template = llm.metadata["tokenizer.chat_template"]
    from jinja2 import Environment

    render = Environment().from_string(template)
    texts = [render.render(messages=[{"role": "user", "content": q}],
                           add_generation_prompt=True) for q in QUESTIONS] + PLAIN
    cases = []
    for text in texts:
        prompt = llm.tokenize(text.encode(), add_bos=False, special=True)
        llm.reset()
        llm.eval(prompt)
        tokens, tops = [], []
        for _ in range(NEW_TOKENS):
            logprobs = log_softmax(np.array(llm.scores[llm.n_tokens - 1]))
            order = np.argsort(-logprobs)[:TOP]
            tops.append([[int(i), round(float(logprobs[i]), 5)] for i in order])
            token = int(order[0])
            tokens.append(token)
            if token == llm.token_eos():
                break
            llm.eval([token])
        cases.append({"text": text, "prompt": prompt, "greedy": tokens, "top": tops})
    import llama_cpp

    with open(out, "w") as f:
        json.dump({"model": model.rsplit("/", 1)[-1],
                   "llama_cpp_python": llama_cpp.__version__, "cases": cases}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
