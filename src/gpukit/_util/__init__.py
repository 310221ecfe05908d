"""Small helpers shared by every layer: units, timeouts, processes, warnings, progress, version.

``units``, ``timeouts``, ``cpu``, ``lazy``, ``process``, ``precision_names`` and ``version`` never import torch, so the
lowest layers (``devices``, ``cluster``, ``doctor``) may use them; ``warnings`` does. Nothing here
imports another part of gpukit but ``errors``.
"""
