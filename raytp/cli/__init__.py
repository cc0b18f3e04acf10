"""The `raytp` command line: `generate` (offline), `serve` (the OpenAI API on Ray Serve)."""
