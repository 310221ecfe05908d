"""Shared test set-up: GPU markers that skip cleanly on CPU-only machines."""

from __future__ import annotations

import pytest


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs = [(item, m) for item in items for m in item.iter_markers() if m.name in ("requires_gpu", "requires_gpus")]
    if not needs:
        return
    available = _cuda_device_count()
    for item, marker in needs:
        wanted = 1 if marker.name == "requires_gpu" else int(marker.args[0])
        if available < wanted:
            item.add_marker(pytest.mark.skip(reason=f"needs {wanted} CUDA GPU(s), {available} available"))


@pytest.fixture(autouse=True)
def _restore_environ():
    """Undo any environment change a test makes (use_gpus writes CUDA_VISIBLE_DEVICES, ...)."""
    import os

    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
