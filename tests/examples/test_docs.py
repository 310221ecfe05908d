"""README.md and docs/*.md say only what is true of this checkout.

For every page: (a) each relative link names a file that exists (and a heading, for ``#anchor``);
(b) each ```python block compiles; (c) each ``gpukit <command> --flag`` shown in a ```bash /
```console block or in inline code names a real command and real options (read from the click
commands of ``gpukit.cli``, not from a list kept here); (d) each ``GPUKIT_*`` variable it names
is read or set somewhere in ``src/`` (or, for a test's own knob, in ``tests/`` or ``bench/``);
(e) each file path a page names (``launch/_elastic.py``, ``bench/planner.py``) exists, each
``docs/*.md`` a docstring or comment in the code cites exists, and docs/architecture.md names every
module of ``session/`` (its list of the Session's components).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from gpukit.cli import cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^ *```([\w-]*)\n(.*?)^ *```", re.M | re.S)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
ENV_VAR = re.compile(r"\bGPUKIT_[A-Z0-9]+(?:_[A-Z0-9]+)*\b")
SHELL_ENDS = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "<"}


def _ids(pages: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in pages]


def _prose(text: str) -> str:
    """The page without its fenced blocks (links and inline code live in the prose)."""
    return FENCE.sub("", text)


def _link_text(text: str) -> str:
    """The prose without inline code (``f(a)[0](x)`` in backticks is code, not a link)."""
    return INLINE.sub("", _prose(text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*|_(?=\w)|(?<=\w)_", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} +(.+?) *#*$", _prose(page.read_text()), re.M)
    seen: dict[str, int] = {}
    out = set()
    for heading in headings:
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


# -- (a) links -------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(_link_text(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not this checkout's
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: {dest.name} has no heading with anchor #{anchor}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


# -- (b) python blocks -----------------------------------------------------------------------------
def _blocks(page: Path, *languages: str) -> Iterator[tuple[int, str]]:
    text = page.read_text()
    for match in FENCE.finditer(text):
        if match.group(1) in languages:
            yield text.count("\n", 0, match.start()) + 1, match.group(2)


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_python_blocks_compile(page: Path) -> None:
    for line, code in _blocks(page, "python", "py"):
        compile(code, f"{page.name}:{line}", "exec")  # a SyntaxError names the page and line


# -- (c) commands and options ----------------------------------------------------------------------
def _options(command: click.Command) -> tuple[dict[str, bool], set[str]]:
    """``--name`` / ``-n`` -> whether it takes a value; and the command's subcommand names."""
    takes_value: dict[str, bool] = {"-h": False, "--help": False}
    for param in command.params:
        if isinstance(param, click.Option):
            value = not param.is_flag and not param.count
            for name in (*param.opts, *param.secondary_opts):
                takes_value[name] = value
    subcommands = set(command.list_commands(click.Context(command))) if isinstance(command, click.Group) else set()
    return takes_value, subcommands


def _command_uses(text: str) -> Iterator[list[str]]:
    """Each ``gpukit ...`` invocation in ``text``, as words up to the end of that shell command."""
    for line in text.splitlines():
        line = line.split(" #", 1)[0].replace("\\|", "|").replace("…", "")
        try:
            words = shlex.split(line, comments=False)
        except ValueError:  # an unbalanced quote in prose-like text: split on spaces
            words = line.split()
        for i, word in enumerate(words):
            if word == "gpukit" and (i == 0 or words[i - 1] not in {"import", "from", "pip", "install"}):
                rest = []
                for w in words[i + 1:]:
                    if w in SHELL_ENDS or w.startswith(("|", ">", ";")) or w == "gpukit":
                        break
                    rest.append(w)
                yield rest


def _check_invocation(words: list[str]) -> list[str]:
    """What is wrong with ``gpukit <words>`` (empty: nothing)."""
    command: click.Command = cli
    path = "gpukit"
    takes_value, subcommands = _options(command)
    skip_value = False
    problems = []
    for raw in words:
        word = raw.strip("[]()`,.")
        if skip_value:
            skip_value = False
            if not word.startswith("-"):
                continue
        if not word:
            continue
        if subcommands and not word.startswith("-"):
            if word not in subcommands:
                problems.append(f"`{path} {word}`: no such command (commands: {', '.join(sorted(subcommands))})")
                return problems
            command = command.get_command(click.Context(command), word)  # type: ignore[union-attr]
            path = f"{path} {word}"
            takes_value, subcommands = _options(command)
            continue
        if word.startswith("-") and len(word) > 1 and not re.match(r"-\d", word):
            name = word.split("=", 1)[0]
            if name not in takes_value:
                problems.append(f"`{path}` has no option {name}")
                continue
            if path == "gpukit run" and name == "-m":
                break  # `-m module args...`: the rest is the module's
            skip_value = takes_value[name] and "=" not in word
            continue
        if path == "gpukit run" and (word.endswith(".py") or word == "script"):
            break  # everything after the script is the script's
    return problems


def _shown_invocations(page: Path) -> Iterator[tuple[str, list[str]]]:
    for line, block in _blocks(page, "bash", "sh", "console", "shell"):
        for words in _command_uses(block):
            yield f"{page.name}:{line} block", words
    for span in INLINE.findall(_prose(page.read_text())):
        if re.search(r"(^|\s)gpukit\s+[a-z-]", span):
            for words in _command_uses(span):
                yield f"{page.name} `{span[:60]}`", words


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_commands_and_options_exist(page: Path) -> None:
    problems = [f"{where}: {p}" for where, words in _shown_invocations(page) for p in _check_invocation(words)]
    assert not problems, "\n".join(problems)


def test_the_pages_show_commands_to_check() -> None:
    shown = [words for page in PAGES for _, words in _shown_invocations(page)]
    assert len(shown) > 50  # the checker reads the pages' commands (not a pass over nothing)
    commands = {words[0] for words in shown if words}
    assert {"ls", "select", "run", "ckpt", "plan", "doctor", "report", "demo"} <= commands


def test_the_option_check_catches_what_it_should() -> None:
    assert _check_invocation(["run", "--gpus", "2", "train.py", "--lr", "3"]) == []
    assert _check_invocation(["ckpt", "inspect", "x.pt", "--json"]) == []
    assert _check_invocation(["run", "--gpu", "2", "train.py"]) == ["`gpukit run` has no option --gpu"]
    assert "no such command" in _check_invocation(["lst"])[0]
    assert "no such command" in _check_invocation(["ckpt", "show"])[0]


def _cli_sections() -> dict[str, str]:
    """docs/cli.md's ``## `gpukit NAME``` sections: NAME -> the section's text."""
    text = (ROOT / "docs" / "cli.md").read_text()
    parts = re.split(r"^## `gpukit ([a-z-]+)`[^\n]*\n", text, flags=re.M)
    return {parts[i]: parts[i + 1].split("\n## ", 1)[0] for i in range(1, len(parts), 2)}


def _option_names(command: click.Command) -> list[tuple[str, ...]]:
    """Each option of ``command`` (and, for a group, of its subcommands) as all its names
    (``("-m", "--module")``, ``("--record", "--no-record")``)."""
    names = [(*param.opts, *param.secondary_opts) for param in command.params
             if isinstance(param, click.Option) and "--help" not in param.opts]
    if isinstance(command, click.Group):
        for sub in command.list_commands(click.Context(command)):
            names += _option_names(command.get_command(click.Context(command), sub))  # type: ignore[arg-type]
    return names


def test_the_cli_reference_has_every_command_and_option() -> None:
    """docs/cli.md has a section per command naming each of its options (by any of its names)."""
    sections = _cli_sections()
    commands = cli.list_commands(click.Context(cli))
    missing = [f"no section `gpukit {name}`" for name in commands if name not in sections]
    for name in (n for n in commands if n in sections):
        for option in _option_names(cli.get_command(click.Context(cli), name)):  # type: ignore[arg-type]
            if not any(re.search(re.escape(alias) + r"(?![\w-])", sections[name]) for alias in option):
                missing.append(f"`gpukit {name}` {'/'.join(option)}: not named in its section")
    assert not missing, "docs/cli.md:\n" + "\n".join(missing)
    assert len(sections) >= 8 and ("--gpus",) in _option_names(cli.get_command(click.Context(cli), "run"))  # type: ignore[arg-type]


# -- (d) environment variables ---------------------------------------------------------------------
def _source_text() -> str:
    files = [p for d in ("src", "tests", "bench") for p in (ROOT / d).rglob("*.py") if p != Path(__file__)]
    return "\n".join(p.read_text() for p in files)


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_environment_variables_exist(page: Path) -> None:
    source = _source_text()
    named = set(ENV_VAR.findall(page.read_text()))
    missing = sorted(v for v in named if v not in source)
    assert not missing, f"{page.name} names {', '.join(missing)}, which nothing in src/ reads or sets"


# -- (e) file references ---------------------------------------------------------------------------
PACKAGE = ROOT / "src" / "gpukit"
FILE_PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|json|sh|sbatch))\b")
TOP_LEVEL = {"src", "tests", "bench", "examples", "docs"}


def _named_file(path: str) -> Path | None:
    """Where a path named on a page lies in this checkout (None: not a path of this checkout)."""
    first = path.split("/", 1)[0]
    if first in TOP_LEVEL:
        return ROOT / path
    if first == "gpukit":
        return ROOT / "src" / path
    if (PACKAGE / first / "__init__.py").exists():
        return PACKAGE / path
    return None  # /home/me/train.py, path/to/config.json: an example's path, not ours


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_named_files_exist(page: Path) -> None:
    missing = sorted({p for p in FILE_PATH.findall(page.read_text())
                      if (where := _named_file(p)) is not None and not where.exists()})
    assert not missing, f"{page.name} names files that do not exist: {', '.join(missing)}"


def test_pages_cited_by_the_code_exist() -> None:
    cited = [(path.relative_to(ROOT), name) for d in ("src", "tests", "bench", "examples")
             for path in sorted((ROOT / d).rglob("*.py")) if path != Path(__file__)
             for name in re.findall(r"\bdocs/[\w./-]+?\.md\b", path.read_text())]
    assert cited  # the check reads the code's citations (not a pass over nothing)
    missing = [f"{source} cites {name}" for source, name in cited if not (ROOT / name).exists()]
    assert not missing, "\n".join(missing)


def test_architecture_names_every_session_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    modules = sorted(p.name for p in (PACKAGE / "session").glob("_*.py") if p.name != "__init__.py")
    unnamed = [m for m in modules if not re.search(rf"`{re.escape(m)}|`{re.escape(m[:-3])}\.", text)]
    assert not unnamed, f"docs/architecture.md's session/ paragraph leaves out {unnamed}"


def test_the_file_check_sees_a_missing_file() -> None:
    assert _named_file("launch/_elastic.py") == PACKAGE / "launch" / "_elastic.py"
    assert _named_file("home/me/train.py") is None
    assert FILE_PATH.findall("see docs/readme/devices.md and `launch/_nope.py`") == [
        "docs/readme/devices.md", "launch/_nope.py"]
    assert not _named_file("launch/_nope.py").exists()  # type: ignore[union-attr]
