"""``gpukit claims setup|clean``: the shared claim folder, made once and kept tidy. Never imports torch."""

from __future__ import annotations

import click

from gpukit.cli._common import FiniteFloatRange, NonEmptyPath

__all__ = ["claims"]


@click.group(short_help="Make the machine's shared GPU claim folder (once, as root); clean it.")
def claims() -> None:
    """Make the machine's shared GPU claim folder (once, as root), and clean it.

    Without a shared folder every user's claims live in a folder of their own, so they keep only
    that user's jobs apart. See docs/devices.md, "Shared machines".
    """


@claims.command()
@click.option("--dir", "directory", type=NonEmptyPath(file_okay=False), default=None, metavar="PATH",
              help="Where to make it (default /var/lib/gpukit/claims, where every gpukit looks).")
def setup(directory: str | None) -> None:
    """Make the shared claim folder: root-owned, mode 1777 (like /tmp), one root-owned lock file per GPU.

    Run it once as root, and again after adding GPUs or changing MIG devices. It repairs an
    existing folder (owner, mode, lock files other users made or planted) without touching a
    lock someone holds now.
    """
    from gpukit._util.text import printable
    from gpukit.devices import SYSTEM_CLAIM_DIR, kernel_problem, setup_folder, silence_notice

    silence_notice()
    path = directory or str(SYSTEM_CLAIM_DIR)
    actions = setup_folder(path)
    for line in actions:
        click.echo(printable(line))
    click.echo(f"{printable(path)} is the shared claim folder" + ("" if actions else " (nothing to change)") + ".")
    if directory and directory != str(SYSTEM_CLAIM_DIR):
        click.echo(f"Every user must set GPUKIT_CLAIM_DIR={printable(path)} to use it.")
    problem = kernel_problem()
    if problem is not None:
        click.echo(f"warning: {problem.what}. Fix: {problem.fix}.", err=True)


@claims.command()
@click.option("--dir", "directory", type=NonEmptyPath(file_okay=False), default=None, metavar="PATH",
              help="The claim folder (default: the one this user's claims use).")
@click.option("--older-than", type=FiniteFloatRange(min=0), default=600.0, show_default=True, metavar="SECONDS",
              help="Name (with --force: free) a claim whose holder runs nothing on its GPU only after this long.")
@click.option("--force", is_flag=True,
              help="Also free those claims although their holder is alive (root, or the folder's owner).")
@click.option("--dry-run", is_flag=True, help="Say what would be done, change nothing.")
def clean(directory: str | None, older_than: float, force: bool, dry_run: bool) -> None:
    """Remove leftovers; name (with --force: free) the GPUs of stale or planted claims.

    Removes tickets of waiters that are gone, notes of claims that ended, unfinished temporary
    files, symlinks/FIFOs/folders where gpukit keeps files, and in a shared folder everything
    else that is not gpukit's (junk). It names each claim older than --older-than whose holder's
    account runs nothing on its GPU, and the process holding it; a claim whose holder is alive is
    freed only with --force (as root, or in your own folder). Others' files are touched only by root.
    """
    from gpukit._util.text import printable
    from gpukit.devices import clean_folder, list_gpus, open_claim_folder, silence_notice

    silence_notice()
    try:
        folder = open_claim_folder(directory, create=False)
    except FileNotFoundError:
        click.echo("No claim folder yet: nothing to clean.")
        return
    with folder:
        actions = clean_folder(folder, list_gpus(), older_than_s=older_than, dry_run=dry_run, force=force)
    for line in actions:
        click.echo(("would have " if dry_run else "") + printable(line))
    if not actions:
        click.echo(f"{printable(str(folder.path))}: nothing to clean.")
