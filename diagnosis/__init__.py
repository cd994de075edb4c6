"""rankwatch diagnosis engines: pure numpy, no torch, no OTel, no HTTP.

:mod:`.step_time` (is one rank a straggler, and why) and :mod:`.deepep` (DeepEP normal mode and
the low-latency matrix rule) read windows of measurements and return reports; :mod:`.report`
is the one report every publisher reads. What both engines share: their thresholds
(:mod:`.config`), their words (:mod:`.vocabulary`) and the pruning of saved windows
(:mod:`.retention`).
"""
