"""rankwatch diagnosis engines: pure numpy, no torch, no OTel, no HTTP."""
