"""Small helpers shared by every layer: units, timeouts, processes, warnings, progress, seeding.

``units``, ``timeouts``, ``cpu``, ``lazy`` and ``process`` never import torch, so the lowest
layers (``devices``, ``cluster``, ``doctor``) may use them; ``warnings`` and ``seeding`` do.
"""
