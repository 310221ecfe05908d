"""Root click group with lazily imported subcommands."""

from __future__ import annotations

import importlib
import sys

import click

from gpukit._util.version import __version__
from gpukit.errors import GpukitError

# subcommand -> "module:attribute". Each module holds one command and imports what it needs.
_COMMANDS: dict[str, str] = {
    "ls": "gpukit.cli.ls:ls",
    "select": "gpukit.cli.select:select",
    "run": "gpukit.cli.run:run",
    "demo": "gpukit.cli.demo:demo",
    "ckpt": "gpukit.cli.ckpt:ckpt",
    "plan": "gpukit.cli.plan:plan",
    "doctor": "gpukit.cli.doctor:doctor",
    "claims": "gpukit.cli.claims:claims",
    "report": "gpukit.cli.report:report",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in _COMMANDS if self._load(name) is not None)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self._load(cmd_name)

    @staticmethod
    def _load(name: str) -> click.Command | None:
        target = _COMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # command not built yet
                return None
            raise
        return getattr(module, attr)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="gpukit")  # no importlib.metadata
def cli() -> None:
    """gpukit: see, pick and claim GPUs, and train PyTorch on them well."""


def _shown(message: str) -> str:
    from gpukit._util.text import printable

    return printable(message, keep_newlines=True)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: gpukit errors become one clear line and exit code 2."""
    try:
        exit_code = cli.main(args=argv, prog_name="gpukit", standalone_mode=False)
        if isinstance(exit_code, int) and exit_code != 0:
            sys.exit(exit_code)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.exceptions.NoArgsIsHelpError as exc:  # `gpukit ckpt` alone: show its help
        exc.show()
        sys.exit(exc.exit_code)
    except click.UsageError as exc:  # bad option or value: one line, like every gpukit error
        command = exc.ctx.command_path if exc.ctx is not None else "gpukit"
        click.echo(f"gpukit: error: {_shown(exc.format_message())} See '{command} --help'.", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"gpukit: error: {_shown(exc.format_message())}", err=True)
        sys.exit(exc.exit_code)
    except GpukitError as exc:  # may quote what another user wrote (a note, a process): no escapes reach the terminal
        click.echo(f"gpukit: error: {_shown(str(exc))}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
