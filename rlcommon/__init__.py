"""Shared platform of the three services: config models, wire schema, Redis Streams bus, embedded
redis-server, tasks and rewards, and the tiny-model builder. Imports no torch at package level."""
