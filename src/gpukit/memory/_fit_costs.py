"""What one ``fit`` configuration costs: its peak per device and predicted step time, from a plan.

Cost model (seconds per optimizer step; documented, simple, overridable):

* compute: the planner's counted FLOPs of forward+backward (checkpointing's recompute
  included: ~+1/3 of the forward for full) / ``flops_per_s`` (x2 for 16-bit precisions, the
  tensor-core rate), per micro-batch, plus ``micro_batch_overhead_s`` per micro-batch;
* DDP: one all-reduce of the gradients per step, 2(N-1)/N x gradient bytes / ``link_bytes_per_s``;
* FSDP: per micro-batch two all-gathers of the parameters (forward, backward) and a
  reduce-scatter of the gradients, (N-1)/N x bytes each;
* CPU offload: FSDP's traffic plus the shard's parameters and gradients over
  ``host_bytes_per_s`` per micro-batch and the optimizer step on the host
  (state + parameters + gradients over ``host_bytes_per_s``);
* pipeline over N stages with 4N micro-batches (GPipe): compute x (4N + N - 1) / (4N) / N.
  Per-stage memory is modelled as the single-device plan / N x 1.2 (balance is never perfect).
* tensor parallel over groups of T (within one node): the plan is of one rank's shard of the model
  (its compute, peak and the bytes it holds); per micro-batch the activations the group's collectives
  move (``_tp_shard.tensor_traffic``: each split block's output all-reduced forward, its input
  gradient backward), all-reduced at 2(T-1)/T x bytes and all-gathered at (T-1)/T x bytes over
  ``tensor_link_bytes_per_s`` (an assumed intra-node link: NVLink-class, 200 GB/s by default), in the
  compute dtype (fp32 for 32-true, else 16-bit); the gathered logits are added to the peak (the shard
  model's step holds 1/T of them). DDP or FSDP over the tensor groups then move the rank's own share of
  the gradients and parameters over the data-parallel ranks (replicas x shards), as above.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gpukit._util.units import format_bytes
from gpukit.errors import ConfigurationError
from gpukit.layout import Layout, plan_name_of, session_arguments
from gpukit.memory._fit_planner import POLICIES
from gpukit.memory._planner import MemoryEstimate
from gpukit.memory._shard_plan import shard_estimate
from gpukit.memory._tp_shard import TensorTraffic

__all__ = ["Costs", "FitOption", "TensorCosts", "option_for", "tensor_comm_s", "DEFAULT_TENSOR_LINK_BYTES_PER_S"]

_PIPELINE_IMBALANCE = 1.2
#: the intra-node link a tensor group's collectives are assumed to run at (NVLink-class all-reduce
#: bandwidth; PCIe-only machines reach a tenth of it: pass tensor_link_bytes_per_s= to fit)
DEFAULT_TENSOR_LINK_BYTES_PER_S = 200e9


@dataclass(frozen=True)
class FitOption:
    """One configuration: where it runs, its planned peak per device and predicted step time."""

    precision: str
    activation_checkpointing: str
    layout: Layout
    micro_batch: int
    accumulate: int
    peak_bytes: int
    step_s: float
    exact: bool = False  # from the plan of this very micro-batch (what fit returns always is)

    @property
    def strategy(self) -> str:
        """The planner's name for the layout (one of ``gpukit.layout.plan_names()``)."""
        return plan_name_of(self.layout) or self.layout.describe()

    @property
    def devices(self) -> int:
        return self.layout.devices

    def session_line(self) -> str:
        """The ``Session(...)`` that runs this configuration (its placement written by the strategy registry)."""
        args = session_arguments(self.layout)
        args.append(f"precision={self.precision!r}")
        if self.activation_checkpointing != "none":
            policy = POLICIES[self.activation_checkpointing]
            args.append(f"activation_checkpointing={policy!r}")
        if self.accumulate > 1:
            args.append(f"accumulate_grad_batches={self.accumulate}")
        return f"Session({', '.join(args)})"

    def describe(self) -> str:
        where = self.strategy if self.devices == 1 else f"{self.strategy} x{self.devices}"
        return (f"{self.precision:<10} ckpt {self.activation_checkpointing:<9} {where:<16} "
                f"micro-batch {self.micro_batch:>5} x{self.accumulate:<3} {format_bytes(self.peak_bytes):>11}/device "
                f"~{self.step_s * 1e3:9.1f} ms/step")


@dataclass
class Costs:
    """The cost model's constants, and FSDP's unit sizes per precision (what a rank gathers)."""

    flops_per_s: float
    link_bytes_per_s: float
    host_bytes_per_s: float
    micro_batch_overhead_s: float
    units: dict[str, list[int]]
    tensor_link_bytes_per_s: float = DEFAULT_TENSOR_LINK_BYTES_PER_S
    #: per tensor-parallel degree: the shard model's FSDP units and its traffic
    tensor: dict[int, TensorCosts] = field(default_factory=dict)


@dataclass(frozen=True)
class TensorCosts:
    """What a tensor-parallel degree adds to the cost model: its shard model's FSDP unit sizes per
    precision, and what one sample moves through the group's collectives."""

    units: dict[str, list[int]]
    traffic: TensorTraffic


def _activation_bytes(precision: str) -> int:
    return 4 if precision == "32-true" else 2


def tensor_comm_s(traffic: TensorTraffic, degree: int, samples: int, precision: str, link_bytes_per_s: float) -> float:
    """Seconds the collectives of a tensor group of ``degree`` take for ``samples`` samples (ring
    all-reduce 2(T-1)/T, all-gather (T-1)/T of the bytes, over ``link_bytes_per_s``)."""
    share = (degree - 1) / degree
    moved = (2 * share * traffic.reduced + share * traffic.gathered) * samples * _activation_bytes(precision)
    return moved / link_bytes_per_s


def option_for(estimate: MemoryEstimate, precision: str, ckpt: str, layout: Layout, micro: int,
               accumulate: int, costs: Costs, exact: bool = False) -> FitOption:
    """``estimate`` (the plan of one micro-batch on one device) priced for ``layout``.

    Raises:
        ConfigurationError: a layout the cost model does not price (tensor parallelism, or two kinds of
            split at once).
    """
    kinds = sum(d > 1 for d in (layout.replicas, layout.shards, layout.stages))
    tensor = layout.tensor
    if kinds > 1 or (tensor > 1 and (layout.stages > 1 or tensor not in costs.tensor)):
        raise ConfigurationError(f"the planner does not price the layout {layout.describe()!r}: it plans one kind "
                                 "of data-parallel split (replicas, shards) or stages, each with or without tensor "
                                 "groups it was given the costs of.")
    n = layout.replicas * layout.shards * layout.stages  # devices that split the data (or the stages)
    rate = costs.flops_per_s * (1 if precision == "32-true" else 2)
    compute_s = accumulate * (estimate.flops / rate + costs.micro_batch_overhead_s)
    share = (n - 1) / n if n > 1 else 0.0
    grads, params = estimate.gradients_bytes, estimate.parameters_bytes
    gathered = params / 2 if precision == "bf16-mixed" else params  # FSDP gathers in the compute dtype
    peak = estimate.peak_bytes
    units = costs.units[precision]
    if tensor > 1:  # the estimate is of one rank's shard model: add what the group exchanges
        extra = costs.tensor[tensor]
        units = extra.units[precision]
        compute_s += accumulate * tensor_comm_s(extra.traffic, tensor, micro, precision, costs.tensor_link_bytes_per_s)
        # the gathered logits (the shard model held 1/T of them), and their gradient
        peak += 2 * micro * extra.traffic.gathered * (tensor - 1) // tensor * _activation_bytes(precision)
    if n == 1:
        step_s = compute_s
    elif layout.replicas > 1:
        peak += grads  # DDP's gradient buckets
        step_s = compute_s + 2 * share * grads / costs.link_bytes_per_s
    elif layout.shards > 1:
        sharded = shard_estimate(replace(estimate, peak_bytes=peak), n, units)
        peak = sharded.peak_bytes
        comm = accumulate * share * (2 * gathered + grads) / costs.link_bytes_per_s
        step_s = compute_s + comm
        if layout.offload:
            peak -= sharded.parameters_bytes + sharded.gradients_bytes + sharded.optimizer_state_bytes
            host = sharded.parameters_bytes + sharded.gradients_bytes
            step_s += accumulate * host / costs.host_bytes_per_s
            step_s += (sharded.optimizer_state_bytes + host) / costs.host_bytes_per_s
    else:  # pipeline: GPipe with 4n micro-batches per batch
        chunks = 4 * n
        peak = int(peak / n * _PIPELINE_IMBALANCE)
        step_s = compute_s * (chunks + n - 1) / chunks / n
    return FitOption(precision, ckpt, layout, micro, accumulate, int(peak), step_s, exact)
