"""Collectives with byte counters, row layouts and the exchanges that move rows, replicas, sharding."""
