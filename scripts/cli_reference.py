"""Write docs/cli.md: `batchrun --help` and every subcommand's `--help`, as click prints them.

    python scripts/cli_reference.py            # rewrite docs/cli.md
    python scripts/cli_reference.py --check    # exit 1 if docs/cli.md is out of date

The help is rendered at a fixed width, with no BATCHRUN_* variable set, so the page is the same
on every machine. tests/test_docs.py fails when the page and the command line drift apart.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import click
from click.testing import CliRunner

from batchrun.cli import RUN_BUNDLES, cli
from batchrun.job.options import FLAT

WIDTH = 100
PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
HEADER = """\
# Command-line reference

Generated from `--help` by `python scripts/cli_reference.py`; do not edit by hand.
The [user guide](guide.md) explains the commands; [limits](limits.md) explains `--limit`.
"""


def commands(group: click.Command, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command's argument path under `group`: the group first, then `run` (the command
    most readers come for), then the rest in help order."""
    yield path
    if isinstance(group, click.Group):
        names = sorted(group.list_commands(click.Context(group)), key=lambda n: n != "run")
        for name in names:
            yield from commands(group.commands[name], (*path, name))


def help_text(path: tuple[str, ...]) -> str:
    """What `batchrun PATH --help` prints at WIDTH columns."""
    env = {name: None for name in os.environ if name.startswith("BATCHRUN_")}
    result = CliRunner().invoke(cli, [*path, "--help"], env=env, prog_name="batchrun",
                                terminal_width=WIDTH, max_content_width=WIDTH)
    if result.exit_code != 0:
        raise RuntimeError(f"batchrun {' '.join(path)} --help failed: {result.output}")
    return result.output.rstrip() + "\n"


def reference() -> str:
    """The whole page: one section a command, each its help in a code block."""
    parts = [HEADER]
    for path in commands(cli):
        title = " ".join(("batchrun", *path))
        parts.append(f"\n## `{title}`\n\n```\n{help_text(path)}```\n")
        if path == ("run",):
            parts.append(run_option_groups())
    return "".join(parts)


def run_option_groups() -> str:
    """`run`'s option groups (batchrun.cli.RUN_BUNDLES, as --help lists them) as a table of the
    `batchrun.Job` keyword arguments each group holds, and where RunOptions keeps them
    (batchrun.job.options.FLAT)."""
    rows = []
    for bundle in RUN_BUNDLES:
        api = [name for name in bundle.names if name not in bundle.cli_only]
        only = [f"`{name}`" for name in bundle.names if name in bundle.cli_only]
        rows.append(f"| {bundle.heading} | {', '.join(f'`{name}`' for name in api)}"
                    + (f"; command line only: {', '.join(only)}" if only else "")
                    + f" | {where_kept(api)} |")
    return ("\n### Option groups and `batchrun.Job` keywords\n\n"
            "Each option of `batchrun run` sets the [Python API](python-api.md)'s keyword of "
            "the same name\n(`--max-tokens` sets `max_tokens`, `--ray` sets `ray_address`); "
            "`job.options` keeps it in\nthe group's part (`job.options.sampling.max_tokens`):"
            "\n\n| group | keywords | in `RunOptions` |\n|---|---|---|\n"
            + "\n".join(rows) + "\n")


def where_kept(names: list[str]) -> str:
    """The RunOptions part that keeps these keywords, with the fields named otherwise there
    (`media_timeout` is `media.timeout`) and those kept at its top."""
    places = [FLAT[name] for name in names]
    parts = sorted({part for part, _ in places if part})
    renamed = [f"`{name}` is `{part}.{field}`"
               for name, (part, field) in zip(names, places, strict=True)
               if part and field != name]
    top = [f"`{name}`" for name, (part, _) in zip(names, places, strict=True) if not part]
    said = [f"`{part}`" for part in parts]
    if renamed:
        said[-1] += f" ({', '.join(renamed)})"
    if top:
        said.append(f"{', '.join(top)} at the top")
    return "; ".join(said)


def main() -> int:
    text = reference()
    if "--check" in sys.argv[1:]:
        if PAGE.exists() and PAGE.read_text() == text:
            return 0
        print(f"{PAGE} is out of date: run `python scripts/cli_reference.py` to update it",
              file=sys.stderr)
        return 1
    PAGE.parent.mkdir(exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
