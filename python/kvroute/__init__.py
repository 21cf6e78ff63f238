"""kvroute: KV-cache-aware request routing for fleets of LLM inference engines."""
