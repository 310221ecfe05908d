"""``fit``'s tensor parallelism: which degrees it plans, what each costs, and why it chose or refused each.

A degree ``T`` is planned where it divides the devices, fits in one node (``node_devices``), and divides the
model: :func:`~gpukit.memory.tensor_split` finds its blocks by structure and refuses a head count or MLP width
that does not divide (the strategy that splits the model at run time reads the same finding). Each strategy
of one device per process is then planned with tensor groups too (DDP or FSDP over ``devices / T`` groups);
the plan of such a layout is of one rank's shard of the model (``_tp_shard.py``), and its step time adds the
group's collectives (``_fit_costs.tensor_comm_s``). After the search, one line per degree says why it was
chosen or not, or refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gpukit.errors import ConfigurationError
from gpukit.layout import Layout
from gpukit.memory._blocks import unit_param_counts, units_to_shard
from gpukit.memory._fit_costs import FitOption, TensorCosts, tensor_comm_s
from gpukit.memory._fit_planner import FitPlanner
from gpukit.memory._tp_structure import TensorSplit, TensorSplitError
from gpukit.precision import fsdp_own_unit_layers

__all__ = ["TensorDegrees", "tensor_degrees", "tensor_lines"]


@dataclass
class TensorDegrees:
    """The degrees ``fit`` considered: the accepted ones (their split and costs) and why the others were refused."""

    accepted: dict[int, TensorSplit] = field(default_factory=dict)
    costs: dict[int, TensorCosts] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)

    def layouts(self, bases: Sequence[Layout], devices: int) -> list[Layout]:
        """``bases`` (the layouts of one device per process, over ``devices``) with each accepted degree's groups."""
        out = []
        for degree in self.accepted:
            groups = devices // degree
            for base in bases:
                if base.stages > 1 or base.one_process or base.offload or base.tensor > 1 or base.devices != devices:
                    continue
                out.append(Layout(replicas=groups, tensor=degree) if base.replicas > 1 or groups == 1
                           else Layout(shards=groups, tensor=degree))
        return list(dict.fromkeys(out))


def _short(exc: ConfigurationError) -> str:
    if isinstance(exc, TensorSplitError):
        return exc.reason
    return str(exc).split(";")[0].split(": ", 1)[-1]  # "found no block to split in X (...)"


def tensor_degrees(planner: FitPlanner, devices: int, degrees: Sequence[int] | None, node_devices: int,
                   precisions: Sequence[str]) -> TensorDegrees:
    """Check each degree (every ``T >= 2`` dividing ``devices`` when ``degrees`` is None) against the node and
    the model; price the accepted ones.

    Raises:
        ConfigurationError: a degree given that is not a whole number >= 2.
    """
    wanted = [t for t in range(2, devices + 1) if devices % t == 0] if degrees is None else list(degrees)
    found = TensorDegrees()
    for degree in wanted:
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 2:
            raise ConfigurationError(f"fit(tensor_parallel={list(wanted)!r}): give degrees >= 2 (whole numbers).")
        if devices % degree:
            found.refused[degree] = f"does not divide the {devices} devices"
        elif degree > node_devices:
            found.refused[degree] = (f"more than the {node_devices} GPUs of one node (a tensor group's collectives "
                                     "run every layer: they stay inside a node)")
        elif node_devices % degree:  # ranks are tensor-innermost: groups of T consecutive ranks straddle nodes
            found.refused[degree] = (f"does not divide the {node_devices} GPUs of one node, so some tensor groups "
                                     "would span two nodes (a group's collectives run every layer: they stay "
                                     "inside a node)")
        else:
            try:
                split, local = planner.split(degree)
                traffic = planner.traffic(degree)
            except ConfigurationError as exc:
                found.refused[degree] = _short(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - the model's own forward, on meta tensors
                found.refused[degree] = (f"its shard model did not run on meta tensors ({type(exc).__name__}: "
                                         f"{str(exc)[:200]}), so its traffic is unknown")
                continue
            found.accepted[degree] = split
            units = {p: unit_param_counts(local, units_to_shard(local, always=fsdp_own_unit_layers(p)))
                     for p in precisions}
            found.costs[degree] = TensorCosts(units, traffic)
    return found


def _divides(split: TensorSplit) -> str:
    """``"heads 12, MLP width 3072 divisible by 2"`` from what the split found."""
    sizes: dict[str, list[int]] = {}
    for what, _, size in split.blocks:
        if size not in sizes.setdefault(what, []):
            sizes[what].append(size)
    return ", ".join(f"{what} {'/'.join(map(str, v))}" for what, v in sizes.items()) + f" divisible by {split.degree}"


def _where(option: FitOption) -> str:
    return f"{option.strategy} x{option.devices} ~{option.step_s * 1e3:.4g} ms/step"


def tensor_lines(found: TensorDegrees, best: FitOption | None, best_with: dict[int, FitOption | None],
                 best_without: FitOption | None, link_bytes_per_s: float) -> list[str]:
    """One line per degree: refused (why), or accepted with its communication per step and why it was chosen or not.

    Args:
        found: the degrees considered.
        best: the fastest option that fits (``None``: nothing fits).
        best_with: per accepted degree, its fastest option that fits (``None``: none fits).
        best_without: the fastest option without tensor groups that fits.
        link_bytes_per_s: the assumed intra-node link.
    """
    lines = []
    for degree in sorted({*found.accepted, *found.refused}):
        if degree in found.refused:
            lines.append(f"tp {degree}: {found.refused[degree]}")
            continue
        mine = best_with.get(degree)
        head = f"tp {degree}: {_divides(found.accepted[degree])}"
        if mine is None:
            lines.append(f"{head}; not chosen: nothing with it fits")
            continue
        comm = tensor_comm_s(found.costs[degree].traffic, degree, mine.micro_batch * mine.accumulate,
                             mine.precision, link_bytes_per_s)
        head += f", comm {comm * 1e3:.3g} ms/step"
        if best is not None and best.layout.tensor == degree:
            why = (f"faster than the fastest without tensor parallelism ({_where(best_without)})"
                   if best_without is not None else "nothing without tensor parallelism fits")
            lines.append(f"{head}; chosen ({_where(best)}): {why}")
        else:
            slower = "slower" if best is None or mine.step_s > best.step_s else "no faster"
            other = "" if best is None else f" than {_where(best)}"
            lines.append(f"{head}; not chosen: its fastest ({_where(mine)}) is {slower}{other}")
    return lines
