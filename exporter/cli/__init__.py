"""The ``rankwatch`` command (:mod:`.main`) and what only it uses: the demo job (:mod:`.demo`)
and its live table (:mod:`.live_table`), DeepEP heatmaps (:mod:`.heatmap`) and the shipped
operator files (:mod:`.assets`)."""

from rankwatch.exporter.cli.main import main

__all__ = ["main"]
