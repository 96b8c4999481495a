"""Aerie themes: the console look as data."""
