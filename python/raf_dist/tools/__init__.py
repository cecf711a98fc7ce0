"""Command-line tools: ``python -m raf_dist.tools.<name> --help``."""
