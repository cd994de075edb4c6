"""Step-time collection: the ``RankWatch`` object (:mod:`.rank_watch`), the step timer
(:mod:`.timer`), the hooks that drive it (:mod:`.hooks`), GPU-clock events
(:mod:`.gpu_events`), and the shipping of rows to the group's root, which builds windows
(:mod:`.collector`) and saves them (:mod:`.artifacts`)."""
