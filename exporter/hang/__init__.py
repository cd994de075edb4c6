"""The rank-side hang watcher: what a rank's training thread is doing when the job stops.

Every rank's watcher thread (:mod:`.watch`) looks at its step timer's progress; once the rank is
suspect it reads the training thread's frames (:mod:`.record`: the phase, the c10d call it is
in; :mod:`.finished_calls`: per group, the last call it finished) and writes its record to the
group's prefix of the job's c10d store, and to a file (:mod:`.file`). The group's root runs the
hang loop (:mod:`.root`): silent and dead ranks, the verdict of
:mod:`rankwatch.diagnosis.hang`, the ``hang`` incident opened and closed; another rank stands in
for a root that is gone (:mod:`.standin`). ``docs/hang.md`` tells the whole story.
"""
