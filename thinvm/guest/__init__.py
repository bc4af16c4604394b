"""The guest as seen from the host: images, the agent protocol, workloads."""
