"""A DTensor's whole value, gathered over its mesh's own device.

FSDP's CPU offload keeps parameters, gradients and optimizer state as DTensors on the CPU while their
mesh is a CUDA one: ``full_tensor()`` then runs its collective on CPU tensors over NCCL, which fails
("No backend type associated with device type cpu"; pytorch#148532) on 2 or more GPUs -- gloo and one-GPU
meshes skip the collective, so CPU tests cannot show it. torch's own state-dict gathering moves such a
DTensor to its mesh's device first; so does this.
"""

from __future__ import annotations

from typing import Any

__all__ = ["full_tensor"]


def full_tensor(value: Any, *, back: bool = True) -> Any:
    """``value.full_tensor()``, gathered on its mesh's device type; with ``back`` the result returns to
    ``value``'s own device (one whole tensor on the GPU at a time, not the whole state)."""
    mesh_device = value.device_mesh.device_type
    if value.device.type == mesh_device:
        return value.full_tensor()
    whole = value.to(mesh_device).full_tensor()
    return whole.to(value.device) if back else whole
