"""Scheduling: who runs each step, and the KV block bookkeeping behind it. Pure Python."""
