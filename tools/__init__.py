"""Developer tooling (not installed with the package)."""
