"""Console screens: help, confirmation dialog, full log."""
