"""The group's aggregator: every rank's rows in, windows, diagnosis and reports out, off the
training processes.

A group's root used to receive every rank's rows, build the windows, diagnose and publish on
threads of its training process, sharing its interpreter lock with training, at a cost that grew
with the group. The aggregator does that work in a child process of the root instead
(:mod:`.process` starts and watches it; :mod:`.service` is its loop): every rank, the root
included, keeps one TCP connection to it (:mod:`.wire`, :mod:`.intake`); it keeps each rank's
rows (:mod:`.rows`) and the group's rounds and windows (:mod:`.windows`), saves the window
files, and sends the root's process each report bounded to ``root_rank_budget`` ranks
(:mod:`.bounded`), which the root's publishers publish as before. What the root's hang loop
needs of it (each rank's progress, closed connections) it writes to a shared board
(:mod:`.board`). The cost on every training process, the root's included, no longer depends on
the size of the group (``docs/benchmarks.md``).
"""
