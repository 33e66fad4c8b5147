"""The cache format, shared by both stages and importing nothing of theirs (docs/architecture.md, "The cache")."""
