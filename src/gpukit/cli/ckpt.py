"""``gpukit ckpt``: inspect and convert checkpoints (thin: parse, call, print)."""

from __future__ import annotations

import json
from typing import Any

import click

__all__ = ["ckpt"]


@click.group(short_help="Inspect and convert checkpoints (torch, safetensors, gpukit dirs).")
def ckpt() -> None:
    """Inspect and convert checkpoints (torch.save files, safetensors, gpukit checkpoint dirs)."""


def _print_report(info: dict[str, Any]) -> None:
    from gpukit._util.text import printable
    from gpukit._util.units import format_bytes

    def echo(line: str) -> None:  # tensor names and contents come from the file: no escape reaches the terminal
        click.echo(printable(line))

    echo(f"{info['path']}")
    echo(f"  format:         {info['format']}")
    echo(f"  size:           {format_bytes(info['size_bytes'])}")
    saved_by = info["torch_version"]
    if info.get("gpukit_version"):
        saved_by += f" (gpukit {info['gpukit_version']}, {info.get('saved_at') or 'time unknown'})"
    echo(f"  saved by torch: {saved_by}")
    if "checkpoint" in info:
        meta = info["checkpoint"]
        echo(f"  step:           {meta['step']} (world size {meta['world_size']})")
        if meta.get("extra"):
            echo(f"  extra:          {meta['extra']}")
    if info.get("sharded"):
        shards = info["sharded"]
        echo(f"  sharded:        {shards['shard_files']} shard file(s) from world size {shards['world_size']}, "
                   f"{format_bytes(shards['shard_bytes'])} ({shards['format']}; merge: gpukit ckpt convert DIR OUT)")
    if info.get("unsafe"):
        echo(f"  contents:       NOT LOADED - {info['unsafe']}")
        if info.get("pickled_globals"):
            echo(f"  pickled globals: {', '.join(info['pickled_globals'])}")
        echo(f"  if you trust its source, convert it to plain tensors: "
                   f"gpukit ckpt convert --trust {info['path']} OUT.pt")
        return
    tensors = info["tensors"]
    dtypes = ", ".join(f"{k} x{v}" for k, v in tensors["dtypes"].items()) or "-"
    devices = ", ".join(f"{k} x{v}" for k, v in tensors["devices"].items()) or "-"
    echo(f"  tensors:        {tensors['count']} ({tensors['numel']:,} elements); dtypes: {dtypes}; "
               f"devices: {devices}")
    echo(f"  prefixes:       {'; '.join(info['prefixes']) or 'none'}")
    if info.get("contents"):
        echo("  contents:")
        for key, text in info["contents"].items():
            echo(f"    {key + ': ' if key else ''}{text}")
    if info["keys"]:
        echo("  keys:")
        for entry in info["keys"]:
            count = f" x{entry['count']}" if entry["count"] > 1 else ""
            echo(f"    {entry['key']}{count}  {entry['shape']}  {entry['dtype']}  {entry['device']}")
        if info["keys_not_shown"]:
            echo(f"    ... and {info['keys_not_shown']} more tensor(s)")


@ckpt.command()
@click.argument("path", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--trust", is_flag=True,
              help="Unpickle a sharded checkpoint's .metadata freely (can run code; trusted files only).")
def inspect(path: str, as_json: bool, trust: bool) -> None:
    """Show what a checkpoint holds: format, size, torch version, tensors, prefixes, contents.

    Nothing in PATH is ever run: files are read with weights_only, and a sharded checkpoint's
    index (.metadata) through a restricted unpickler unless --trust is given.
    """
    from gpukit.checkpoint import inspect_checkpoint

    info = inspect_checkpoint(path, trust=trust)
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
    else:
        _print_report(info)


@ckpt.command()
@click.argument("source", type=click.Path(path_type=str))
@click.argument("target", type=click.Path(path_type=str))
@click.option("--strip-prefix", is_flag=True, help="Remove module. / _orig_mod. from state-dict keys.")
@click.option("--to-cpu", is_flag=True, help="Load every tensor onto the CPU.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), help="Cast floating-point tensors.")
@click.option("--format", "fmt", type=click.Choice(["torch", "safetensors"]),
              help="Output format (default: from TARGET's extension).")
@click.option("--select", help="Convert only this (dotted) key, e.g. 'model' (in gpukit checkpoints: a saved object).")
@click.option("--trust", is_flag=True,
              help="Allow full unpickling of SOURCE and of a sharded .metadata (can run code; trusted files only).")
def convert(source: str, target: str, strip_prefix: bool, to_cpu: bool, dtype: str | None,
            fmt: str | None, select: str | None, trust: bool) -> None:
    """Convert SOURCE into TARGET (written atomically).

    SOURCE is a checkpoint file, a gpukit step directory, or a gpukit checkpoint directory
    (its latest complete step is used).
    """
    from gpukit._util.units import format_bytes
    from gpukit.checkpoint import convert_checkpoint

    from gpukit.errors import UnsafeCheckpointError

    try:
        result = convert_checkpoint(source, target, strip_prefix=strip_prefix, to_cpu=to_cpu, dtype=dtype,
                                    format=fmt, select=select, trust=trust)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{exc} On the command line: add --trust (only for files you trust).") from None
    click.echo(f"wrote {result['target']} ({result['format']}, {result['tensors']} tensors, "
               f"{format_bytes(result['size_bytes'])})")


@ckpt.command()
@click.argument("source", type=click.Path(path_type=str))
@click.argument("directory", type=click.Path(path_type=str))
@click.option("--config", "config", type=click.Path(path_type=str),
              help="The model's config.json (or a Hugging Face model folder holding one) to write beside the weights.")
@click.option("--select", help="The object holding the weights, e.g. 'model' in a gpukit checkpoint.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), help="Cast floating-point weights.")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Split larger weights into shards of at most this size (e.g. 500MB, 2GiB), with an index.")
@click.option("--trust", is_flag=True, help="Allow full unpickling of SOURCE (can run code; trusted files only).")
def export(source: str, directory: str, config: str | None, select: str | None, dtype: str | None,
           max_shard_size: str, trust: bool) -> None:
    """Export SOURCE's weights as a folder Hugging Face from_pretrained loads.

    DIRECTORY gets model.safetensors (or model-0000N-of-0000M.safetensors shards and
    model.safetensors.index.json above --max-shard-size) and, with --config, config.json.
    """
    from gpukit._util.units import format_bytes
    from gpukit.checkpoint import export_pretrained
    from gpukit.errors import UnsafeCheckpointError

    try:
        result = export_pretrained(source, directory, config=config, select=select, dtype=dtype,
                                   max_shard_bytes=_decimal_size(max_shard_size), trust=trust)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{exc} On the command line: add --trust (only for files you trust).") from None
    shards = f"{len(result['files'])} shards + {result['index']}" if result["index"] else "1 file"
    click.echo(f"wrote {result['directory']} ({shards}, {result['tensors']} tensors, "
               f"{format_bytes(result['size_bytes'])})")
    if result["config"] is None:
        click.echo(f"note: {directory} has no config.json; from_pretrained needs one: add --config "
                   "PATH/config.json, or save it with config.save_pretrained(DIR).")


def _decimal_size(text: str) -> int:
    """``5GB`` as transformers reads it (decimal: GB = 10**9, GiB = 2**30)."""
    import math
    import re

    from gpukit._util.units import parse_size
    from gpukit.errors import ConfigurationError

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT])[bB]\s*", text)
    if not match:
        return parse_size(text)
    size = float(match.group(1)) * 1000 ** ("kmgt".index(match.group(2).lower()) + 1)
    if not math.isfinite(size):
        raise ConfigurationError(f"--max-shard-size {text[:40]!r}: too large to be a size; give e.g. 5GB or 500MB.")
    return int(size)
