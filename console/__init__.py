"""Aerie console: the operator-side Textual app and CLI."""
