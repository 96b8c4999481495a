"""Aerie pipeline: the stages and the run model that run on the container."""
