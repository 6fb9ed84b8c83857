"""A PNG of a job's report.html as a browser shows it, to look at the page without opening it
(headless Chromium, Debian's package: `apt-get install -y chromium`).

    python scripts/report_screenshot.py JOB_DIR/report.html report.png [--width 1000]

Chromium's headless screenshot is of the window, not the page: the page is drawn in a window
taller than any report and the blank bottom is cut off.
"""

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image, ImageChops

TALL = 8000  # px: taller than any report page
MARGIN = 24  # px kept below the page's last drawn pixel


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    sys.exit("Chromium is missing: apt-get install -y chromium")


def screenshot(page: Path, out: Path, width: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "page.png"
        cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--no-first-run", f"--user-data-dir={tmp}/profile", f"--window-size={width},{TALL}",
               f"--screenshot={raw}", page.resolve().as_uri()]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if not raw.exists():
            sys.exit(f"Chromium made no screenshot (exit {done.returncode}):\n{done.stderr}")
        image = Image.open(raw).convert("RGB")
    background = Image.new("RGB", image.size, image.getpixel((0, image.height - 1)))
    box = ImageChops.difference(image, background).getbbox()
    bottom = min(image.height, (box[3] if box else 0) + MARGIN)
    image.crop((0, 0, width, bottom)).save(out)
    print(f"{out}: {width}x{bottom}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report_html", type=Path)
    parser.add_argument("out_png", type=Path)
    parser.add_argument("--width", type=int, default=1000, help="window width in px")
    args = parser.parse_args()
    if not args.report_html.is_file():
        sys.exit(f"no such file: {args.report_html}")
    screenshot(args.report_html, args.out_png, args.width)


if __name__ == "__main__":
    main()
