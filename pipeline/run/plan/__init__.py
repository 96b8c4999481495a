"""The plan: a TOML file loaded into a stage DAG (:mod:`.dag`), its typed tables (:mod:`.schema`, :mod:`.sections`,
:mod:`.tables`, :mod:`.stages`) and the built-in models a plan can name. Standard library only: the console and the
container both read plans. The bottom of the run machinery: it imports no other part of it."""
