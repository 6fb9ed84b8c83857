"""What fingerprinting a model costs: the first full read of a multi-GB weight file (from disk,
then from the page cache) and a later run's memo hit.

    python scripts/fingerprint_cost.py [--size-gb 3] [--dir /tmp]

Writes a model folder of random bytes under --dir and removes it afterwards; the memo goes to a
temporary cache folder. Dropping the page cache needs root; without it the "disk" figure is
left out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import batchrun  # noqa: F401  (routes MLX to OpenBLAS before mlx.core is imported)

CHUNK = 64 << 20


def write_model(folder: Path, size: int) -> None:
    (folder / "config.json").write_text('{"model_type": "llama"}')
    with open(folder / "model.safetensors", "wb") as f:
        block = os.urandom(CHUNK)
        for i in range(0, size, CHUNK):
            f.write(block[: min(CHUNK, size - i) - 8] + i.to_bytes(8, "little"))


def drop_page_cache() -> bool:
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=3.0)
    parser.add_argument("--dir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    size = int(args.size_gb * 1e9)
    work = Path(tempfile.mkdtemp(prefix="fingerprint-cost-", dir=args.dir))
    os.environ["BATCHRUN_CACHE_DIR"] = str(work / "cache")
    from batchrun.models import fingerprint, model_fingerprint

    try:
        model = work / "model"
        model.mkdir()
        write_model(model, size)
        time.sleep(2 * fingerprint.RACY_NS / 1e9)  # past the window where a digest is not kept
        memo = fingerprint.memo_folder() / "weights.json"
        model_fingerprint(str(work))  # imports MLX, reads no weights (the folder has none)
        if drop_page_cache():
            disk = timed(model_fingerprint, str(model))
            print(f"first hash, from disk:       {disk:7.2f} s  {size / disk / 1e9:5.2f} GB/s")
            memo.unlink()
        cached = timed(model_fingerprint, str(model))
        print(f"first hash, from page cache: {cached:7.2f} s  {size / cached / 1e9:5.2f} GB/s")
        hits = [timed(model_fingerprint, str(model)) for _ in range(5)]
        print(f"memo hit (best of 5):        {min(hits) * 1e3:7.2f} ms")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
