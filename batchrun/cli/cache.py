"""`batchrun cache`: inspect or empty the on-disk prefix cache (never following a link out of
it)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from batchrun.paths import default_cache_dir


@click.group()
def cache() -> None:
    """Inspect or empty the on-disk prefix cache."""


_cache_dir_option = click.option(
    "--cache-dir", type=click.Path(path_type=Path), default=None, envvar="BATCHRUN_CACHE_DIR",
    help="prefix-cache folder [default: $BATCHRUN_CACHE_DIR or ~/.cache/batchrun]")


@cache.command("ls")
@_cache_dir_option
def cache_ls(cache_dir: Path | None) -> None:
    """One line per model: blocks, size, last use."""

    from batchrun.cache.disk import cache_summary

    root = cache_dir or default_cache_dir()
    entries = cache_summary(root)
    if not entries:
        click.echo(f"{root}: no prefix-cache entries")
        return
    names = _cache_model_names(entries)
    width = max(len(names[e["model"]]) for e in entries)
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["last_used"])) \
            if e["last_used"] else "-"
        click.echo(f"{names[e['model']]:<{width}}  {e['model'][:12]}  {e['blocks']:>7,} blocks  "
                   f"{e['bytes'] / 2**20:>9.1f} MiB  last used {when}  {e['folder']}")


def _cache_model_names(entries: list[dict]) -> dict[str, str]:
    """A name for each prefix-cache folder (named by the model's fingerprint): the name the
    folder records, else the model of a job under jobs/ with that fingerprint, or the bundled
    demo model; else "unknown model"."""
    from batchrun.job.listing import known_models

    known = known_models()
    names = {e["model"]: e.get("name") or next(
        (n for fp, n in known.items() if fp.startswith(e["model"])), None) for e in entries}
    if None in names.values():
        from batchrun.models import DEMO_NAME, local_path, model_fingerprint

        try:
            demo = model_fingerprint(local_path(None))
        except Exception:  # the demo model cannot be found here: it is not named
            demo = ""
        names = {f: n or (DEMO_NAME if demo and demo.startswith(f) else None)
                 for f, n in names.items()}
    return {f: n or "unknown model" for f, n in names.items()}


@cache.command("stats")
@_cache_dir_option
def cache_stats(cache_dir: Path | None) -> None:
    """Totals over all models."""
    from batchrun.cache.disk import cache_summary

    root = cache_dir or default_cache_dir()
    entries = cache_summary(root)
    blocks = sum(e["blocks"] for e in entries)
    size = sum(e["bytes"] for e in entries)
    click.echo(f"folder: {root}")
    click.echo(f"models: {len(entries)}")
    click.echo(f"blocks: {blocks:,}")
    click.echo(f"size:   {size / 2**20:,.1f} MiB")


@cache.command("clear")
@_cache_dir_option
@click.option("--yes", is_flag=True, help="do not ask")
def cache_clear(cache_dir: Path | None, yes: bool) -> None:
    """Delete every prefix-cache entry."""
    import shutil
    import stat

    root = (cache_dir or default_cache_dir()) / "prefix"
    try:
        mode = root.lstat().st_mode
    except FileNotFoundError:
        click.echo("nothing to clear")
        return
    except OSError as e:
        raise click.ClickException(f"cannot read {root}: {e.strerror or e}") from None
    if not stat.S_ISDIR(mode):  # a link is never followed out of the cache
        raise click.ClickException(f"{root} is not a folder (a link or a file); nothing cleared")
    if not yes:
        click.confirm(f"delete {root}?", abort=True)
    try:
        shutil.rmtree(root)  # removes links inside, never their targets
    except OSError as e:
        raise click.ClickException(f"could not clear {root}: {e.strerror or e}") from None
    click.echo(f"cleared {root}")
