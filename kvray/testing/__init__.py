"""Test helpers that ship with kvray (a namespace cluster harness)."""
