"""The official MCP conformance suite run against a live broker (see test_conformance.py)."""
