"""Alerts, raised on the executing host: the rules (:mod:`.rules`, :mod:`.stage_rules`), the run's alert records
(:mod:`.record`, ``RUN/alerts.jsonl``), the watcher the supervisor calls once per cycle (:mod:`.watcher`) and the
hook runner (:mod:`.hooks`, :mod:`.deliver`). Front ends only read the records and send ``ack``/``silence``."""
