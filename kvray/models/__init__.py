"""Decoder model definitions (tensor/pipeline-parallel aware) and weight loading."""
