"""The client facade, its fan-out and the outage hold."""
