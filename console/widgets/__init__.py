"""Console widgets: they read the run model and never touch processes, files or SSH."""
