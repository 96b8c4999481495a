"""What runs with a stage on its host: the launcher wrapper around it (:mod:`.launcher`), its context for events,
progress and pauses (:mod:`.runtime`), where its metrics go besides its events (:mod:`.metric_sinks`), and its ranks
when it runs as several processes under torchrun (:mod:`.ranks`). Above hosts; nothing else in the run machinery
imports it."""
