"""The typed contracts between stages: each stage's ``manifest.json``, one frozen dataclass per kind.

A stage reads what the stages before it made only through these classes, never by string keys, so a
renamed or missing key fails in one place, with the file and the key named:

- :mod:`.shards`: ``tokenized`` and ``prompts`` (prep and regen; :class:`~.shards.ShardsManifest`);
- :mod:`.hidden_store`: ``hidden_states`` (extract; :class:`~.hidden_store.HiddenStatesManifest`);
- :mod:`.vocab`: ``vocab`` (vocab; :class:`~.vocab.VocabManifest`);
- :mod:`.train`: ``draft`` (train; :class:`~.train.DraftManifest`, the draft method's keys an opaque dict);
- :mod:`.bench`: ``bench`` (bench, offline and online; :class:`~.bench.BenchManifest`);
- :mod:`.base`: what they share: :class:`~.base.ManifestError`, the version rule, reading and writing.

Each module has ``read(path)`` / ``write(path, manifest)``, and each class ``from_dict`` / ``to_dict`` and a
``VERSION``. The JSON keys on disk are the dataclass's field names, the same as before the classes existed, plus
``manifest_version`` (a file without it is version 1, so older run directories read as they are; a file of a
newer version than this code knows is refused). Keys a class does not name are kept (``extra``, or the train
manifest's ``method``) and written back, so a rewrite by older code loses nothing a newer writer added.

Standard library only, and imports nothing else of ``pipeline``: the run machinery (``pipeline.run``: the
disk budget reads the tokenized manifests) sits above it (tests/test_layout.py), and so does every stage.
"""
