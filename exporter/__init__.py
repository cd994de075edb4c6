"""rankwatch exporter: collectors inside training ranks, windows, publishers, CLI."""
