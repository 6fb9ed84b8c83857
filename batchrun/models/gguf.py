"""GGUF files (llama.cpp's, Ollama's, LM Studio's) as mlx-lm model folders.

A GGUF file holds a model's weights, hyperparameters, tokenizer and chat template. `convert`
turns one into an mlx-lm folder once, kept in batchrun's cache folder under the file's SHA-256,
and everything after (the engine, the prefix cache's fingerprint, Ray workers) loads that
folder as it loads any other.

The cache is untrusted: a converted folder is used only while it is whole (a folder, no link,
just the regular files its marker lists, each of the size and SHA-256 the marker records);
anything else is converted again, into a new folder renamed into place. Work folders a killed
conversion left are removed by the next one.

- Weights: MLX reads GGUF tensors itself (`mx.load`): F32, F16 and BF16 as they are, Q4_0,
  Q4_1 and Q8_0 as MLX's affine quantization with groups of 32 (4 and 8 bits), which the
  folder's config.json declares a layer at a time. Other types (the K-quants, the IQ types)
  MLX would silently widen to float16; they are refused, by name, before anything loads.
- Names: llama.cpp's tensor names mapped to mlx-lm's (the Llama, Qwen2 and Qwen3 layouts).
  llama.cpp's converter permutes a Llama model's query and key rows for its rotary layout;
  they are put back (without it the logits are far off).
- Tokenizer: a byte-level BPE (the `gpt2` kind) built with the `tokenizers` library from the
  file's vocabulary, merges and pre-tokenizer name, its control tokens special; the chat
  template, BOS and EOS from the file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import secrets
import stat
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchrun.models import ModelError
from batchrun.models.fingerprint import fd_digests

# GGUF tensor types (ggml_type) MLX reads as they are, and names for the others in messages.
READ_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 30: "BF16"}
OTHER_TYPES = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K",
               13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
               19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8",
               25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0",
               35: "TQ2_0", 39: "MXFP4"}
# GGUF architecture -> mlx-lm model type
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# The pre-tokenizer names of byte-level BPE vocabularies (tokenizer.ggml.pre) and how text is
# split before BPE: GPT-2's rule, digits one by one first, or a pattern of its own.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                 r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}"
                r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"gpt-2": "gpt2", "default": "gpt2", "smollm": "digits", "llama-bpe": "llama3",
                  "llama3": "llama3", "qwen2": "qwen2"}
# Tensors a layer: llama.cpp's name -> mlx-lm's, below model.layers.N
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
GROUP = 32  # ggml's legacy quantization block: MLX's group size for it
CONVERTER = 2  # bumped when a converted folder would differ: an older one is converted again
MARKER = "gguf.json"  # a converted folder's list of its files, written last
MARKER_BYTES = 1 << 16
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
LOCK = ".convert.lock"  # held while converting: one conversion at a time in a cache folder
STALE = ".gguf-"  # a conversion's work folder; one seen under the lock was left by a killed one
ABSENT = "is absent"
COPY_BYTES = 8 << 20
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL = 1, 2, 3  # tokenizer.ggml.token_type values
TOKEN_USER_DEFINED = 4  # an added token that is matched whole but is not special
MAX_ITEMS = 1 << 24  # a count in the header beyond this is a damaged file


class GGUFError(ModelError):
    """The file is not a GGUF batchrun can run; the message says why."""


def gguf_in(path: str) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf file of a folder that
    holds no config.json; None for anything else (an mlx-lm folder, a Hugging Face id)."""
    p = Path(path).expanduser()
    if p.suffix.lower() == ".gguf" and not p.is_dir():
        return p
    if p.is_dir() and not (p / "config.json").exists():
        found = sorted(q for q in p.glob("*.gguf") if q.is_file() and not q.is_symlink())
        if len(found) > 1:
            raise GGUFError(f"{path} holds {len(found)} GGUF files; pass the one to run")
        return found[0] if found else None
    return None


# -- the header ----------------------------------------------------------------------------

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}


class _Reader:
    def __init__(self, data: mmap.mmap):
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise GGUFError("the file ends inside its header (damaged or cut short)")
        chunk = self.data[self.at:self.at + n]
        self.at += n
        return chunk

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self) -> int:
        n = self.scalar("<Q")
        if n > MAX_ITEMS:
            raise GGUFError("the file's header counts more items than a model has (damaged)")
        return n

    def string(self) -> str:
        return self.take(self.count()).decode("utf-8", "replace")

    def skip_value(self, kind: int) -> None:
        if kind in _SCALARS:
            self.at += struct.calcsize(_SCALARS[kind])
        elif kind == 8:
            n = self.count()  # read before `at` is: count() moves it
            self.at += n
        elif kind == 9:
            inner, n = self.scalar("<I"), self.count()
            if inner in _SCALARS:
                self.at += n * struct.calcsize(_SCALARS[inner])
            else:
                for _ in range(n):
                    self.skip_value(inner)
        else:
            raise GGUFError(f"the file's header has a value of unknown type {kind} (damaged)")
        if self.at > len(self.data):
            raise GGUFError("the file ends inside its header (damaged or cut short)")


def tensor_types(path: Path) -> dict[str, int]:
    """Each tensor's ggml type, from the file's header (the metadata skipped over)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise GGUFError(f"{path.name} is not a GGUF file (too short)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            r = _Reader(data)
            if r.take(4) != b"GGUF":
                raise GGUFError(f"{path.name} is not a GGUF file")
            version = r.scalar("<I")
            if version not in (2, 3):
                raise GGUFError(f"{path.name} is GGUF version {version}; versions 2 and 3 "
                                "are read")
            tensors, entries = r.count(), r.count()
            for _ in range(entries):
                r.take(r.count())  # the key
                r.skip_value(r.scalar("<I"))
            types = {}
            for _ in range(tensors):
                name = r.string()
                dims = r.scalar("<I")
                if dims > 8:
                    raise GGUFError(f"{path.name}: tensor {name!r} has {dims} dimensions "
                                    "(damaged)")
                r.take(8 * dims)
                types[name] = r.scalar("<I")
                r.take(8)  # its offset
            return types


def check_types(path: Path) -> None:
    """Refuse a file with a tensor type MLX does not read as it is, naming the type."""
    unread = {}
    for name, kind in tensor_types(path).items():
        if kind not in READ_TYPES:
            unread.setdefault(OTHER_TYPES.get(kind, f"type {kind}"), name)
    if unread:
        kinds = ", ".join(sorted(unread))
        raise GGUFError(f"{path.name} holds {kinds} tensors (e.g. {next(iter(unread.values()))}"
                        "); batchrun runs GGUF files whose tensors are F32, F16, BF16, Q4_0, "
                        "Q4_1 or Q8_0 (a Q4_0 or Q8_0 download of the model, or its mlx-lm "
                        "conversion)")


# -- the conversion ------------------------------------------------------------------------


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def converted(path: Path, cache_root: Path, say: Callable[[str], None] = _to_stderr, *,
              follow: bool = True, expect: str | None = None) -> Path:
    """The mlx-lm folder of GGUF file `path`, converted into `cache_root/models` the first
    time (a folder per file content); a folder found damaged is converted again, said through
    `say`. `follow`: whether a link at `path` itself is followed (one the user named, not one
    in a folder searched or in the cache); `expect`: the SHA-256 the file must have."""
    fd = _open_source(path, follow)
    try:
        digest = _digest(fd, path)
        if expect is not None and digest != expect:
            raise GGUFError(f"{path} changed after it was checked: run again")
        models = _models_folder(cache_root)
        try:
            return models.path / _whole_or_converted(models, fd, digest, path.name, say)
        except OSError as e:
            raise GGUFError(f"cannot convert {path.name} in {models.path}: "
                            f"{e.strerror or e}") from None
        finally:
            models.close()
    finally:
        os.close(fd)


def _whole_or_converted(models, fd: int, digest: str, source: str,
                        say: Callable[[str], None]) -> str:
    """The name of the whole converted folder of the open file, of SHA-256 `digest`: the one
    in `models`, else one converted now (a damaged one said and replaced)."""
    name = folder_name(digest)
    if damage(models, name, digest) is None:
        return name
    with models.locked(LOCK):
        for stale in models.names():
            if stale.startswith(STALE):  # a conversion killed part-way left it
                models.remove_tree(stale)
        why = damage(models, name, digest)  # another process may have just made it
        if why is None:
            return name
        if why != ABSENT:
            say(f"{models.path / name} (the conversion of {source}) {why}: converting it again")
        _convert_into(models, fd, source, digest)
        return name


def is_converted(path: Path, cache_root: Path, follow: bool = True) -> bool:
    """Whether GGUF file `path` has a whole converted folder in the cache (the file hashed,
    unless its digest is remembered; nothing created)."""
    from batchrun.cache.folder import PrivateFolder

    fd = _open_source(path, follow)
    try:
        digest = _digest(fd, path)
        try:
            models = PrivateFolder.open(cache_root, ["models"], create=False)
        except OSError:
            return False
        try:
            return damage(models, folder_name(digest), digest) is None
        finally:
            models.close()
    finally:
        os.close(fd)


def _digest(fd: int, path: Path) -> str:
    try:
        return fd_digests([fd])[0]  # remembered between runs while the file is unchanged
    except OSError as e:
        raise GGUFError(f"cannot read {path}: {e.strerror or e}") from None


def folder_name(digest: str) -> str:
    return f"gguf-{digest[:24]}"


def _open_source(path: Path, follow: bool) -> int:
    """The GGUF file opened for reading (a FIFO or device refused, never read)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise GGUFError(f"{path} is a link: batchrun follows no link there") from None
        raise GGUFError(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise GGUFError(f"{path} is not a regular file")
    return fd


def _models_folder(cache_root: Path):
    from batchrun.cache.folder import PrivateFolder

    try:
        models = PrivateFolder.open(cache_root, ["models"])
    except OSError as e:
        raise GGUFError(f"cannot use the cache folder {cache_root} for the converted model: "
                        f"{e.strerror or e}") from None
    problem = models.sharing_problem()
    if problem:  # another user could put weights there for us to load
        models.close()
        raise GGUFError(f"{models.path} {problem}: batchrun keeps converted models only in "
                        "a folder of its own (set BATCHRUN_CACHE_DIR)")
    return models


def _convert_into(models, fd: int, source: str, digest: str) -> None:
    """Convert the open GGUF file, of SHA-256 `digest`, into a new folder of `models`, renamed
    into place when whole."""
    work = models.new_folder(STALE)
    folder = models.path / work
    try:
        # MLX reads a GGUF file by its path, and opens it for writing (gguflib maps it
        # shared and writable): it is given a private copy, hashed as it is made, so what is
        # converted is exactly the file the folder is named for, and a read-only file
        # converts too.
        copy = folder / source
        if _copy(fd, copy) != digest:
            raise GGUFError(f"{source} changed while it was read: run again")
        convert(copy, folder)
        copy.unlink()
        _write_marker(folder, source, digest)
        name = folder_name(digest)
        aside = f"{STALE}old-{secrets.token_hex(8)}"
        with contextlib.suppress(FileNotFoundError):  # a damaged one: readers see it or ours
            os.rename(name, aside, src_dir_fd=models.fd, dst_dir_fd=models.fd)
        os.rename(work, name, src_dir_fd=models.fd, dst_dir_fd=models.fd)
        models.remove_tree(aside)
    finally:
        models.remove_tree(work)  # gone once renamed


def _copy(fd: int, dest: Path) -> str:
    """Copy the open file into `dest` (created exclusively); the SHA-256 of the bytes copied."""
    h = hashlib.sha256()
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                  0o600)
    try:
        at = 0
        while chunk := os.pread(fd, COPY_BYTES, at):
            h.update(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(out, view):]
            at += len(chunk)
    finally:
        os.close(out)
    return h.hexdigest()


def _write_marker(folder: Path, source: str, digest: str) -> None:
    """gguf.json, written last: the source's SHA-256 and each file's size and SHA-256."""
    names = sorted(p.name for p in folder.iterdir())
    fds = [os.open(folder / n, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC) for n in names]
    try:
        sizes = [os.fstat(fd).st_size for fd in fds]
        digests = fd_digests(fds)
    finally:
        for fd in fds:
            os.close(fd)
    marker = {"source": source, "sha256": digest, "converter": CONVERTER,
              "files": {n: {"bytes": b, "sha256": d}
                        for n, b, d in zip(names, sizes, digests, strict=True)}}
    with open(folder / MARKER, "x") as f:
        f.write(json.dumps(marker))


def damage(models, name: str, digest: str | None = None) -> str | None:
    """What is wrong with the converted folder `name` of the open `models` folder, in words
    (ABSENT when there is none); None when it is whole: a folder, no link, holding just the
    regular files its marker (written last) lists, each of the size and SHA-256 it records,
    converted from a file of SHA-256 `digest` (any, when None) by this converter."""
    from batchrun.cache.folder import NotRegularFile, PrivateFolder

    try:
        fd = os.open(name, _DIR, dir_fd=models.fd)
    except FileNotFoundError:
        return ABSENT
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            return "is a link or a file, not a folder batchrun made"
        return f"cannot be read ({e.strerror or e})"
    folder = PrivateFolder(models.path / name, fd)
    try:
        try:
            marker = json.loads(folder.read(MARKER, MARKER_BYTES) or b"null")
        except (NotRegularFile, ValueError):
            return f"has a damaged {MARKER}"
        if not isinstance(marker, dict):
            return f"is incomplete (no {MARKER})"
        source, files = marker.get("sha256"), marker.get("files")
        if not isinstance(source, str) or folder_name(source) != name \
                or digest not in (None, source):
            return "is not the conversion its name says"
        if marker.get("converter") != CONVERTER or not isinstance(files, dict) \
                or not all(isinstance(v, dict) for v in files.values()):
            return "was made by another version of batchrun's converter"
        return _files_damage(folder, files)
    finally:
        folder.close()


def _files_damage(folder, files: dict[str, dict]) -> str | None:
    present = folder.names()
    missing = [n for n in FILES if n not in files or n not in present]
    if missing:
        return f"lacks {', '.join(missing)}"
    if present != set(files) | {MARKER}:
        return "holds files batchrun did not write there"
    fds = []
    try:
        for n in sorted(files):
            try:
                fds.append(os.open(n, _READ, dir_fd=folder.fd))
            except OSError:
                return f"has {n} as a link or not a file"
            st = os.fstat(fds[-1])
            if not stat.S_ISREG(st.st_mode) or st.st_size != files[n].get("bytes"):
                return f"has a damaged {n}"
        for n, got in zip(sorted(files), fd_digests(fds), strict=True):
            if got != files[n].get("sha256"):
                return f"has a damaged {n}"
        return None
    finally:
        for fd in fds:
            os.close(fd)


def convert(path: Path, folder: Path) -> None:
    """Write the mlx-lm folder of GGUF file `path` into `folder` (config.json,
    model.safetensors, tokenizer.json, tokenizer_config.json)."""
    import mlx.core as mx

    check_types(path)
    try:
        weights, meta = mx.load(str(path), format="gguf", return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise GGUFError(f"{path.name} could not be read: {e}") from None
    arch = _text(meta, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path.name} is a {arch or 'unnamed'} model; batchrun runs GGUF files "
                        f"of {', '.join(sorted(ARCHITECTURES))} models (others: convert the "
                        "original with mlx_lm.convert)")
    try:
        config = _config(meta, arch, weights)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{path.name}: its {arch} hyperparameters are not valid numbers") \
            from None
    _check_shape(config, weights, path.name)
    weights, quantization = _weights(weights, config, arch)
    if quantization:
        config["quantization"] = quantization
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    try:
        _write_tokenizer(meta, folder, path.name)
    except GGUFError:
        raise
    except Exception as e:  # noqa: BLE001  (the tokenizers library on a hostile vocabulary)
        raise GGUFError(f"{path.name}: its tokenizer cannot be built from the file's "
                        f"vocabulary ({type(e).__name__})") from None


def _check_shape(config: dict, weights: dict, source: str) -> None:
    """The hyperparameters against the tensors the file holds, before a model of that shape
    is built (a file could declare a billion layers)."""
    layers = {name.split(".")[1] for name in weights if name.startswith("blk.")}
    count = config["num_hidden_layers"]
    if len(layers) != count or not all(
            i.isascii() and i.isdigit() and str(int(i)) == i and int(i) < count for i in layers):
        raise GGUFError(f"{source} declares {config['num_hidden_layers']} layers but holds "
                        f"tensors of {len(layers)}")
    embedding = weights.get("token_embd.weight")
    if embedding is None or embedding.shape[0] != config["vocab_size"] or not (
            embedding.shape[-1] == config["hidden_size"]
            or embedding.shape[-1] * 32 // 4 == config["hidden_size"]
            or embedding.shape[-1] * 32 // 8 == config["hidden_size"]):
        raise GGUFError(f"{source}: its token embedding does not match the vocabulary and "
                        "width it declares")
    if min(config["num_attention_heads"], config["num_key_value_heads"],
           config["hidden_size"], config["intermediate_size"]) <= 0:
        raise GGUFError(f"{source} declares a width or head count of 0")


def _value(meta: dict, key: str, default: Any = None) -> Any:
    v = meta.get(key, default)
    if hasattr(v, "item") and getattr(v, "size", 0) == 1:
        return v.item()
    return v


def _text(meta: dict, key: str) -> str | None:
    v = meta.get(key)
    return v if isinstance(v, str) else None


def _config(meta: dict, arch: str, weights: dict) -> dict:
    def need(name: str) -> Any:
        v = _value(meta, f"{arch}.{name}")
        if v is None:
            raise GGUFError(f"the file's metadata has no {arch}.{name}")
        return v

    tokens = meta.get("tokenizer.ggml.tokens")
    heads = int(need("attention.head_count"))
    config = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_value(meta, f"{arch}.attention.head_count_kv", heads)),
        "rms_norm_eps": float(_value(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_value(meta, f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": len(tokens) if isinstance(tokens, list) else int(need("vocab_size")),
        "max_position_embeddings": int(_value(meta, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in weights,
    }
    key_length = _value(meta, f"{arch}.attention.key_length")
    if key_length:
        config["head_dim"] = int(key_length)
    if "rope_freqs.weight" in weights:
        config["rope_scaling"] = _llama3_scaling(weights["rope_freqs.weight"], config)
    if arch == "qwen2":
        config["attention_bias"] = True
    return config


# Llama 3.1 and later scale their rotary frequencies; llama.cpp's converter stores the result
# (a factor a frequency, `rope_freqs`), not the settings. The settings Meta's models use, tried
# in turn: the one whose factors are the file's is the model's.
LLAMA3_SCALINGS = [{"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
                   for factor in (8.0, 32.0, 16.0, 4.0, 2.0)]


def llama3_factors(scaling: dict, head_dim: int, base: float) -> list[float]:
    """The factor Llama 3's rotary scaling divides each frequency by."""
    import math

    old, low, high = (scaling["original_max_position_embeddings"],
                      scaling["low_freq_factor"], scaling["high_freq_factor"])
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * base ** (i / head_dim)
        if wavelength < old / high:
            factors.append(1.0)
        elif wavelength > old / low:
            factors.append(scaling["factor"])
        else:
            smooth = (old / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return factors


def _llama3_scaling(rope_freqs, config: dict) -> dict:
    import mlx.core as mx

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    given = [float(x) for x in rope_freqs.astype(mx.float32).tolist()]
    for scaling in LLAMA3_SCALINGS:
        want = llama3_factors(scaling, head_dim, config["rope_theta"])
        if len(want) == len(given) and all(abs(a - b) <= 1e-3 * max(1.0, b)
                                           for a, b in zip(given, want, strict=True)):
            return scaling
    raise GGUFError("the file scales its rotary frequencies in a way batchrun does not "
                    "recognize (it reads Llama 3.1's and 3.2's): use the model's mlx-lm "
                    "conversion")


def _weights(weights: dict, config: dict, arch: str) -> tuple[dict, dict]:
    """mlx-lm's names for llama.cpp's tensors, the Llama query and key rows un-permuted; and
    the quantization of each quantized layer ({} when none is)."""
    out, quantization = {}, {}
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    for name, array in weights.items():
        if name == "rope_freqs.weight":
            continue  # read into the config's rope_scaling
        stem, _, part = name.rpartition(".")
        base = _mlx_name(stem)
        if base is None:
            raise GGUFError(f"the file holds a tensor batchrun cannot place: {name}")
        if arch == "llama" and stem.endswith((".attn_q", ".attn_k")):
            heads = config["num_attention_heads"] if stem.endswith(".attn_q") \
                else config["num_key_value_heads"]
            array = _unpermute(array, heads, head_dim)
        out[f"{base}.{part}"] = array
        if part == "scales":
            bits = weights[f"{stem}.weight"].shape[-1] * 32 // (array.shape[-1] * GROUP)
            quantization[base] = {"group_size": GROUP, "bits": bits}
    if quantization:
        kinds = {(q["group_size"], q["bits"]) for q in quantization.values()}
        common = max(kinds, key=lambda k: sum((q["group_size"], q["bits"]) == k
                                              for q in quantization.values()))
        quantization = {"group_size": common[0], "bits": common[1],
                        **{k: v for k, v in quantization.items()
                           if (v["group_size"], v["bits"]) != common}}
    return out, quantization


def _mlx_name(stem: str) -> str | None:
    if stem in _TOP_NAMES:
        return _TOP_NAMES[stem]
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    return None


def _unpermute(array, heads: int, head_dim: int):
    """llama.cpp's converter wrote each head's rows as (half, pair) where the model's are
    (pair, half): rows back in the model's order (quantized rows too: their groups run along
    the other axis)."""
    if array.shape[0] != heads * head_dim:
        raise GGUFError("a query or key tensor's rows do not match the heads the file declares")
    rest = array.shape[1:]
    return array.reshape(heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(array.shape)


# -- the tokenizer -------------------------------------------------------------------------


def _write_tokenizer(meta: dict, folder: Path, source: str) -> None:
    from tokenizers import AddedToken
    from tokenizers.processors import TemplateProcessing

    kind = _text(meta, "tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError(f"{source} has no vocabulary")
    vocab = {token: i for i, token in enumerate(tokens)}
    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if hasattr(types, "tolist") else list(types or [])
    if kind == "gpt2":
        tok = _byte_level_bpe(meta, vocab, source)
    elif kind == "llama":
        tok = _sentencepiece_bpe(meta, tokens, vocab, types, source)
    else:
        raise GGUFError(f"{source} has a {kind or 'missing'} tokenizer; batchrun reads byte-level "
                        "BPE (gpt2) and SentencePiece BPE (llama) tokenizers from GGUF files")
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t in (TOKEN_UNKNOWN, TOKEN_CONTROL)])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == TOKEN_USER_DEFINED])

    def token(key: str) -> str | None:
        i = _value(meta, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    add_bos = bool(_value(meta, "tokenizer.ggml.add_bos_token", kind == "llama")) \
        and bos is not None
    if add_bos:
        tok.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                special_tokens=[(bos, vocab[bos])])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos,
              "clean_up_tokenization_spaces": False,
              "model_max_length": int(_value(meta, f"{_text(meta, 'general.architecture')}"
                                                   ".context_length", 4096))}
    for key, value in (("bos_token", bos), ("eos_token", eos),
                       ("pad_token", token("tokenizer.ggml.padding_token_id")),
                       ("unk_token", token("tokenizer.ggml.unknown_token_id"))):
        if value is not None:
            config[key] = value
    template = _text(meta, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def converted_folders(cache_root: Path) -> list[tuple[Path, str, int, str | None]]:
    """(folder, source file name, bytes, what is wrong with it or None) of each converted
    folder in the cache; nothing created."""
    from batchrun.cache.folder import PrivateFolder

    try:
        models = PrivateFolder.open(cache_root, ["models"], create=False)
    except OSError:
        return []
    found = []
    try:
        for name in sorted(n for n in models.names() if n.startswith("gguf-")):
            why = damage(models, name)
            source, size = ("?", 0) if why else _summary(models, name)
            found.append((models.path / name, source, size, why))
    finally:
        models.close()
    return found


def _summary(models, name: str) -> tuple[str, int]:
    """A whole converted folder's source file name and size, from its marker."""
    from batchrun.cache.folder import PrivateFolder

    try:
        folder = PrivateFolder(models.path / name, os.open(name, _DIR, dir_fd=models.fd))
        try:
            marker = json.loads(folder.read(MARKER, MARKER_BYTES) or b"{}")
        finally:
            folder.close()
        return str(marker["source"])[:200], sum(f["bytes"] for f in marker["files"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # changed meanwhile
        return "?", 0


def remove_converted(cache_root: Path, name: str) -> Path | None:
    """Remove the converted folder `name` (gguf-...; a link there is removed, not followed);
    its path, or None when there is none."""
    from batchrun.cache.folder import PrivateFolder

    try:
        models = PrivateFolder.open(cache_root, ["models"], create=False)
    except OSError:
        return None
    try:
        with models.locked(LOCK):  # not while a conversion renames it into place
            if name not in models.names():
                return None
            models.remove_tree(name)
            return models.path / name
    finally:
        models.close()


def _byte_level_bpe(meta: dict, vocab: dict, source: str):
    """GPT-2's kind: bytes as printable characters, merges given, text split first by the
    pre-tokenizer the file names."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = _text(meta, "tokenizer.ggml.pre") or "default"
    split = PRE_TOKENIZERS.get(pre)
    if split is None:
        raise GGUFError(f"{source}'s tokenizer splits text the {pre!r} way, which batchrun "
                        f"does not know ({', '.join(sorted(PRE_TOKENIZERS))} are known)")
    pairs = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    if any(len(p) != 2 for p in pairs):
        raise GGUFError(f"{source}'s tokenizer has a merge that is not two tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=split == "llama3"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                          use_regex=split in ("gpt2", "digits"))
    if split == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif split in ("llama3", "qwen2"):
        pattern = _LLAMA3_SPLIT if split == "llama3" else _QWEN2_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta: dict, tokens: list, vocab: dict, types: list, source: str):
    """SentencePiece's BPE (Llama 2's, Mistral's): "▁" for a space, a space before the text,
    unknown bytes as <0xXX> tokens, and merges ranked by the merged piece's score (the file
    keeps scores, not merges)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    scores = scores.tolist() if hasattr(scores, "tolist") else list(scores or [])
    if len(scores) != len(tokens):
        raise GGUFError(f"{source}'s SentencePiece vocabulary has no score for each token")
    merges = []
    for piece, score in zip(tokens, scores, strict=True):
        if types and types[vocab[piece]] != TOKEN_NORMAL:
            continue  # control, unknown and byte tokens are never merged into
        pairs = [(piece[:i], piece[i:]) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges += [(left, right, score) for left, right in pairs]
    merges.sort(key=lambda m: m[2], reverse=True)  # stable: ties keep vocabulary order
    unk_id = _value(meta, "tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges],
                               unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if _value(meta, "tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)]
                                       if _value(meta, "tokenizer.ggml.add_space_prefix", True)
                                       else []))
    return tok
