"""specd HTTP front end (OpenAI-compatible; see the OpenAI server issue) and the CLI."""
