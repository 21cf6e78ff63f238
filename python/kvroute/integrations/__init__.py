"""Integrations of kvroute with serving frameworks (Ray Serve, LiteLLM); see README.md."""
