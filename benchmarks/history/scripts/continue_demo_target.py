"""Train a saved demo target further (issue 18, session 18's tries 7 and 8): its lessons
(`lessons.examples(0, 20000, long_answers=True)`) for N more steps, a warm-up and a cosine decay
peaking at LR (train.continue_training, the computation of `train --more-steps`), written back
into the folder with its held-out labeling accuracy printed.

    python scripts/continue_demo_target.py FOLDER N LR
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import batchrun  # noqa: E402, F401  (BLAS routing before MLX)
from batchrun.models import lessons, train  # noqa: E402


def main() -> None:
    from transformers import PreTrainedTokenizerFast

    out, steps, lr = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    config = json.loads((out / "config.json").read_text())
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    data = train.encode_examples(tokenizer, lessons.examples(0, 20000, long_answers=True))
    model = train.make_model(config)
    model.load_weights(str(out / "model.safetensors"))
    loss = train.continue_training(model, data, steps, 0, lr, config)
    train.write_model(out, model, config)
    print(f"loss {loss:.4f}, held-out labels {train.labeling_accuracy(out):.3f}")


if __name__ == "__main__":
    main()
