"""Publishing: every window's report, once, to ``/metrics`` (:mod:`.prometheus`), OTLP
(:mod:`.otlp`) and incident log lines (:mod:`.events`), through one hub (:mod:`.hub`). The
series are defined in :mod:`.catalogue` and computed in :mod:`.samples`; incidents open and
close in :mod:`.incidents`; :mod:`.recorder` writes a run's summary, in the words of
:mod:`.verdicts`."""
