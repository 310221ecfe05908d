"""Run records, read back: the HTML report and the TensorBoard replay (``gpukit report``)."""

from __future__ import annotations

from gpukit.report._html import render_report, write_report
from gpukit.report._read import RankRecord, RunInfo, RunRecord, read_record
from gpukit.report._replay import replay_to_tensorboard
from gpukit.report._summary import RunSummary, summarize

__all__ = ["RankRecord", "RunInfo", "RunRecord", "RunSummary", "read_record", "render_report",
           "replay_to_tensorboard", "summarize", "write_report"]
