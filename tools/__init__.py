"""Build-time tools run from a checkout (`python -m tools...`); not part of the installed distribution."""
